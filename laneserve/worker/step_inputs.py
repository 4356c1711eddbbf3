"""The host half of a step (the prepare lane): one `StepCommand` -> one `StepInputs`.

A step's inputs are composed of small parts, each built by its own function:

```
 rows / prefills   host descriptions of the rows (output lane, prefill spans)
 per_row           [R]  state slot, decode?, planned start, query length
 per_token         [T]  row, offset in row, draft?, draft column, state slot
 sample_rows       [Rs] / [N] the sampling rows and their logits rows (sample/step.py)
 attention         decode query starts; block table + prefill blocks per cache group
 sampling          the SamplingBatch of the sampling rows
 spec              drafts per row, dense?, side rows (token tree)
```
Rows are ordered decode-like first, then prefill chunks; everything is relative
to the *planned* state. Values that depend on the previous step's outcome (a
decode's position and input token, draft tokens) are resolved on the device by
`ModelRunner`, from the committed state that only the device lane writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from laneserve.protocol import ScheduledRequest, StepCommand
from laneserve.sample.sampler import RowSampling, SamplingBatch
from laneserve.sample.sampler import prepare as prepare_sampling
from laneserve.sample.step import SampleRows
from laneserve.worker import prompt_logprobs
from laneserve.worker.input_batch import CommandError, InputSlot, RequestTable, WorkerRequest


@dataclass(frozen=True)
class InputLayout:
    """What every step's inputs share (fixed when the worker starts)."""

    device: torch.device
    vocab_size: int
    scratch_blocks: tuple[int, ...]  # per cache group: the block id that pads tables
    pad_cols: int  # extra block-table columns (max_spec + 1: draft positions past the end)
    side_width: int  # alternatives per speculative row (token tree; 0: none)
    side_base: int  # first scratch KV slot of the side rows
    shared_generator: torch.Generator  # random draws of unseeded requests


@dataclass
class RowMeta:
    """What the output lane needs about one row (no lookups after prepare)."""

    handle: int
    slot: int
    gen: int
    sample: bool
    num_spec: int
    num_logprobs: int | None


@dataclass(frozen=True)
class PrefillRow:
    row: int
    token_start: int
    num_tokens: int
    context_len: int


@dataclass
class RowInputs:
    slot: torch.Tensor  # [R] int64 state slot
    decode: torch.Tensor  # [R] bool
    start: torch.Tensor  # [R] int64 planned start (exact for prefill rows)
    qlen: torch.Tensor  # [R] int64 query tokens


@dataclass
class TokenInputs:
    row: torch.Tensor  # [T] int64
    offset: torch.Tensor  # [T] int64 within its row
    is_draft: torch.Tensor  # [T] bool
    draft_col: torch.Tensor  # [T] int64 drafts column of a draft token (clamped)
    slot: torch.Tensor  # [T] int64 state slot of the token's row


@dataclass
class GroupTables:
    """One cache group's view of the step's rows."""

    block_table: torch.Tensor  # [R, max_blocks + pad] int32 (as attention reads it)
    prefill_blocks: list[torch.Tensor]  # per prefill row: its block ids (int64)


@dataclass
class AttentionInputs:
    num_decode_rows: int  # rows [0, num_decode_rows) are decode-like
    num_decode_tokens: int
    decode_query_start_loc: torch.Tensor  # [Sd + 1] int32
    groups: list[GroupTables]  # per cache group


@dataclass
class SideInputs:
    """Side rows of a step: the alternatives to first drafts (see side_rows.py)."""

    width: int  # alternatives per row (W)
    state_slots: torch.Tensor  # [Ra] state slots of the rows that carry alternatives
    sample: torch.Tensor  # [Ra] their sampling-row index
    every_row: bool  # every sampling row carries alternatives (rows == sampling rows)
    sample_host: list[int]
    slots: torch.Tensor  # [Ra, W] scratch KV slot per alternative
    tables: torch.Tensor  # [Ra * W, C] int32: each side row's own (request's) table
    query_start_loc: torch.Tensor  # [Sd + Ra * W + 1] int32: decode rows, then side rows
    last_slot: torch.Tensor  # [Sd + Ra * W] int64: -1 for decode rows, then the slots
    first_draft: torch.Tensor  # [Ra] token index of each row's d1


@dataclass
class SpecInputs:
    max_spec: int  # most drafts of any row this step (0: no speculation)
    dense: bool  # every sampling row is a decode verifying max_spec drafts
    num_spec: torch.Tensor  # [Rs] int64 drafts scheduled per sampling row
    side: SideInputs | None  # alternatives to first drafts (token tree) this step

    @property
    def any(self) -> bool:
        return self.max_spec > 0


@dataclass
class StepInputs:
    step_id: int
    slot_index: int  # which InputSlot holds the host buffers behind the tensors
    rows: list[RowMeta]
    prefills: list[PrefillRow]
    new_prompts: list[tuple[int, torch.Tensor]]  # (slot, prompt ids) to write first
    releases: list[tuple[int, int]]  # (slot, gen) released after this step
    max_len: int  # host upper bound on every row's length after this step
    per_row: RowInputs
    per_token: TokenInputs
    sample_rows: SampleRows
    attention: AttentionInputs
    sampling: SamplingBatch | None
    spec: SpecInputs
    prompt_rows: prompt_logprobs.PromptRows | None = None  # prefill rows asking for them


@dataclass
class _Plan:
    """The command's rows in step order (decode-like first), on the host."""

    sched: list[ScheduledRequest]
    reqs: list[WorkerRequest]
    starts: np.ndarray  # [R + 1] first token of each row, then the token count
    sample: list[int]  # rows that sample
    num_decode: int  # decode-like rows (the first ones)


def build_inputs(
    cmd: StepCommand,
    table: RequestTable,
    slot: InputSlot,
    layout: InputLayout,
    new_prompts: list[tuple[int, torch.Tensor]],
    releases: list[tuple[int, int]],
) -> StepInputs:
    plan = _plan(cmd, table, slot)
    dev = _Uploader(layout.device)
    tables = [
        _block_table(plan.reqs, g, layout.scratch_blocks[g], layout.pad_cols)
        for g in range(table.num_groups)
    ]
    return StepInputs(
        step_id=cmd.step_id,
        slot_index=slot.index,
        rows=_row_meta(plan),
        prefills=_prefills(plan),
        new_prompts=new_prompts,
        releases=releases,
        max_len=max((s.start + s.num_tokens + 1 for s in plan.sched), default=1),
        per_row=_row_inputs(plan, slot, dev),
        per_token=_token_inputs(plan, slot, dev),
        sample_rows=_sample_rows(plan, dev),
        attention=_attention(plan, tables, table.block_size, dev),
        sampling=_sampling(plan, layout),
        spec=_speculation(plan, tables[0], layout, dev),
        prompt_rows=prompt_logprobs.plan(plan.sched, plan.reqs, plan.starts, dev),
    )


class _Uploader:
    """Host arrays / lists -> device tensors (non-blocking)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, a: np.ndarray | list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.tensor(a, dtype=dtype)
        return t.to(device=self.device, dtype=dtype, non_blocking=True)


def _plan(cmd: StepCommand, table: RequestTable, slot: InputSlot) -> _Plan:
    order = sorted(range(len(cmd.scheduled)), key=lambda i: not cmd.scheduled[i].decode)
    sched = [cmd.scheduled[i] for i in order]
    starts = np.concatenate([[0], np.cumsum([s.num_tokens for s in sched], dtype=np.int64)])
    n_tokens, n_rows = int(starts[-1]), len(sched)
    if n_tokens > slot.tokens.shape[1] or n_rows > slot.rows.shape[1]:
        raise CommandError(
            f"step {cmd.step_id} has {n_tokens} tokens / {n_rows} rows, over the limits"
        )
    return _Plan(
        sched=sched,
        reqs=[table.requests[s.handle] for s in sched],
        starts=starts,
        sample=[r for r, s in enumerate(sched) if s.sample],
        num_decode=sum(s.decode for s in sched),
    )


def _row_meta(plan: _Plan) -> list[RowMeta]:
    return [
        RowMeta(
            s.handle,
            req.slot,
            req.gen,
            s.sample,
            s.num_spec,
            req.params.logprobs if s.sample else None,
        )
        for s, req in zip(plan.sched, plan.reqs, strict=True)
    ]


def _prefills(plan: _Plan) -> list[PrefillRow]:
    return [
        PrefillRow(r, int(plan.starts[r]), s.num_tokens, s.start)
        for r, s in enumerate(plan.sched)
        if not s.decode
    ]


def _row_inputs(plan: _Plan, slot: InputSlot, dev: _Uploader) -> RowInputs:
    rows = slot.rows[:, : len(plan.sched)]  # slot, decode, start, qlen
    for r, (s, req) in enumerate(zip(plan.sched, plan.reqs, strict=True)):
        rows[:, r] = (req.slot, int(s.decode), s.start, s.num_tokens)
    return RowInputs(dev(rows[0]), dev(rows[1], torch.bool), dev(rows[2]), dev(rows[3]))


def _token_inputs(plan: _Plan, slot: InputSlot, dev: _Uploader) -> TokenInputs:
    tok = slot.tokens[:, : int(plan.starts[-1])]  # row, offset, is_draft
    for r, s in enumerate(plan.sched):
        pos, n = int(plan.starts[r]), s.num_tokens
        tok[0, pos : pos + n] = r
        tok[1, pos : pos + n] = np.arange(n)
        tok[2, pos : pos + n] = 0
        if s.decode:
            tok[2, pos + n - s.num_spec : pos + n] = 1
    max_spec = max((s.num_spec for s in plan.sched), default=0)
    row_slot = np.array([req.slot for req in plan.reqs], dtype=np.int64)
    return TokenInputs(
        row=dev(tok[0]),
        offset=dev(tok[1]),
        is_draft=dev(tok[2], torch.bool),
        draft_col=dev(np.clip(tok[1] - 1, 0, max(max_spec - 1, 0))),
        slot=dev(row_slot[tok[0]]),
    )


def _sample_rows(plan: _Plan, dev: _Uploader) -> SampleRows:
    """Each sampling row's logits rows: its last 1 + k tokens (k its drafts)."""
    token_idx: list[int] = []
    row: list[int] = []
    offset: list[int] = []
    first: list[int] = []
    for i, r in enumerate(plan.sample):
        s = plan.sched[r]
        k = s.num_spec if s.decode else 0
        end = int(plan.starts[r + 1])
        first.append(len(token_idx))
        token_idx.extend(range(end - 1 - k, end))
        row.extend([i] * (k + 1))
        offset.extend(range(k + 1))
    return SampleRows(
        index=dev(plan.sample),
        slot=dev([plan.reqs[r].slot for r in plan.sample]),
        first=dev(first),
        token_idx=dev(token_idx),
        row=dev(row),
        row_host=row,
        offset=dev(offset),
    )


def _attention(
    plan: _Plan, tables: list[np.ndarray], block_size: int, dev: _Uploader
) -> AttentionInputs:
    nd = plan.num_decode
    groups = []
    for g, host in enumerate(tables):
        blocks = []
        for s, req in zip(plan.sched, plan.reqs, strict=True):
            if not s.decode:
                need = -(-(s.start + s.num_tokens) // block_size)
                ids = torch.tensor(req.block_ids[g][:need], dtype=torch.int64)
                blocks.append(ids.to(dev.device))
        groups.append(GroupTables(dev(host, torch.int32), blocks))
    return AttentionInputs(
        num_decode_rows=nd,
        num_decode_tokens=int(plan.starts[nd]),
        decode_query_start_loc=dev(plan.starts[: nd + 1].tolist(), torch.int32),
        groups=groups,
    )


def _block_table(reqs: list[WorkerRequest], group: int, scratch: int, pad_cols: int) -> np.ndarray:
    """[R, max_blocks + pad_cols]; padding points at the group's scratch block."""
    width = max((len(r.block_ids[group]) for r in reqs), default=0) + pad_cols
    table = np.full((len(reqs), width), scratch, dtype=np.int64)
    for i, r in enumerate(reqs):
        ids = r.block_ids[group]
        table[i, : len(ids)] = ids
    return table


def _sampling(plan: _Plan, layout: InputLayout) -> SamplingBatch | None:
    if not plan.sample:
        return None
    rows = [_row_sampling(plan.reqs[r]) for r in plan.sample]
    return prepare_sampling(rows, layout.vocab_size, layout.device, layout.shared_generator)


def _row_sampling(req: WorkerRequest) -> RowSampling:
    return RowSampling(req.params, req.generator, len(req.prompt_token_ids), req.eos_token_ids)


def _speculation(plan: _Plan, table: np.ndarray, layout: InputLayout, dev: _Uploader) -> SpecInputs:
    sched = plan.sched
    max_spec = max((s.num_spec for s in sched), default=0)
    dense = max_spec > 0 and all(
        sched[r].decode and sched[r].num_spec == max_spec for r in plan.sample
    )
    side = _side_inputs(plan, table, layout, dev) if layout.side_width else None
    return SpecInputs(max_spec, dense, dev([sched[r].num_spec for r in plan.sample]), side)


def _side_inputs(
    plan: _Plan,
    table: np.ndarray,  # [R, C] the main group's block table
    layout: InputLayout,
    dev: _Uploader,
) -> SideInputs | None:
    """Side rows for speculative decodes without logprobs (a position-1 logprob would
    have to come from the alternative's row) nor a grammar; None when the step has none."""
    sched, reqs, width = plan.sched, plan.reqs, layout.side_width
    side = [
        (r, i)
        for i, r in enumerate(plan.sample)
        if sched[r].decode
        and sched[r].num_spec
        and reqs[r].params.logprobs is None
        and reqs[r].params.structured_outputs is None  # masks cover the main rows only
    ]
    if not side:
        return None
    rows = [r for r, _ in side]
    slots = layout.side_base + np.arange(len(side) * width).reshape(len(side), width)
    dec_qsl = plan.starts[: plan.num_decode + 1].tolist()
    return SideInputs(
        width=width,
        state_slots=dev([reqs[r].slot for r in rows]),
        sample=dev([i for _, i in side]),
        every_row=len(side) == len(plan.sample),
        sample_host=[i for _, i in side],
        slots=dev(slots),
        tables=dev(table[rows].repeat(width, 0), torch.int32),
        query_start_loc=dev(
            dec_qsl + [dec_qsl[-1] + j for j in range(1, slots.size + 1)], torch.int32
        ),
        last_slot=dev(np.concatenate([np.full(plan.num_decode, -1), slots.reshape(-1)])),
        first_draft=dev([int(plan.starts[r + 1]) - sched[r].num_spec for r in rows]),
    )
