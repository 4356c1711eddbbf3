"""The embedding, pre-norm residual stack and LM head every decoder family shares."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from laneserve.model.interface import PAGED
from laneserve.model.layers.linear import Linear
from laneserve.model.layers.norm import RMSNorm
from laneserve.model.layers.parallel import ParallelLMHead, VocabParallelEmbedding


class DecoderStack:
    """What every decoder family here shares after its own layers are built: the
    embedding, the pre-norm residual stack (each layer's input norm fused with the
    residual add of the layer before) and the LM head. Subclasses set the attributes.

    forward(ids, positions, meta, caches) -> (normed hidden, pre-norm hidden)."""

    step_kind = PAGED  # the main group's AttentionMetadata and caches (model/interface.py)
    decode_graph_kind: str | None = PAGED
    mtp_reads_second_output = False  # the MTP head reads the normed hidden states

    embed_tokens: torch.Tensor  # [V, H]
    act_dtype: torch.dtype
    layers: Sequence[
        Any
    ]  # each: .input_norm (RMSNorm), called (pos, hidden, residual, cache, meta)
    norm: RMSNorm
    lm_head: Linear | ParallelLMHead
    vocab_embed: VocabParallelEmbedding | None = None  # tensor parallel: this rank's rows

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_embed is not None:
            return self.vocab_embed(input_ids).to(self.act_dtype)
        return F.embedding(input_ids, self.embed_tokens).to(self.act_dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: Any,  # AttentionMetadata
        caches: Sequence[Any],  # one per layer
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [T, H]
        residual = self.embed(input_ids)
        hidden = self.layers[0].input_norm(residual)
        for i, layer in enumerate(self.layers):
            if i:
                layer.input_norm.add_(hidden, residual)
            hidden = layer(positions, hidden, residual, caches[i], meta)
        self.norm.add_(hidden, residual)
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, V] fp32
        return self.lm_head(hidden).float()
