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

from collections.abc import Sequence
from typing import Any

import torch

from laneserve.model.interface import (
    TOKEN_TABLES,
    DraftHead,
    for_draft_head,
    single_group_tables,
)
from laneserve.model.layers.attention import AttentionMetadata
from laneserve.spec_decode.base import DraftSlots, Proposer, StepView
from laneserve.spec_decode.ngram import NgramProposer

__all__ = ["MtpProposer", "NgramProposer", "Proposer", "StepView"]


class MtpProposer:
    def __init__(
        self,
        head: DraftHead,  # the target's MTP head (model/interface.py)
        k: int,
        # per cache group the head reads (`head.cache_groups`): its layer's (K, V), or
        # (latent,) for MLA, or (keys,) for DeepSeek V3.2's indexer
        group_caches: Sequence[tuple[torch.Tensor, ...]],
        block_size: int,
        alternatives: int = 0,  # token tree: the head's next-best tokens for the first draft
        lookup: NgramProposer | None = None,  # ngram_first: lookup drafts win where found
    ) -> None:
        self.head, self.k, self.block_size = head, k, block_size
        self.kv_cache = for_draft_head(head, group_caches)
        self.alternatives, self.lookup = alternatives, lookup

    def propose(self, state: DraftSlots, view: StepView, next_tokens: torch.Tensor) -> None:
        # NOTE: the runner always builds the MTP group's metadata when this proposer exists.
        assert view.meta_mtp is not None, "MTP drafts need the MTP cache group's metadata"
        out = self.head.forward(
            next_tokens,
            view.hidden,
            view.positions,
            view.meta_mtp,  # the head's own kind (see StepView)
            self.kv_cache,
        )
        if view.slots.numel() == 0:
            return  # a prompt chunk: only the head's KV was needed
        h = out.index_select(0, view.last_index)  # [Rs, H]
        top = self.head.draft(h, 1 + self.alternatives)  # [Rs, 1 + A] best first
        chain = top[:, :1] if self.k == 1 else self._chain(view, h, top[:, 0])  # [Rs, k]
        found = num = None
        if self.lookup is not None:
            found, num = self.lookup.lookup(state, view)
        self.head.kernels.write_drafts(
            state.drafts,
            state.num_drafts,
            state.side_drafts,
            view.slots,
            chain,
            top if self.alternatives else None,
            found,
            num,
        )

    def _chain(self, view: StepView, h: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Drafts 2..k: the head applied recurrently on its own output. [Rs, k]"""
        tables = view.mtp_tables
        assert tables is not None, "recurrent drafts (k > 1) need the MTP block tables"
        drafts = [token[:, None]]
        pos = view.positions.index_select(0, view.last_index)
        bound = view.max_len + self.k  # NOTE: above every position drafted here
        for _ in range(self.k - 1):
            pos = pos + 1
            meta = self._single_token_meta(tables, pos, bound)
            h = self.head.forward(token, h, pos, meta, self.kv_cache)
            token = self.head.draft(h)[:, 0]
            drafts.append(token[:, None])
        return torch.cat(drafts, dim=1)

    def _single_token_meta(
        self, tables: tuple[torch.Tensor, ...], pos: torch.Tensor, bound: int
    ) -> Any:  # the head's step kind, for its groups' `tables`
        if self.head.step_kind == TOKEN_TABLES:  # NOTE: it reads a table per token
            return single_group_tables(tables[0], bound)
        return for_draft_head(self.head, [self._decode_meta(t, pos) for t in tables])

    def _decode_meta(self, table: torch.Tensor, pos: torch.Tensor) -> AttentionMetadata:
        """One decode row per draft row at `pos`, in the group whose rows are `table`."""
        bs = self.block_size
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
