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

import torch

from laneserve.model.interface import TOKEN_TABLES, DraftHead, single_group_tables
from laneserve.model.layers.attention import AttentionMetadata, TokenTableMetadata
from laneserve.spec_decode.base import DraftSlots, Proposer, StepView
from laneserve.spec_decode.ngram import NgramProposer

__all__ = ["MtpProposer", "NgramProposer", "Proposer", "StepView"]


class MtpProposer:
    def __init__(
        self,
        head: DraftHead,  # the target's MTP head (model/interface.py)
        k: int,
        kv_cache: tuple[torch.Tensor, ...],  # (K, V), or (latent,) for MLA
        block_size: int,
        alternatives: int = 0,  # token tree: the head's next-best tokens for the first draft
        lookup: NgramProposer | None = None,  # ngram_first: lookup drafts win where found
    ) -> None:
        self.head, self.k, self.kv_cache, self.block_size = head, k, kv_cache, block_size
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
        table = view.mtp_table
        assert table is not None, "recurrent drafts (k > 1) need the MTP block table"
        drafts = [token[:, None]]
        pos = view.positions.index_select(0, view.last_index)
        bound = view.max_len + self.k  # NOTE: above every position drafted here
        for _ in range(self.k - 1):
            pos = pos + 1
            meta = self._single_token_meta(table, pos, bound)
            h = self.head.forward(token, h, pos, meta, self.kv_cache)
            token = self.head.draft(h)[:, 0]
            drafts.append(token[:, None])
        return torch.cat(drafts, dim=1)

    def _single_token_meta(
        self, table: torch.Tensor, pos: torch.Tensor, bound: int
    ) -> AttentionMetadata | TokenTableMetadata:
        if self.head.step_kind == TOKEN_TABLES:  # NOTE: it reads a table per token
            return single_group_tables(table, bound)
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
