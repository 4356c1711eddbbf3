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

from laneserve.model.attention import AttentionMetadata, PrefillSpan
from laneserve.model.deepseek import DeepseekModel
from laneserve.model.llama import LlamaModel
from laneserve.protocol import RequestError, RequestOutput, StepResult, TokenLogprobs
from laneserve.sample import rejection_sampler, sampler
from laneserve.sample.sampler import SamplingBatch
from laneserve.spec_decode.proposers import MtpProposer, NgramProposer
from laneserve.worker import side_rows
from laneserve.worker.input_batch import SlotTable, StepInputs
from laneserve.worker.kv_cache import KvCache
from laneserve.worker.side_rows import KvStack, SideStep

Proposer = NgramProposer | MtpProposer
Model = LlamaModel | DeepseekModel


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
class DeviceOutputs:
    inputs: StepInputs
    tokens: torch.Tensor | None  # [Rs, 1 + max_spec] emitted tokens (padded)
    num_emitted: torch.Tensor | None  # [Rs]
    logprobs: tuple[torch.Tensor, ...] | None  # chosen, rank, top ids, top lps per logits row
    num_drafts: torch.Tensor | None  # [Rs] real drafts verified (None: no speculation)
    errors: list[RequestError]
    device_s: float = 0.0


@dataclass
class _StepView:
    """What the proposer reads about the step that just ran (see spec_decode)."""

    slots: torch.Tensor
    last_index: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor
    meta_mtp: AttentionMetadata | None
    mtp_table: torch.Tensor | None
    max_len: int


class ModelRunner:
    def __init__(
        self,
        model: Model,
        kv: KvCache,  # the paged cache: per group, per layer tensors (group 0: the target's)
        block_size: int,
        slots: SlotTable,
        device: torch.device,
        max_model_len: int,
        max_spec: int,
        vocab_size: int,
        proposer: Proposer | None = None,
        side_width: int = 0,  # alternatives per speculative row (token tree)
    ) -> None:
        self.model = model
        self.kv_caches = kv.layers  # per group, per layer: (K, V) or (latent,)
        self.block_size = block_size
        self.slots = slots
        self.device = device
        self.vocab_size = vocab_size
        self.proposer = proposer
        self.mtp_group = kv.group_index("mtp") if isinstance(proposer, MtpProposer) else None
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
        self.state.ensure(self.slots.capacity)
        errors = self._stale_rows(inp)
        if errors:
            return DeviceOutputs(inp, None, None, None, None, errors)
        self._write_prompts(inp)
        ids, positions, start = self._resolve_inputs(inp)
        meta = self._metadata(inp, positions, start)
        side = side_hidden = None
        if inp.side is not None:
            side, ids_all, pos_all, meta_all = side_rows.plan(
                inp, self.state.side_drafts, ids, positions, meta
            )
            out, _ = self.model.forward(ids_all, pos_all, meta_all, self.kv_caches[0])
            hidden, side_hidden = side_rows.split(out, side)
        else:
            hidden, _ = self.model.forward(ids, positions, meta, self.kv_caches[0])
        if self.capture is not None:
            self.capture(inp, ids, positions, hidden)
        tokens = num_emitted = logprobs = num_valid = num_accepted = None
        if inp.sampling is not None:
            rows = hidden.index_select(0, inp.logits_token_idx)
            if side is not None:  # NOTE: one LM-head pass for all rows (it streams the weight)
                rows = torch.cat([rows, side_hidden])
            logits = self.model.compute_logits(rows)
            drafts = None
            if inp.any_spec:
                drafts, num_valid = self._drafts(inp)
            if side is not None and _all_greedy_tree(inp):
                tokens, num_accepted = self._verify_tree_greedy(
                    inp, side, logits, hidden, side_hidden, drafts, num_valid
                )
            else:
                n = inp.logits_token_idx.shape[0]
                logits, side_logits = logits[:n], logits[n:]
                tokens, num_accepted, logprobs = self._sample(
                    inp, logits, positions, drafts, num_valid
                )
                if side is not None:
                    self._verify_side(
                        inp,
                        side,
                        logits,
                        side_logits,
                        side_hidden,
                        hidden,
                        tokens,
                        num_accepted,
                        drafts,
                        num_valid,
                    )
            num_emitted = num_accepted + 1
            self._commit(inp, tokens, num_emitted)
        if self.proposer is not None:
            self._propose(inp, hidden, positions, meta, num_accepted)
        return DeviceOutputs(inp, tokens, num_emitted, logprobs, num_valid, [])

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
        st = self.state
        committed = st.committed.index_select(0, inp.row_slot)  # [R]
        start = torch.where(inp.row_decode, committed - 1, inp.row_start)
        positions = start.index_select(0, inp.token_row) + inp.token_offset  # [T]
        ids = st.history[inp.token_slot, positions]
        if inp.any_spec:
            draft = st.drafts[inp.token_slot, inp.token_draft_col]
            ids = torch.where(inp.token_is_draft, draft, ids)
        return ids, positions, start

    def _metadata(
        self, inp: StepInputs, positions: torch.Tensor, start: torch.Tensor
    ) -> AttentionMetadata:
        """The main cache group's (0) metadata; other groups derive theirs from it."""
        nd = inp.num_decode_rows
        return AttentionMetadata(
            slot_mapping=self._slot_mapping(inp, positions, 0),
            num_decode_tokens=inp.num_decode_tokens,
            decode_block_tables=inp.block_tables[0][:nd] if nd else None,
            decode_seq_lens=(start[:nd] + inp.row_qlen[:nd]).to(torch.int32) if nd else None,
            decode_query_start_loc=inp.decode_query_start_loc if nd else None,
            prefills=self._prefill_spans(inp, 0),
        )

    def _group_metadata(
        self, inp: StepInputs, meta: AttentionMetadata, positions: torch.Tensor, group: int
    ) -> AttentionMetadata:
        """`meta` (the main group's) for another cache group: the same rows and lengths,
        that group's blocks."""
        nd = inp.num_decode_rows
        return replace(
            meta,
            slot_mapping=self._slot_mapping(inp, positions, group),
            decode_block_tables=inp.block_tables[group][:nd] if nd else None,
            prefills=self._prefill_spans(inp, group),
        )

    def _slot_mapping(self, inp: StepInputs, positions: torch.Tensor, group: int) -> torch.Tensor:
        table = inp.block_tables[group]
        return self.model.kernels.slot_mapping(table, inp.token_row, positions, self.block_size)

    def _prefill_spans(self, inp: StepInputs, group: int) -> tuple[PrefillSpan, ...]:
        return tuple(
            PrefillSpan(p.token_start, p.num_tokens, p.context_len, blocks)
            for p, blocks in zip(inp.prefills, inp.prefill_block_ids[group], strict=True)
        )

    def _sample(
        self,
        inp: StepInputs,
        logits: torch.Tensor,
        positions: torch.Tensor,
        drafts: torch.Tensor | None,  # [Rs, max_spec] when the step verifies drafts
        num_valid: torch.Tensor | None,  # [Rs] drafts to verify per row
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """(tokens [Rs, 1 + k], accepted [Rs], logprobs)."""
        sb = inp.sampling
        assert sb is not None
        raw = logits.clone() if sb.max_logprobs >= 0 else logits
        num_known = num_output = None
        if sb.min_tokens is not None or sb.penalties is not None:
            num_known = positions.index_select(0, inp.logits_token_idx) + 1  # [N]
            num_output = num_known - sb.prompt_len.index_select(0, inp.logits_sample_row)
        if drafts is not None:
            if _greedy_dense(inp):
                tokens, accepted, _, _ = self.model.kernels.verify_greedy(
                    logits, drafts, num_valid, drafts[:, :0]
                )
            else:
                flat = sb.expand(inp.logits_sample_row_host, inp.logits_sample_row)
                if num_output is not None:
                    sampler.apply_min_tokens(logits, flat, num_output)
                if sb.penalties is not None:
                    self._penalize_plain_rows(inp, logits, sb, num_known)
                tokens, accepted = rejection_sampler.verify(
                    logits, flat, inp.logits_sample_row, inp.logits_offset, drafts, num_valid
                )
        else:
            if num_output is not None:
                sampler.apply_min_tokens(logits, sb, num_output)
            if sb.penalties is not None:
                hist = self.state.history.index_select(0, inp.sample_slot)
                sampler.apply_penalties(logits, sb, hist, num_known)
            tokens = sampler.sample(logits, sb)[:, None]
            accepted = torch.zeros_like(tokens[:, 0])
        logprobs = None
        if sb.max_logprobs >= 0:
            chosen = tokens[inp.logits_sample_row, inp.logits_offset]
            logprobs = sampler.compute_logprobs(raw, chosen, sb.max_logprobs)
        return tokens, accepted, logprobs

    def _drafts(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [Rs, max_spec], drafts to verify [Rs]) of the sampling rows."""
        slots = inp.sample_slot
        num_valid = torch.minimum(self.state.num_drafts.index_select(0, slots), inp.sample_num_spec)
        return self.state.drafts.index_select(0, slots)[:, : inp.max_spec], num_valid

    def _verify_tree_greedy(
        self,
        inp: StepInputs,
        side: SideStep,
        logits: torch.Tensor,  # [N + Rs * W, V]: main rows, then side rows
        hidden: torch.Tensor,  # [T, H] main hidden (d1's row is replaced on a hit)
        side_hidden: torch.Tensor,  # [Rs * W, H]
        drafts: torch.Tensor,  # [Rs, max_spec]
        num_valid: torch.Tensor,  # [Rs]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The all-greedy token-tree step (see `_all_greedy_tree`): one fused op decides
        what `_sample` + `_verify_side` would."""
        tokens, accepted, hit, choice = self.model.kernels.verify_greedy(
            logits, drafts, num_valid, side.tokens
        )
        self._commit_side(inp, side, hit, choice, hidden, side_hidden)
        return tokens, accepted

    def _commit_side(
        self,
        inp: StepInputs,
        side: SideStep,
        hit: torch.Tensor,  # [Rs] an alternative was accepted
        choice: torch.Tensor,  # [Rs] which one
        hidden: torch.Tensor,  # [T, H] main hidden (d1's row is replaced on a hit)
        side_hidden: torch.Tensor,  # [Rs * W, H]
    ) -> None:
        assert inp.side is not None and self.kv_stacks is not None
        side_rows.commit(
            self.model.kernels,
            self.kv_stacks[0],
            side,
            hit,
            choice,
            hidden,
            side_hidden,
            inp.side.first_draft,
        )

    def _penalize_plain_rows(
        self,
        inp: StepInputs,
        logits: torch.Tensor,  # [N, V] one row per (sampling row, offset)
        sb: SamplingBatch,
        num_known: torch.Tensor,  # [N]
    ) -> None:
        """Penalties in a step that also verifies drafts: requests with penalties never
        speculate, so each has one logits row, at its sampling row's first."""
        first = inp.sample_logit_start
        rows = logits.index_select(0, first)  # [Rs, V]
        hist = self.state.history.index_select(0, inp.sample_slot)
        sampler.apply_penalties(rows, sb, hist, num_known.index_select(0, first))
        logits.index_copy_(0, first, rows)

    def _verify_side(
        self,
        inp: StepInputs,
        side: SideStep,
        logits: torch.Tensor,  # [N, V] processed main logits
        side_logits: torch.Tensor,  # [Ra * W, V] the alternatives' rows
        side_hidden: torch.Tensor,  # [Ra * W, H]
        hidden: torch.Tensor,  # [T, H] main hidden (d1's row is replaced on a hit)
        tokens: torch.Tensor,  # [Rs, 1 + k] updated in place
        num_accepted: torch.Tensor,  # [Rs] updated in place
        drafts: torch.Tensor,  # [Rs, max_spec]
        num_valid: torch.Tensor,  # [Rs] drafts verified per row
    ) -> None:
        sb, si = inp.sampling, inp.side
        assert sb is not None and si is not None
        w, host = si.width, si.sample_host
        row_batch = alt_batch = sb  # the all-greedy path reads no per-row sampling state
        if not sb.all_greedy or sb.min_tokens is not None:
            each = si.sample.repeat_interleave(w)
            alt_batch = sb.expand([i for i in host for _ in range(w)], each)
            row_batch = sb.expand(host, si.sample)
            if sb.min_tokens is not None:
                num_known = (side.pos + 1).repeat_interleave(w)  # the alternative's output
                sampler.apply_min_tokens(side_logits, alt_batch, num_known - alt_batch.prompt_len)
        alt = rejection_sampler.Alternatives(
            si.sample, side.tokens, side_logits, row_batch, alt_batch
        )
        hit, choice = rejection_sampler.verify_alternatives(
            logits,
            inp.sample_logit_start,
            drafts,
            num_valid,
            tokens,
            num_accepted,
            alt,
        )
        self._commit_side(inp, side, hit, choice, hidden, side_hidden)

    def _commit(self, inp: StepInputs, tokens: torch.Tensor, num_emitted: torch.Tensor) -> None:
        st = self.state
        slots = inp.sample_slot
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
        st = self.state
        # t[i+1] for every position i: the committed history (accepted tokens
        # and this step's samples are already in it).
        next_tokens = st.history[inp.token_slot, (positions + 1).clamp(max=st.width - 1)]
        slots = inp.sample_slot
        last = inp.sample_logit_start + (accepted if accepted is not None else 0)
        last_index = inp.logits_token_idx.index_select(0, last) if accepted is not None else last
        meta_mtp = mtp_table = None
        if self.mtp_group is not None:
            meta_mtp = self._group_metadata(inp, meta, positions, self.mtp_group)
            if self.max_spec > 1:  # only recurrent drafts (k > 1) read it
                mtp_table = inp.block_tables[self.mtp_group].index_select(0, inp.sample_rows)
        view = _StepView(slots, last_index, positions, hidden, meta_mtp, mtp_table, inp.max_len)
        self.proposer.propose(st, view, next_tokens)

    # -- output lane -------------------------------------------------------
    def reclaim(self, out: DeviceOutputs) -> StepResult:
        inp = out.inputs
        if out.errors or out.tokens is None:
            return StepResult(step_id=inp.step_id, errors=out.errors)
        tokens = out.tokens.tolist()
        emitted = out.num_emitted.tolist()
        lp = _logprobs_lists(out) if out.logprobs is not None else None
        sampled = [r for r in inp.rows if r.sample]
        outputs = []
        drafts = out.num_drafts.tolist() if out.num_drafts is not None else None
        for i, row in enumerate(sampled):
            toks = tokens[i][: emitted[i]]
            logprobs = []
            if lp is not None and row.num_logprobs is not None:
                logprobs = [_trim(lp[(i, j)], row.num_logprobs) for j in range(len(toks))]
            nd = drafts[i] if drafts is not None else 0
            outputs.append(RequestOutput(row.handle, toks, logprobs, nd, len(toks) - 1))
        return StepResult(step_id=inp.step_id, outputs=outputs)


def _logprobs_lists(out: DeviceOutputs) -> dict[tuple[int, int], TokenLogprobs]:
    inp = out.inputs
    chosen, rank, top_ids, top_lp = (t.tolist() for t in out.logprobs)
    tokens = out.tokens.tolist()
    rows = inp.logits_sample_row.tolist()
    offs = inp.logits_offset.tolist()
    table = {}
    for n, (i, j) in enumerate(zip(rows, offs, strict=True)):
        table[(i, j)] = TokenLogprobs(tokens[i][j], chosen[n], rank[n], top_ids[n], top_lp[n])
    return table


def _trim(x: TokenLogprobs, n: int) -> TokenLogprobs:
    return TokenLogprobs(x.token_id, x.logprob, x.rank, x.top_ids[:n], x.top_logprobs[:n])


def _greedy_dense(inp: StepInputs) -> bool:
    """Every sampling row verifies max_spec drafts, greedily, with no logits processing:
    `kernels.verify_greedy` decides the step."""
    sb = inp.sampling
    return inp.dense_spec and sb.all_greedy and sb.min_tokens is None


def _all_greedy_tree(inp: StepInputs) -> bool:
    """A greedy dense step in which every row also carries alternatives and none asks for
    logprobs: the token-tree step of greedy decoding."""
    si = inp.side
    return si is not None and si.every_row and inp.sampling.max_logprobs < 0 and _greedy_dense(inp)
