"""The device half of a step: committed state, forward, sampling, reclaim.

Device state (written only by the device lane, one row per state slot):

```
 history[slot, :]   token ids: prompt, then every confirmed output
 committed[slot]    number of known tokens (prompt + confirmed outputs)
 drafts[slot, :k]   pending draft tokens for the next verify (speculation)
```
A decode row's inputs are resolved here from that state, not from the
command: its position is committed - 1 and its token is history[committed - 1]
(the placeholder substitution of async scheduling), followed by the slot's
drafts. Nothing in `execute` reads a device value back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laneserve.model.attention import AttentionMetadata, PrefillSpan
from laneserve.model.llama import LlamaModel
from laneserve.protocol import RequestError, RequestOutput, StepResult, TokenLogprobs
from laneserve.sample import sampler
from laneserve.worker.input_batch import SlotTable, StepInputs


class DeviceState:
    def __init__(self, device: torch.device, width: int, max_spec: int) -> None:
        self.device = device
        self.width = width
        self.max_spec = max_spec
        self.history = torch.zeros((0, width), dtype=torch.int64, device=device)
        self.committed = torch.zeros(0, dtype=torch.int64, device=device)
        self.drafts = torch.zeros((0, max(max_spec, 1)), dtype=torch.int64, device=device)
        self.num_drafts = torch.zeros(0, dtype=torch.int64, device=device)

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


@dataclass
class DeviceOutputs:
    inputs: StepInputs
    tokens: torch.Tensor | None  # [Rs, 1 + max_spec] emitted tokens (padded)
    num_emitted: torch.Tensor | None  # [Rs]
    logprobs: tuple[torch.Tensor, ...] | None  # chosen, rank, top ids, top lps per logits row
    num_drafts: torch.Tensor | None  # [Rs] drafts verified
    errors: list[RequestError]
    device_s: float = 0.0


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[list[tuple[torch.Tensor, torch.Tensor]]],  # per group, per layer
        block_size: int,
        slots: SlotTable,
        device: torch.device,
        max_model_len: int,
        max_spec: int,
        vocab_size: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.slots = slots
        self.device = device
        self.vocab_size = vocab_size
        self.state = DeviceState(device, max_model_len + max_spec + 2, max_spec)

    # -- device lane -------------------------------------------------------
    def execute(self, inp: StepInputs) -> DeviceOutputs:
        self.state.ensure(self.slots.capacity)
        errors = self._stale_rows(inp)
        if errors:
            return DeviceOutputs(inp, None, None, None, None, errors)
        self._write_prompts(inp)
        ids, positions, meta = self._resolve_inputs(inp)
        hidden, _ = self.model.forward(ids, positions, meta, self.kv_caches[0])
        if inp.sampling is None:
            return DeviceOutputs(inp, None, None, None, None, [])
        logits = self.model.compute_logits(hidden.index_select(0, inp.logits_token_idx))
        tokens, num_emitted, logprobs = self._sample(inp, logits, positions)
        self._commit(inp, tokens, num_emitted)
        return DeviceOutputs(inp, tokens, num_emitted, logprobs, None, [])

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

    def _resolve_inputs(
        self, inp: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        st, bs = self.state, self.block_size
        committed = st.committed.index_select(0, inp.row_slot)  # [R]
        start = torch.where(inp.row_decode, committed - 1, inp.row_start)
        positions = start.index_select(0, inp.token_row) + inp.token_offset  # [T]
        tok_slot = inp.row_slot.index_select(0, inp.token_row)
        ids = st.history[tok_slot, positions]
        if inp.any_spec:
            draft = st.drafts[tok_slot, (inp.token_offset - 1).clamp(min=0)]
            ids = torch.where(inp.token_is_draft, draft, ids)
        table = inp.block_tables[0]
        block = table[inp.token_row, torch.div(positions, bs, rounding_mode="floor")]
        slot_mapping = block * bs + positions % bs
        nd = inp.num_decode_rows
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=inp.num_decode_tokens,
            decode_block_tables=table[:nd].to(torch.int32) if nd else None,
            decode_seq_lens=(start[:nd] + inp.row_qlen[:nd]).to(torch.int32) if nd else None,
            decode_query_start_loc=inp.decode_query_start_loc if nd else None,
            prefills=tuple(
                PrefillSpan(p.token_start, p.num_tokens, p.context_len, blocks)
                for p, blocks in zip(inp.prefills, inp.prefill_block_ids, strict=True)
            ),
        )
        return ids, positions, meta

    def _sample(
        self, inp: StepInputs, logits: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
        sb = inp.sampling
        assert sb is not None
        raw = logits.clone() if sb.max_logprobs >= 0 else logits
        sample_slots = inp.row_slot.index_select(0, inp.sample_rows)  # [Rs]
        num_known = positions.index_select(0, inp.logits_token_idx) + 1  # [N]
        prompt_len = sb.prompt_len.index_select(0, inp.logits_sample_row)
        sampler.apply_min_tokens(logits, sb, num_known - prompt_len)
        if sb.penalties is not None:
            sampler.apply_penalties(
                logits, sb, self.state.history.index_select(0, sample_slots), num_known
            )
        tokens = sampler.sample(logits, sb)  # [N]
        logprobs = None
        if sb.max_logprobs >= 0:
            logprobs = sampler.compute_logprobs(raw, tokens, sb.max_logprobs)
        num_emitted = torch.ones_like(tokens)
        return tokens[:, None], num_emitted, logprobs

    def _commit(self, inp: StepInputs, tokens: torch.Tensor, num_emitted: torch.Tensor) -> None:
        st = self.state
        slots = inp.row_slot.index_select(0, inp.sample_rows)  # [Rs]
        base = st.committed.index_select(0, slots)
        cols = base[:, None] + torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        # NOTE: rejected tail positions are written too (no masking, no sync);
        # they lie beyond the new committed count and are never read as tokens.
        st.history[slots[:, None], cols.clamp(max=st.width - 1)] = tokens
        st.committed.index_copy_(0, slots, base + num_emitted)

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
        for i, row in enumerate(sampled):
            toks = tokens[i][: emitted[i]]
            logprobs = []
            if lp is not None and row.num_logprobs is not None:
                logprobs = [_trim(lp[(i, j)], row.num_logprobs) for j in range(len(toks))]
            outputs.append(RequestOutput(row.handle, toks, logprobs))
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
