"""The contract between the model runner and a draft proposer.

A proposer runs in the device lane at the end of a step, after the step's tokens
are committed to the device state, and writes the next step's drafts into the
requests' state slots. It never synchronises with the host. The runner owns the
state (`DraftSlots`) and describes the step that just ran (`StepView`); the
proposer reads both and writes `drafts` / `num_drafts` (and `side_drafts` for a
token tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from laneserve.model.layers.attention import AttentionMetadata, TokenTableMetadata


class DraftSlots(Protocol):
    """Device state, one row per state slot, that a proposer reads and writes."""

    width: int  # columns of `history` (the longest sequence a slot can hold)
    history: torch.Tensor  # [S, width] token ids: prompt, then every confirmed output
    committed: torch.Tensor  # [S] number of known tokens per slot
    drafts: torch.Tensor  # [S, K] the next verify's draft tokens
    num_drafts: torch.Tensor  # [S] drafts per slot (the lookup may find fewer than K)
    side_drafts: torch.Tensor  # [S, A] alternatives to drafts[:, 0] (token tree)


@dataclass(frozen=True)
class StepView:
    """What a proposer may read about the step that just ran (device tensors)."""

    slots: torch.Tensor  # [Rs] state slots of the sampling rows
    last_index: torch.Tensor  # [Rs] token row of each sampling row's last accepted position
    positions: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, H] target normed hidden ([T, N * H] streams for DeepSeek V4)
    # the step's attention metadata for the MTP cache group (V4: its table per token;
    # a paged_groups head: one per group it reads)
    meta_mtp: AttentionMetadata | TokenTableMetadata | tuple[AttentionMetadata, ...] | None
    # per MTP cache group, [Rs, W + 1] block table rows (last column: scratch); None at
    # depth 1 (k = 1 or a depth-1 tree), where no draft goes past the first position
    mtp_tables: tuple[torch.Tensor, ...] | None
    max_len: int  # host bound on every sampling row's length


class Proposer(Protocol):
    """Leaves the next step's drafts in `state` for the sampling rows of `view`."""

    def propose(self, state: DraftSlots, view: StepView, next_tokens: torch.Tensor) -> None:
        """`next_tokens` [T]: t[i+1] for every position i of the step (from the history)."""
        ...
