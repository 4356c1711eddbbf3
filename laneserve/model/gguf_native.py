"""The linear weights of a GGUF file kept quantized (`--gguf-weights quantized`).

The converted cache directory (gguf.py) still supplies the config, the tokenizer and
every other tensor; this reads the projection matrices whose GGUF type the kernels run
natively (q4_0, q4_1, q8_0, q4_k: `laneserve/kernels/quant.py`) straight from the
memory-mapped file as `QuantWeight`s, with llama.cpp's q/k row interleave undone on the
block rows. The tied LM head is the quantized token embedding (`lm_head.weight`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from laneserve.kernels.quant import QTYPES, QuantWeight
from laneserve.model.gguf import _hf_name, _unpermute

log = logging.getLogger(__name__)

# HF names whose weights stay quantized: the decoder's projections and the LM head
_LINEAR_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


class GgufQuantWeights:
    """HF name -> QuantWeight for the file's natively supported linear weights."""

    def __init__(self, path: Path, config: dict, activations: str = "fp32") -> None:
        import gguf

        self.path = path
        self.activations = activations  # QuantWeight.activations: "fp32" or "q8"
        reader = gguf.GGUFReader(str(path))
        self._tensors = {}
        for t in reader.tensors:
            name = _hf_name(t.name)
            qtype = t.tensor_type.name.lower()
            if name is None or qtype not in QTYPES:
                continue
            if name == "model.embed_tokens.weight" and config.get("tie_word_embeddings"):
                name = "lm_head.weight"  # the tied head multiplies by the embedding
            if name == "lm_head.weight" or name.endswith(_LINEAR_SUFFIXES):
                self._tensors[name] = (t, qtype)
        self._permute = config["model_type"] in ("llama", "mistral")
        self._heads = {
            "q_proj.weight": config["num_attention_heads"],
            "k_proj.weight": config["num_key_value_heads"],
        }
        log.info(
            "GGUF weights kept quantized: %d linear weights (activations %s)",
            len(self._tensors),
            "rounded to int8 per 32" if activations == "q8" else "fp32",
        )

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def get(self, name: str) -> QuantWeight:
        t, qtype = self._tensors[name]
        in_features = int(t.shape[0])  # GGUF shapes are [K, N]
        rows = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # [N, row bytes] uint8
        if self._permute:
            for suffix, heads in self._heads.items():
                if name.endswith(suffix):
                    rows = _unpermute(rows, heads)
        data = torch.from_numpy(np.array(rows, dtype=np.uint8, copy=True))
        return QuantWeight(data, qtype, in_features, self.activations)
