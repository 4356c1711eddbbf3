"""The lightning indexer of a DeepSeek V3.2 attention layer: which past tokens a query
attends to.

Per token it writes one key of `index_head_dim` values to the layer's indexer cache
(its own cache group, `model.cache_groups`). A query scores every visible key and
keeps the `index_topk` best:

```
 q_h   = rope(wq_b(q_lora_out))_h            [Hi, Di]   (per head)
 k_j   = rope(LayerNorm(wk(x_j)))            [Di]       (the cache entry)
 w_h   = weights_proj(x) / sqrt(Hi)          fp32, the weights kept in fp32
 score_j = sum_h w_h * relu(q_h . k_j / sqrt(Di))
```
The rope is MLA's (same frequencies and yarn scale) on the first `qk_rope_head_dim`
values, rotating half-split pairs where MLA rotates interleaved ones. DeepSeek's own
kernels also apply a Hadamard rotation to q and k and score in fp8; the rotation leaves
q . k unchanged and fp8 is a precision choice, so both are left out (as transformers does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.kernels import Kernels
from laneserve.model.arch import ArchConfig
from laneserve.model.layers.linear import Linear
from laneserve.model.layers.rope import MlaRotary
from laneserve.model.layers.weights import WeightGetter

K_NORM_EPS = 1e-6  # the release's indexer LayerNorm
# query rows scored at once in a prompt chunk: bounds the [rows, Hi, keys] fp32 scores
SCORE_BUDGET = 1 << 25


class Indexer:
    def __init__(
        self, arch: ArchConfig, kernels: Kernels, get: WeightGetter, prefix: str, rotary: MlaRotary
    ) -> None:
        ip, p = arch.indexer, arch.deepseek
        assert ip is not None and p is not None, "a DeepSeek V3.2 architecture"
        a = f"{prefix}.self_attn.indexer"
        self.heads, self.dim, self.rope = ip.index_n_heads, ip.index_head_dim, p.qk_rope_head_dim
        self.topk = ip.index_topk
        self.wq_b = Linear(kernels, get(f"{a}.wq_b.weight"), None)  # [Hi * Di, q_lora_rank]
        self.wk = Linear(kernels, get(f"{a}.wk.weight"), None)  # [Di, H]
        self.k_norm = (
            get(f"{a}.k_norm.weight", torch.float32),
            get(f"{a}.k_norm.bias", torch.float32),
        )
        # NOTE: fp32 in every run, as the reference keeps it
        self.weights_proj = get(f"{a}.weights_proj.weight", torch.float32)  # [Hi, H]
        self.rotary = rotary
        self.scale = self.dim**-0.5

    def write_keys(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, H] the layer's normed input
        store: torch.Tensor,  # [blocks, bs, 1, Di] this layer's indexer cache
        slot_mapping: torch.Tensor,  # [T] the indexer group's slots
    ) -> None:
        raw = self.wk(x)
        # NOTE: in fp32 whatever the run dtype, as the reference's LayerNorm computes
        k = F.layer_norm(raw.float(), (self.dim,), *self.k_norm, K_NORM_EPS).to(raw.dtype)
        k_rot = self.rotary(positions, k[:, None, : self.rope], interleave=False)[:, 0]
        k = torch.cat([k_rot, k[:, self.rope :]], dim=-1)
        store.view(-1, self.dim).index_copy_(0, slot_mapping, k.to(store.dtype))

    def queries(
        self,
        positions: torch.Tensor,  # [n]
        x: torch.Tensor,  # [n, H]
        q_lora_out: torch.Tensor,  # [n, q_lora_rank] MLA's normed q LoRA output
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (q [n, Hi, Di] fp32, head weights [n, Hi] fp32)
        n = x.shape[0]
        q = self.wq_b(q_lora_out).view(n, self.heads, self.dim)
        q_rot = self.rotary(positions, q[..., : self.rope], interleave=False)
        q = torch.cat([q_rot, q[..., self.rope :]], dim=-1).float()
        weights = (x.float() @ self.weights_proj.t()) * self.heads**-0.5
        return q, weights

    def select(
        self,
        q: torch.Tensor,  # [n, Hi, Di] fp32
        weights: torch.Tensor,  # [n, Hi] fp32
        keys: torch.Tensor,  # [n or 1, L, Di] the keys at positions 0 .. L - 1
        limit: torch.Tensor,  # [n] each query's position: it sees keys 0 .. limit
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (positions [n, k], selected [n, k] bool)
        """The top `index_topk` visible positions of each query (k = min(topk, L));
        `selected` is False where a query sees fewer than k keys."""
        scores = torch.matmul(q, keys.float().transpose(1, 2)) * self.scale  # [n, Hi, L]
        index = torch.matmul(weights[:, None, :], scores.relu()).squeeze(1)  # [n, L]
        span = torch.arange(keys.shape[1], device=q.device)
        visible = span[None, :] <= limit[:, None]
        # NOTE: masked_fill also clears a NaN from an unwritten (uninitialised) entry
        index = index.masked_fill(~visible, float("-inf"))
        top = index.topk(min(self.topk, keys.shape[1]), dim=-1).indices  # [n, k]
        return top, top <= limit[:, None]

    def rows_per_chunk(self, num_keys: int) -> int:
        """Query rows of a prompt chunk scored at once."""
        return max(1, SCORE_BUDGET // max(1, self.heads * num_keys))
