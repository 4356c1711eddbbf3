"""Draft proposers. Both run in the device lane at the end of a step, after the
step's tokens are committed, and leave the next step's drafts in the request's
state slot (`drafts[slot]`, `num_drafts[slot]`). No host synchronisation.

MTP runs the head over *every* position the target computed in the step, with
t[i+1] read back from the committed history: prompt chunks thereby build the
head's KV for the prompt, and a verify step overwrites the head's KV at its
positions with the accepted tokens. The first draft comes from the last
accepted position of each sampling row; further drafts apply the head
recurrently on its own normed output (positions beyond the row's block table
write to a scratch block: drafts there may be worse, never wrong).

MTP with `ngram_first`: where a prompt lookup finds the row's last tokens earlier in
its history, the tokens that followed them are the drafts; the head's drafts fill
the other rows. A one-layer head copies badly (on the default model's chat answers
its top-1 is right at 35 % of the positions where a 4-gram lookup is right at 89 %).
In a token tree the lookup draft is the first candidate and the alternatives are the
head's best tokens other than it (candidates must differ for exact sampling). Both
drafters are deterministic, so verification stays exact either way.
"""

from __future__ import annotations

from typing import Protocol

import torch

from laneserve.model.attention import AttentionMetadata
from laneserve.model.mtp import MtpHead
from laneserve.spec_decode.ngram import NgramProposer


class StepView(Protocol):
    """What a proposer may read about the step that just ran (device tensors)."""

    slots: torch.Tensor  # [Rs] state slots of the sampling rows
    last_index: torch.Tensor  # [Rs] token row of each sampling row's last accepted position
    positions: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, H] target normed hidden
    meta_mtp: AttentionMetadata | None  # the step's attention metadata for the MTP cache group
    # [Rs, W + 1] MTP block table rows (last column: scratch); None at depth 1 (k = 1 or a
    # depth-1 tree), where no draft goes past the first position
    mtp_table: torch.Tensor | None
    max_len: int  # host bound on every sampling row's length


class MtpProposer:
    def __init__(
        self,
        head: MtpHead,
        k: int,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        block_size: int,
        alternatives: int = 0,  # token tree: the head's next-best tokens for the first draft
        lookup: NgramProposer | None = None,  # ngram_first: lookup drafts win where found
    ) -> None:
        self.head, self.k, self.kv_cache, self.block_size = head, k, kv_cache, block_size
        self.alternatives, self.lookup = alternatives, lookup

    def propose(self, state: object, view: StepView, next_tokens: torch.Tensor) -> None:
        out = self.head.forward(
            next_tokens, view.hidden, view.positions, view.meta_mtp, self.kv_cache
        )
        if view.slots.numel() == 0:
            return  # a prompt chunk: only the head's KV was needed
        h = out.index_select(0, view.last_index)  # [Rs, H]
        top = self.head.draft_top(h, 1 + self.alternatives) if self.alternatives else None
        token = top[:, 0] if top is not None else self.head.draft(h)
        drafts = [token]
        pos = view.positions.index_select(0, view.last_index) if self.k > 1 else None
        for _ in range(self.k - 1):
            pos = pos + 1
            h = self.head.forward(token, h, pos, self._single_token_meta(view, pos), self.kv_cache)
            token = self.head.draft(h)
            drafts.append(token)
        chain = torch.stack(drafts, dim=1)
        if self.lookup is None:
            state.drafts[view.slots, : self.k] = chain
            state.num_drafts.index_fill_(0, view.slots, self.k)
            if top is not None:
                state.side_drafts[view.slots, : self.alternatives] = top[:, 1:]
            return
        found, num = self.lookup.lookup(state, view)
        hit = num > 0
        state.drafts[view.slots, : self.k] = torch.where(hit[:, None], found, chain)
        state.num_drafts.index_copy_(0, view.slots, torch.where(hit, num, self.k))
        if top is not None:  # the head's best tokens other than the first draft
            others = torch.where(hit[:, None], best_except(top, found[:, 0]), top[:, 1:])
            state.side_drafts[view.slots, : self.alternatives] = others

    def _single_token_meta(self, view: StepView, pos: torch.Tensor) -> AttentionMetadata:
        bs, table = self.block_size, view.mtp_table
        col = torch.div(pos, bs, rounding_mode="floor").clamp(max=table.shape[1] - 1)
        block = table.gather(1, col[:, None]).squeeze(1)
        rows = pos.shape[0]
        return AttentionMetadata(
            slot_mapping=block * bs + pos % bs,
            num_decode_tokens=rows,
            decode_block_tables=table.to(torch.int32),
            decode_seq_lens=(pos + 1).to(torch.int32),
            decode_query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=pos.device),
            prefills=(),
        )


def best_except(top: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """[R, 1 + W] best-first candidates -> the best W that differ from token [R] (the
    alternatives of a token tree must all differ from the first draft)."""
    differ = top != token[:, None]
    order = torch.sort((~differ).to(torch.int8), dim=1, stable=True).indices
    return top.gather(1, order)[:, : top.shape[1] - 1]
