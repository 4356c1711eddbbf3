"""The device half of a step: committed state, forward, sampling, reclaim.

Device state (written only by the device lane, one row per state slot):

```
 history[slot, :]   token ids: prompt, then every confirmed output
 committed[slot]    number of known tokens (prompt + confirmed outputs)
 drafts[slot, :k]   pending draft tokens for the next verify (speculation)
 side_drafts[slot]  alternatives to drafts[slot, 0] (token tree, see side_rows.py)
```
A decode row's inputs are resolved here from that state, not from the
command: its position is committed - 1 and its token is history[committed - 1]
(the placeholder substitution of async scheduling), followed by the slot's
drafts. Nothing in `execute` reads a device value back to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from laneserve.model.interface import (
    PAGED,
    PAGED_GROUPS,
    TOKEN_TABLES,
    CausalLM,
    DraftHead,
    for_draft_head,
    single_group_tables,
)
from laneserve.model.layers.attention import AttentionMetadata, PrefillSpan, TokenTableMetadata
from laneserve.protocol import RequestError, StepResult
from laneserve.sample.step import Drafts, SampledStep, TreeRows, sample_step
from laneserve.spec_decode.base import Proposer, StepView
from laneserve.spec_decode.proposers import MtpProposer
from laneserve.structured.matchers import GrammarBook, MaskRow
from laneserve.worker import prompt_logprobs, side_rows, step_outputs
from laneserve.worker.cuda_graphs import DecodeGraphs
from laneserve.worker.cuda_graphs_tables import TokenTableDecodeGraphs
from laneserve.worker.input_batch import SlotTable
from laneserve.worker.kv_cache import KvCache
from laneserve.worker.side_rows import KvStack, SideStep
from laneserve.worker.step_inputs import StepInputs
from laneserve.worker.step_outputs import DeviceOutputs


class DeviceState:
    def __init__(self, device: torch.device, width: int, max_spec: int, side: int = 0) -> None:
        self.device = device
        self.width = width
        self.max_spec = max_spec
        self.history = torch.zeros((0, width), dtype=torch.int64, device=device)
        self.committed = torch.zeros(0, dtype=torch.int64, device=device)
        self.drafts = torch.zeros((0, max(max_spec, 1)), dtype=torch.int64, device=device)
        self.num_drafts = torch.zeros(0, dtype=torch.int64, device=device)
        self.side_drafts = torch.zeros((0, max(side, 1)), dtype=torch.int64, device=device)

    @property
    def capacity(self) -> int:
        return self.committed.shape[0]

    def ensure(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        new = max(capacity, 2 * self.capacity, 8)
        extra = new - self.capacity

        def grow(t: torch.Tensor) -> torch.Tensor:
            pad = torch.zeros((extra, *t.shape[1:]), dtype=t.dtype, device=t.device)
            return torch.cat([t, pad])

        self.history = grow(self.history)
        self.committed = grow(self.committed)
        self.drafts = grow(self.drafts)
        self.num_drafts = grow(self.num_drafts)
        self.side_drafts = grow(self.side_drafts)


@dataclass
class _Forward:
    """The target's forward: main rows' hidden states, and its side rows if any."""

    hidden: torch.Tensor  # [T, H] (d1's row is replaced when an alternative is accepted)
    side: SideStep | None = None
    side_hidden: torch.Tensor | None = None  # [Ra * W, H]
    draft_hidden: torch.Tensor | None = None  # what the MTP layer reads, if not `hidden`


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: KvCache,  # the paged cache: per group, per layer tensors (group 0: the target's)
        block_size: int,
        slots: SlotTable,
        device: torch.device,
        max_model_len: int,
        max_spec: int,
        vocab_size: int,
        proposer: Proposer | None = None,
        side_width: int = 0,  # alternatives per speculative row (token tree)
        grammars: GrammarBook | None = None,  # structured output's matchers
        graphs: DecodeGraphs | TokenTableDecodeGraphs | None = None,  # CUDA graphs of decode steps
    ) -> None:
        self.model = model
        self.kv_caches = kv.layers  # per group, per layer: (K, V) or (latent,)
        self.block_size = block_size
        self.slots = slots
        self.device = device
        self.vocab_size = vocab_size
        self.proposer = proposer
        self.grammars = grammars
        self.graphs = graphs
        self.draft_head = proposer.head if isinstance(proposer, MtpProposer) else None
        # the cache groups the head reads, in its order
        self.mtp_groups = kv.group_indices(self.draft_head.cache_groups) if self.draft_head else ()
        self.kv_stacks: list[KvStack] = kv.stacks  # per group: the layers' caches stacked
        self.max_spec = max_spec
        self.state = DeviceState(device, max_model_len + max_spec + 2, max_spec, side_width)
        # Optional tap on every step's (inputs, ids, positions, hidden): the MTP
        # trainer collects the target's hidden states with it.
        self.capture: (
            Callable[[StepInputs, torch.Tensor, torch.Tensor, torch.Tensor], None] | None
        ) = None

    # -- device lane -------------------------------------------------------
    def execute(self, inp: StepInputs) -> DeviceOutputs:
        """resolve -> forward -> logits -> sample/verify -> commit -> propose."""
        self.state.ensure(self.slots.capacity)
        errors = self._stale_rows(inp)
        if errors:
            return DeviceOutputs(inp, None, None, None, None, errors)
        self._write_prompts(inp)
        ids, positions, start = self._resolve_inputs(inp)
        meta = self._metadata(inp, positions, start)
        fwd = self._forward(inp, ids, positions, meta)
        if self.capture is not None:
            self.capture(inp, ids, positions, fwd.hidden)
        prompt_lp = None
        if inp.prompt_rows is not None:
            prompt_lp = prompt_logprobs.compute(
                self.model.compute_logits, fwd.hidden, inp.prompt_rows
            )
        sampled = drafts = None
        if inp.sampling is not None:
            drafts = self._drafts(inp)
            sampled = sample_step(
                self.model.kernels,
                self._logits(inp, fwd),
                inp.sampling,
                inp.sample_rows,
                positions,
                self.state.history,
                drafts,
                self._tree(inp, fwd),
                self._grammar_mask(inp, drafts),
            )
            self._commit_side(inp, fwd, sampled)
            self._commit(inp, sampled.tokens, sampled.num_accepted + 1)
        if self.proposer is not None:
            accepted = sampled.num_accepted if sampled is not None else None
            draft_hidden = fwd.draft_hidden if fwd.draft_hidden is not None else fwd.hidden
            self._propose(inp, draft_hidden, positions, meta, accepted)
        return replace(_outputs(inp, sampled, drafts), prompt_logprobs=prompt_lp)

    def release(self, pairs: list[tuple[int, int]]) -> None:
        for slot, gen in pairs:
            if self.slots.release(slot, gen) and slot < self.state.capacity:
                self.state.committed[slot] = 0
                self.state.num_drafts[slot] = 0

    def _stale_rows(self, inp: StepInputs) -> list[RequestError]:
        return [
            RequestError(r.handle, f"stale step {inp.step_id}: state slot {r.slot} was released")
            for r in inp.rows
            if not self.slots.is_current(r.slot, r.gen)
        ]

    def _write_prompts(self, inp: StepInputs) -> None:
        st = self.state
        for slot, ids in inp.new_prompts:
            st.history[slot, : ids.shape[0]] = ids
            st.committed[slot] = ids.shape[0]
            st.num_drafts[slot] = 0

    def _resolve_inputs(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids [T], positions [T] and per-row start [R], from the committed state."""
        st, row, tok = self.state, inp.per_row, inp.per_token
        committed = st.committed.index_select(0, row.slot)  # [R]
        start = torch.where(row.decode, committed - 1, row.start)
        positions = start.index_select(0, tok.row) + tok.offset  # [T]
        ids = st.history[tok.slot, positions]
        if inp.spec.any:
            draft = st.drafts[tok.slot, tok.draft_col]
            ids = torch.where(tok.is_draft, draft, ids)
        return ids, positions, start

    def _metadata(
        self, inp: StepInputs, positions: torch.Tensor, start: torch.Tensor
    ) -> AttentionMetadata:
        """The main cache group's (0) metadata; other groups derive theirs from it."""
        att = inp.attention
        nd = att.num_decode_rows
        return AttentionMetadata(
            slot_mapping=self._slot_mapping(inp, positions, 0),
            num_decode_tokens=att.num_decode_tokens,
            decode_block_tables=att.groups[0].block_table[:nd] if nd else None,
            decode_seq_lens=(start[:nd] + inp.per_row.qlen[:nd]).to(torch.int32) if nd else None,
            decode_query_start_loc=att.decode_query_start_loc if nd else None,
            prefills=self._prefill_spans(inp, 0),
        )

    def _group_metadata(
        self, inp: StepInputs, meta: AttentionMetadata, positions: torch.Tensor, group: int
    ) -> AttentionMetadata:
        """`meta` (the main group's) for another cache group: the same rows and lengths,
        that group's blocks."""
        nd = inp.attention.num_decode_rows
        table = inp.attention.groups[group].block_table
        return replace(
            meta,
            slot_mapping=self._slot_mapping(inp, positions, group),
            decode_block_tables=table[:nd] if nd else None,
            prefills=self._prefill_spans(inp, group),
        )

    def _slot_mapping(self, inp: StepInputs, positions: torch.Tensor, group: int) -> torch.Tensor:
        table = inp.attention.groups[group].block_table
        return self.model.kernels.slot_mapping(table, inp.per_token.row, positions, self.block_size)

    def _prefill_spans(self, inp: StepInputs, group: int) -> tuple[PrefillSpan, ...]:
        blocks = inp.attention.groups[group].prefill_blocks
        return tuple(
            PrefillSpan(p.token_start, p.num_tokens, p.context_len, b)
            for p, b in zip(inp.prefills, blocks, strict=True)
        )

    def _forward(
        self, inp: StepInputs, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> _Forward:
        """The target's forward over the step's tokens, and its side rows if any."""
        if inp.spec.side is None:
            step = self._step_metadata(inp, meta, positions)
            out = self._graphed(inp, ids, positions, step) or self._eager(ids, positions, step)
            second = self.model.mtp_reads_second_output
            return _Forward(out[0], draft_hidden=out[1] if second else None)
        assert self.model.step_kind == PAGED, "token-tree rows need paged attention"
        side, ids_all, pos_all, meta_all = side_rows.plan(
            inp.spec.side, self.state.side_drafts, ids, positions, meta
        )
        everything, _ = self.model.forward(ids_all, pos_all, meta_all, self.kv_caches[0])
        hidden, side_hidden = side_rows.split(everything, side)
        return _Forward(hidden, side, side_hidden)

    def _step_metadata(
        self, inp: StepInputs, meta: AttentionMetadata, positions: torch.Tensor
    ) -> AttentionMetadata | TokenTableMetadata | tuple[AttentionMetadata, ...]:
        """What the target's forward takes (its step kind): the main group's metadata,
        every group's tables per token, or every group's metadata."""
        kind = self.model.step_kind
        if kind == TOKEN_TABLES:  # it reads every cache group
            return self._all_groups(inp)
        if kind == PAGED_GROUPS:  # the target's groups: every one but the MTP head's
            rest = [g for g in range(1, len(inp.attention.groups)) if g not in self.mtp_groups]
            return (meta, *(self._group_metadata(inp, meta, positions, g) for g in rest))
        return meta

    def _eager(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | TokenTableMetadata | tuple[AttentionMetadata, ...],
    ) -> tuple[torch.Tensor, ...]:
        """The target's forward, unrecorded: hidden states (and V4's residual streams)."""
        if self.model.step_kind == PAGED:
            assert isinstance(meta, AttentionMetadata)
            return self.model.forward(ids, positions, meta, self.kv_caches[0])
        return self.model.forward(ids, positions, meta, self.kv_caches)  # every group's

    def _graphed(
        self,
        inp: StepInputs,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | TokenTableMetadata | tuple[AttentionMetadata, ...],
    ) -> tuple[torch.Tensor, ...] | None:
        """The forward's outputs from a decode graph, when the step has that shape (None:
        not): the hidden states, and a V4 target's residual streams."""
        if self.graphs is None or self.capture is not None or inp.prefills:
            return None
        qlens = {1 + r.num_spec for r in inp.rows}  # decode rows: the token and its drafts
        if len(qlens) != 1:
            return None
        if isinstance(self.graphs, TokenTableDecodeGraphs):
            assert isinstance(meta, TokenTableMetadata)
            return self.graphs.run(ids, positions, meta, qlens.pop())
        assert isinstance(meta, AttentionMetadata)
        hidden = self.graphs.run(ids, positions, meta, qlens.pop())
        return None if hidden is None else (hidden,)

    def _all_groups(self, inp: StepInputs) -> TokenTableMetadata:
        """Every cache group's table per token (a model that reads all its groups)."""
        row = inp.per_token.row
        tables = tuple(
            g.block_table.index_select(0, row).to(torch.int64) for g in inp.attention.groups
        )
        spans = tuple((p.token_start, p.num_tokens, p.context_len) for p in inp.prefills)
        return TokenTableMetadata(tables, inp.max_len, spans)

    def _logits(self, inp: StepInputs, fwd: _Forward) -> torch.Tensor:
        """[N + Ra * W, V]: the sampling rows' logits rows, then the side rows."""
        rows = fwd.hidden.index_select(0, inp.sample_rows.token_idx)
        if fwd.side_hidden is not None:  # NOTE: one LM-head pass for all rows (streams the weight)
            rows = torch.cat([rows, fwd.side_hidden])
        return self.model.compute_logits(rows)

    def _drafts(self, inp: StepInputs) -> Drafts | None:
        """The sampling rows' drafts and how many of them to verify (None: no speculation)."""
        if not inp.spec.any:
            return None
        slots = inp.sample_rows.slot
        num_valid = torch.minimum(self.state.num_drafts.index_select(0, slots), inp.spec.num_spec)
        tokens = self.state.drafts.index_select(0, slots)[:, : inp.spec.max_spec]
        return Drafts(tokens, num_valid, inp.spec.dense)

    def _grammar_mask(self, inp: StepInputs, drafts: Drafts | None) -> torch.Tensor | None:
        """[N, ceil(V / 32)] the grammar rows' token bitmask (None: no grammar rows).
        NOTE: waits for the previous step's commits (structured/fence.py); with drafts it
        reads the grammar rows' drafts to the host (a sync, only in steps with grammars)."""
        handles = [r.handle for r in inp.rows if r.sample]
        if self.grammars is None or not self.grammars.constrains(handles):
            return None
        rows = inp.sample_rows
        first: dict[int, int] = {}
        for n, i in enumerate(rows.row_host):
            first.setdefault(i, n)
        want = [i for i, h in enumerate(handles) if self.grammars.constrains([h])]
        mask_rows = [MaskRow(handles[i], first[i]) for i in want]
        if drafts is not None:
            idx = torch.tensor(want, device=self.device)
            tokens = drafts.tokens.index_select(0, idx).tolist()
            valid = drafts.num_valid.index_select(0, idx).tolist()
            for r, toks, k in zip(mask_rows, tokens, valid, strict=True):
                r.drafts = toks[:k]
        mask = self.grammars.bitmask(mask_rows, len(rows.row_host))
        return mask.to(self.device, non_blocking=True)

    def _tree(self, inp: StepInputs, fwd: _Forward) -> TreeRows | None:
        si, side = inp.spec.side, fwd.side
        if si is None or side is None:
            return None
        return TreeRows(si.sample, si.sample_host, si.every_row, side.tokens, side.pos)

    def _commit_side(self, inp: StepInputs, fwd: _Forward, sampled: SampledStep) -> None:
        """An accepted alternative becomes the request's token at p + 1 (KV and hidden)."""
        if fwd.side is None:
            return
        assert inp.spec.side is not None and self.kv_stacks is not None
        assert sampled.tree_hit is not None and sampled.tree_choice is not None
        assert fwd.side_hidden is not None
        side_rows.commit(
            self.model.kernels,
            self.kv_stacks[0],
            fwd.side,
            sampled.tree_hit,
            sampled.tree_choice,
            fwd.hidden,
            fwd.side_hidden,
            inp.spec.side.first_draft,
        )

    def _commit(self, inp: StepInputs, tokens: torch.Tensor, num_emitted: torch.Tensor) -> None:
        st = self.state
        slots = inp.sample_rows.slot
        base = st.committed.index_select(0, slots)
        cols = base[:, None] + torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        # NOTE: rejected tail positions are written too (no masking, no sync);
        # they lie beyond the new committed count and are never read as tokens.
        st.history[slots[:, None], cols.clamp(max=st.width - 1)] = tokens
        st.committed.index_copy_(0, slots, base + num_emitted)

    def _propose(
        self,
        inp: StepInputs,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,  # the step's main-group metadata (no side rows)
        accepted: torch.Tensor | None,
    ) -> None:
        st, sr = self.state, inp.sample_rows
        assert self.proposer is not None
        # t[i+1] for every position i: the committed history (accepted tokens
        # and this step's samples are already in it).
        next_tokens = st.history[inp.per_token.slot, (positions + 1).clamp(max=st.width - 1)]
        last = sr.first + (accepted if accepted is not None else 0)
        last_index = sr.token_idx.index_select(0, last) if accepted is not None else last
        meta_mtp = None
        mtp_tables = None
        if self.draft_head is not None:
            meta_mtp = self._mtp_metadata(inp, meta, positions, self.draft_head)
            if self.max_spec > 1:  # only recurrent drafts (k > 1) read them
                groups = inp.attention.groups
                mtp_tables = tuple(
                    groups[g].block_table.index_select(0, sr.index) for g in self.mtp_groups
                )
        view = StepView(sr.slot, last_index, positions, hidden, meta_mtp, mtp_tables, inp.max_len)
        self.proposer.propose(st, view, next_tokens)

    def _mtp_metadata(
        self, inp: StepInputs, meta: AttentionMetadata, positions: torch.Tensor, head: DraftHead
    ) -> AttentionMetadata | TokenTableMetadata | tuple[AttentionMetadata, ...]:
        """The step's metadata for the head's cache groups (of the head's step kind)."""
        if head.step_kind == TOKEN_TABLES:  # NOTE: its attention reads tables per token
            (group,) = self.mtp_groups
            table = inp.attention.groups[group].block_table.index_select(0, inp.per_token.row)
            return single_group_tables(table, inp.max_len)
        metas = [self._group_metadata(inp, meta, positions, g) for g in self.mtp_groups]
        return for_draft_head(head, metas)

    # -- output lane -------------------------------------------------------
    def reclaim(self, out: DeviceOutputs) -> StepResult:
        return step_outputs.reclaim(out)


def _outputs(inp: StepInputs, sampled: SampledStep | None, drafts: Drafts | None) -> DeviceOutputs:
    if sampled is None:
        return DeviceOutputs(inp, None, None, None, None, [])
    num_drafts = drafts.num_valid if drafts is not None else None
    return DeviceOutputs(
        inp, sampled.tokens, sampled.num_accepted + 1, sampled.logprobs, num_drafts, []
    )
