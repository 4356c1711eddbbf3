"""The engine core's view of one request: token accounting in a few counters.

```
 all_token_ids:  | prompt ............ | output (confirmed) |
                 |<------------- num_tokens ------------->|<- placeholders ->|
 KV computed:    |<------------- num_computed_tokens -------------------->|
```
- `num_computed_tokens`: positions whose KV is (or is being) written. It may
  run ahead of `num_tokens` while steps are in flight (async) and is an upper
  bound under speculation until the result corrects it by the shortfall.
- `num_output_placeholders`: output slots scheduled but not yet confirmed
  (one per in-flight decode step, 1 + k for a speculative step).
- Tokens still to schedule: `num_tokens + num_output_placeholders -
  num_computed_tokens` (+ k reserved draft slots for a speculative decode).
- `epoch` increases on every preemption; a step result planned in an older
  epoch still delivers its tokens but no longer corrects the KV counters.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from laneserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, stop token, stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str  # the caller's id
    handle: int  # engine-unique integer used on the wire (never reused)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule (-1: not yet)
    num_preemptions: int = 0
    epoch: int = 0
    registered: bool = False  # the worker knows it (full data was sent)
    stop_reason: int | str | None = None
    error: str | None = None
    first_token_time: float | None = None
    # per prompt position (None at 0 and until computed); only when asked for
    prompt_logprobs: list | None = None
    scheduled_time: float | None = None  # first scheduled (queue time ends)
    dp_rank: int = 0  # the data-parallel rank that owns it, for its whole life

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    def record_prompt_logprobs(self, start: int, entries: list) -> None:
        """Entries for prompt positions start.. (a recompute after preemption sends
        the same values again; the first ones stay)."""
        if self.prompt_logprobs is None:
            return
        for i, entry in enumerate(entries, start):
            if i < len(self.prompt_logprobs) and self.prompt_logprobs[i] is None:
                self.prompt_logprobs[i] = entry

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        limit = self.max_model_len - self.num_prompt_tokens
        mt = self.sampling_params.max_tokens
        return limit if mt is None else min(mt, limit)

    @property
    def remaining_output_slots(self) -> int:
        """Outputs this request may still produce beyond those confirmed or in flight."""
        return self.max_tokens - len(self.output_token_ids) - self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """After appending one token: the finish status it causes, if any."""
        sp = self.sampling_params
        last = self.output_token_ids[-1]
        if len(self.output_token_ids) >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and last in sp.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
