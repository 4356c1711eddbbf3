"""The DeepSeek Sparse Attention keys of a V3.2 config.json (`IndexerParams`).

Imports nothing of laneserve's, so `model/arch.py` can read it.
"""

from __future__ import annotations

from dataclasses import dataclass


class IndexerConfigError(ValueError):
    """config.json's indexer keys are missing or describe a layout laneserve does not run."""


@dataclass(frozen=True)
class IndexerParams:
    """The lightning indexer of every V3.2 attention layer."""

    index_topk: int  # past tokens each query attends to (at most)
    index_head_dim: int  # the indexer's query / key size; its first rope dims are rotated
    index_n_heads: int  # query heads, one weight each from `weights_proj`

    @staticmethod
    def from_hf(cfg: dict) -> IndexerParams:
        params = IndexerParams(
            index_topk=_positive(cfg, "index_topk"),
            index_head_dim=_positive(cfg, "index_head_dim"),
            index_n_heads=_positive(cfg, "index_n_heads"),
        )
        if not cfg.get("q_lora_rank"):
            raise IndexerConfigError(
                "q_lora_rank is required: the indexer's queries read the q LoRA output"
            )
        rope = cfg.get("qk_rope_head_dim")
        if not isinstance(rope, int) or rope > params.index_head_dim or rope % 2:
            raise IndexerConfigError(
                f"qk_rope_head_dim={rope!r} must be an even int <= index_head_dim "
                f"({params.index_head_dim}): the indexer rotates its first rope dims"
            )
        if cfg.get("rope_interleave", True) is not True:
            raise IndexerConfigError(
                "rope_interleave must be true (or absent): V3.2's MLA rotates interleaved "
                "pairs and its indexer half-split ones"
            )
        if cfg.get("indexer_rope_interleave", False) is not False:
            raise IndexerConfigError(
                "indexer_rope_interleave must be false (or absent): V3.2's indexer rotates "
                "half-split pairs; an interleaved indexer rope is not built"
            )
        return params


def _positive(cfg: dict, key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise IndexerConfigError(f"{key} must be a positive int, got {value!r}")
    return value
