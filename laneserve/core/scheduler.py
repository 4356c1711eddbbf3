"""Token-budget scheduler (vLLM v1 style): continuous batching, chunked prefill,
prefix caching, preemption by recompute, async placeholders, speculative slots.

Every step is arithmetic on the counters drawn in `core/request.py`:

```
 prefill chunk:  n = min(num_tokens - num_computed, budget)       sample iff it ends the prompt
 decode:         n = num_tokens + placeholders - num_computed (=1) + k draft slots
 after schedule: num_computed += n;  placeholders += 1 + k   (if the step samples)
 on its result:  placeholders -= 1 + k;  num_computed -= shortfall (1 + k - emitted)
```
With depth-2 async the next step is planned before the previous result is in:
a decode then schedules a placeholder token that the worker fills in itself.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from laneserve.config import SchedulerConfig
from laneserve.core.kv_cache_manager import KVCacheManager
from laneserve.core.request import Request, RequestStatus
from laneserve.protocol import (
    NewRequest,
    RequestOutput,
    ScheduledRequest,
    StepCommand,
    StepResult,
)


@dataclass(frozen=True)
class Planned:
    """What the scheduler promised for one request in one step."""

    handle: int
    num_tokens: int
    num_spec: int
    sample: bool
    epoch: int


@dataclass
class EngineCoreOutput:
    """Confirmed news about one request, for the frontend."""

    request: Request
    new_token_ids: list[int]
    logprobs: list = field(default_factory=list)
    finished: bool = False


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    num_prefill_chunks: int = 0  # prefill pieces that did not end their prompt
    num_prompt_tokens: int = 0  # prompt tokens prefilled (again after a preemption)
    num_request_prompt_tokens: int = 0  # every request's whole prompt, once (cached included)
    num_cached_prompt_tokens: int = 0  # ... of which the prefix cache held
    num_generation_tokens: int = 0
    num_drafts: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        num_spec_tokens: int = 0,
        spec_disable_batch: int | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.num_spec_tokens = num_spec_tokens
        self.spec_disable_batch = spec_disable_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.stats = SchedulerStats(
            accepted_per_position=[0] * num_spec_tokens,
            drafts_per_position=[0] * num_spec_tokens,
        )
        self._step_ids = itertools.count()
        self._in_flight: dict[int, list[Planned]] = {}
        self._to_release: list[int] = []
        self._to_preempt: list[int] = []
        self._awaiting_prefill: set[int] = set()  # handles with a terminal prefill in flight

    # -- requests ----------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.handle] = req
        self.waiting.append(req)

    def abort(self, handle: int) -> Request | None:
        req = self.requests.get(handle)
        if req is not None and not req.is_finished:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def fail(self, handle: int, message: str) -> Request | None:
        req = self.requests.get(handle)
        if req is not None and not req.is_finished:
            req.error = message
            self._finish(req, RequestStatus.FINISHED_ERROR)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def has_pending_release(self) -> bool:
        return bool(self._to_release or self._to_preempt)

    # -- scheduling --------------------------------------------------------
    def schedule(self, force: bool = False) -> StepCommand | None:
        """Plan one step; None when nothing can run (and nothing to release), unless
        `force`: then an empty step (expert-parallel ranks step together)."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        new_requests: list[NewRequest] = []
        planned: list[Planned] = []
        preempted_now = False
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            item, cost, preempted = self._schedule_running(req, budget)
            preempted_now |= preempted
            if item is None:
                continue
            budget -= cost
            scheduled.append(item)
            planned.append(self._plan(req, item))
        if not preempted_now:
            budget = self._schedule_waiting(budget, scheduled, new_requests, planned)
        if not scheduled and not self.has_pending_release() and not force:
            return None
        cmd = StepCommand(
            step_id=next(self._step_ids),
            scheduled=scheduled,
            new_requests=new_requests,
            preempted=self._to_preempt,
            finished=self._to_release,
        )
        self._to_preempt, self._to_release = [], []
        self._in_flight[cmd.step_id] = planned
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += sum(s.num_tokens for s in scheduled)
        return cmd

    def _schedule_running(
        self, req: Request, budget: int
    ) -> tuple[ScheduledRequest | None, int, bool]:
        ahead = req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
        decode = ahead <= 1
        if decode:
            if req.remaining_output_slots <= 0:
                return None, 0, False  # all it may still emit is already in flight
            k = min(self._num_drafts(req), budget - 1)
            num_new = ahead + k
        else:
            k, num_new = 0, min(ahead, budget)
        preempted = False
        while True:
            blocks = self.kv.allocate_slots(req, num_new)
            if blocks is not None:
                break
            victim = self.running[-1]
            self._preempt(victim)
            preempted = True
            if victim is req:
                return None, 0, True
        item = ScheduledRequest(
            handle=req.handle,
            num_tokens=num_new,
            start=req.num_computed_tokens,
            decode=decode,
            sample=decode or req.num_computed_tokens + num_new >= req.num_tokens,
            num_spec=k,
            new_block_ids=list(blocks) if any(blocks) else [],
        )
        return item, num_new, preempted

    def _schedule_waiting(
        self,
        budget: int,
        scheduled: list[ScheduledRequest],
        new_requests: list[NewRequest],
        planned: list[Planned],
    ) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_output_placeholders > 0:
                # NOTE: preempted with tokens still in flight: it can only be
                # replayed once they are confirmed.
                skipped.append(self.waiting.popleft())
                continue
            hits, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, budget)
            blocks = self.kv.allocate_slots(req, num_new, hits)
            if blocks is None:
                break
            self.waiting.popleft()
            self.kv.record_lookup(req.num_tokens, num_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.scheduled_time = time.monotonic()
                self.stats.num_request_prompt_tokens += len(req.prompt_token_ids)
                self.stats.num_cached_prompt_tokens += num_hit
            req.num_computed_tokens = num_hit
            resumed = req.registered
            if not req.registered:
                new_requests.append(self._new_request(req))
                req.registered = True
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            item = ScheduledRequest(
                handle=req.handle,
                num_tokens=num_new,
                start=num_hit,
                sample=num_hit + num_new >= req.num_tokens,
                new_block_ids=list(self.kv.block_ids(req)),
                resumed=resumed,
            )
            budget -= num_new
            scheduled.append(item)
            planned.append(self._plan(req, item))
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _num_drafts(self, req: Request) -> int:
        if not self.num_spec_tokens or req.sampling_params.never_speculates:
            return 0
        if self.spec_disable_batch is not None and len(self.running) >= self.spec_disable_batch:
            return 0  # a large batch: verifying drafts costs more than it saves
        if req.handle in self._awaiting_prefill or not req.output_token_ids:
            return 0  # the first speculative decode waits for its prefill result
        return max(0, min(self.num_spec_tokens, req.remaining_output_slots - 1))

    def _plan(self, req: Request, item: ScheduledRequest) -> Planned:
        req.num_computed_tokens += item.num_tokens
        if item.sample:
            req.num_output_placeholders += 1 + item.num_spec
            if not item.decode:
                self._awaiting_prefill.add(req.handle)
        else:
            self.stats.num_prefill_chunks += 1
        if not item.decode:
            self.stats.num_prompt_tokens += item.num_tokens
        return Planned(req.handle, item.num_tokens, item.num_spec, item.sample, req.epoch)

    def _new_request(self, req: Request) -> NewRequest:
        return NewRequest(
            handle=req.handle,
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_ids=list(req.eos_token_ids),
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.epoch += 1
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._awaiting_prefill.discard(req.handle)
        self._to_preempt.append(req.handle)
        self.waiting.appendleft(req)

    def drop_in_flight(self) -> None:
        """Forget every in-flight step (their worker is gone)."""
        self._in_flight.clear()
        self._to_release.clear()
        self._to_preempt.clear()

    # -- results -----------------------------------------------------------
    def update_from_output(self, result: StepResult) -> list[EngineCoreOutput]:
        # NOTE: results arrive in FIFO order: this is the oldest step in flight.
        step_id = next(iter(self._in_flight))
        planned = self._in_flight.pop(step_id)
        outputs = {o.handle: o for o in result.outputs}
        errors = {e.handle: e.message for e in result.errors}
        if result.step_id != step_id:  # the worker could not even read the command
            message = next(iter(errors.values()), "the worker could not read the step command")
            errors = {p.handle: message for p in planned}
            outputs = {}
        news: list[EngineCoreOutput] = []
        for plan in planned:
            req = self.requests.get(plan.handle)
            if req is None or req.is_finished:
                continue  # finished or aborted while in flight: drop what it made
            if plan.handle in errors:
                self.fail(plan.handle, errors[plan.handle])
                news.append(EngineCoreOutput(req, [], finished=True))
                continue
            out = outputs.get(plan.handle)
            if out is not None and out.prompt_logprobs:
                req.record_prompt_logprobs(out.prompt_start, out.prompt_logprobs)
            if plan.sample:
                news.append(self._reconcile(req, plan, out))
            elif plan.epoch == req.epoch:
                self.kv.cache_blocks(req, req.num_computed_tokens)
        return news

    def _reconcile(
        self, req: Request, plan: Planned, out: RequestOutput | None
    ) -> EngineCoreOutput:
        tokens = out.token_ids if out is not None else []
        self._awaiting_prefill.discard(req.handle)
        req.num_output_placeholders -= 1 + plan.num_spec
        if plan.epoch == req.epoch:
            req.num_computed_tokens -= 1 + plan.num_spec - len(tokens)
        if out is not None and plan.num_spec:
            self._count_spec(out)
        news = EngineCoreOutput(req, [], logprobs=[])
        for i, token in enumerate(tokens):
            req.append_output(token)
            news.new_token_ids.append(token)
            if out is not None and out.logprobs:
                news.logprobs.append(out.logprobs[i])
            status = req.check_stop()
            if status is not None:
                self._finish(req, status)
                news.finished = True
                break
        self.stats.num_generation_tokens += len(news.new_token_ids)
        if not news.finished and plan.epoch == req.epoch:
            # NOTE: KV is confirmed for every position but the last token's.
            self.kv.cache_blocks(req, req.num_tokens - 1)
        return news

    def _count_spec(self, out: RequestOutput) -> None:
        s = self.stats
        s.num_drafts += out.num_drafts
        s.num_accepted += out.num_accepted
        for i in range(out.num_drafts):
            s.drafts_per_position[i] += 1
        for i in range(out.num_accepted):
            s.accepted_per_position[i] += 1

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.kv.forget(req)
        self._awaiting_prefill.discard(req.handle)
        del self.requests[req.handle]
        if req.registered:
            self._to_release.append(req.handle)
