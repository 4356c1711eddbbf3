"""What the worker, the runner and the proposers know of a model: an interface, never a
family. A model says what step metadata it takes (its *step kind*), which cache groups
its forward reads, which decode-graph buckets fit it, and what its MTP head reads; the
worker asks these and never checks a model's class.

```
 step kind      metadata its forward takes          caches its forward takes
 paged          AttentionMetadata of the main group  the main group's, per layer
 token_tables   TokenTableMetadata: every group's    every group's, per group, per layer
                table per token (DeepSeek V4)
 paged_groups   AttentionMetadata per cache group   every group's, per group, per layer
                (DeepSeek V3.2: MLA latents + indexer keys)
```
A draft (MTP) head has a step kind too: the metadata of its own cache groups, which it
names (`cache_groups`). A `paged` or `token_tables` head reads one group and takes that
group's metadata and layer tensors; a `paged_groups` head (DeepSeek V3.2's: its MTP
layer's latents and indexer keys) takes a tuple of both, one entry per group, in the
order it names them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from laneserve.kernels import Kernels
from laneserve.model.layers.attention import AttentionMetadata, TokenTableMetadata

PAGED = "paged"
TOKEN_TABLES = "token_tables"
PAGED_GROUPS = "paged_groups"
STEP_KINDS = (PAGED, TOKEN_TABLES, PAGED_GROUPS)

StepMetadata = AttentionMetadata | TokenTableMetadata | tuple[AttentionMetadata, ...]


class CausalLM(Protocol):
    """A target model as the worker runs it."""

    kernels: Kernels
    # PAGED, TOKEN_TABLES or PAGED_GROUPS (see the table above): what `forward` takes
    step_kind: str
    # the decode-graph buckets that fit it (worker/cuda_graphs*.py): a step kind, or None
    decode_graph_kind: str | None
    # True: forward's second output (the residual streams) is what its MTP head reads;
    # False: the head reads the first (the normed hidden states)
    mtp_reads_second_output: bool
    # whether step N + 1's inputs may be prepared while step N runs
    supports_async_prepare: bool

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, caches: Any
    ) -> tuple[torch.Tensor, ...]:
        """(normed hidden [T, H], a second output: pre-norm hidden or residual streams)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, V] fp32
        ...


class DraftHead(Protocol):
    """A model's MTP head as the proposer runs it."""

    kernels: Kernels
    step_kind: str  # the metadata its forward takes for its own cache groups
    cache_groups: tuple[str, ...]  # the names of the cache groups it reads, in that order

    def forward(
        self,
        next_tokens: torch.Tensor,  # [T] t[i+1] for each position i
        hidden: torch.Tensor,  # [T, H] (or streams) at i: the target's or the previous depth's
        positions: torch.Tensor,  # [T] i
        meta: Any,  # of `step_kind` (paged_groups: one AttentionMetadata per group)
        cache: Any,  # its group's tensors (paged_groups: per group, that group's tensors)
    ) -> torch.Tensor: ...

    def draft(self, hidden: torch.Tensor, n: int = 1) -> torch.Tensor:  # [N, n] best first
        ...


def single_group_tables(table_per_token: torch.Tensor, max_len: int) -> TokenTableMetadata:
    """TOKEN_TABLES metadata of one cache group (a draft head's): its table per token."""
    return TokenTableMetadata((table_per_token.to(torch.int64),), max_len)


def for_draft_head(head: DraftHead, per_group: Sequence[Any]) -> Any:
    """What `head` takes of its cache groups' values (metadata or layer tensors, in the
    order of `head.cache_groups`): the one group's, or a paged_groups head's tuple."""
    assert len(per_group) == len(head.cache_groups), "one value per group the head reads"
    return tuple(per_group) if head.step_kind == PAGED_GROUPS else per_group[0]
