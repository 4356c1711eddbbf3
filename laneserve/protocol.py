"""Every message that crosses the engine <-> worker boundary (msgpack on the wire).

Requests are named by an engine-unique integer `handle` (never reused, so a
late message about an old request cannot touch a new one with the same
user-visible id). Full request data travels once (`NewRequest`); after that a
step sends only what changed (`ScheduledRequest`).
"""

from __future__ import annotations

import msgspec

from laneserve.sampling_params import SamplingParams

_STRUCT = {"array_like": True, "omit_defaults": True, "gc": False}


class NewRequest(msgspec.Struct, **_STRUCT):
    handle: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []


class ScheduledRequest(msgspec.Struct, **_STRUCT):
    """One request's share of a step.

    `start` is the scheduler's num_computed_tokens before the step: exact for a
    prefill chunk; for a decode (`decode=True`) the worker uses its own
    committed count instead, which the scheduler may not know yet (async,
    speculation). The step computes `num_tokens` positions, of which the last
    `num_spec` are draft slots the worker fills with its pending drafts.
    """

    handle: int
    num_tokens: int
    start: int
    decode: bool = False
    sample: bool = True  # False: a prefill chunk that does not end the prompt
    num_spec: int = 0
    new_block_ids: list[list[int]] = []  # per cache group, appended to the table
    resumed: bool = False  # new_block_ids replace the table (after preemption)


class StepCommand(msgspec.Struct, **_STRUCT):
    step_id: int
    scheduled: list[ScheduledRequest] = []
    new_requests: list[NewRequest] = []
    preempted: list[int] = []  # handles whose blocks were taken back
    finished: list[int] = []  # handles to release (after earlier steps ran)


class TokenLogprobs(msgspec.Struct, **_STRUCT):
    """Logprobs at one generated position: the chosen token and the top-n."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestOutput(msgspec.Struct, **_STRUCT):
    handle: int
    token_ids: list[int]  # 1..k+1 new tokens (empty for a prefill chunk)
    logprobs: list[TokenLogprobs] = []
    num_drafts: int = 0  # draft tokens verified in this step
    num_accepted: int = 0
    # prompt logprobs of this step's prefill chunk: entry i is the prompt token
    # at position prompt_start + i (given the tokens before it)
    prompt_logprobs: list[TokenLogprobs] = []
    prompt_start: int = 0


class RequestError(msgspec.Struct, **_STRUCT):
    handle: int
    message: str


class LaneTimes(msgspec.Struct, **_STRUCT):
    """When a step ran on each worker lane: start / end, `time.perf_counter_ns()` of the
    worker process (a monotonic clock, so the engine and worker clocks agree). Sent only
    when the worker was asked to record it (`WorkerConfig.lane_times`)."""

    prepare: tuple[int, int]
    device: tuple[int, int]
    output: tuple[int, int]


class StepResult(msgspec.Struct, tag=True, **_STRUCT):
    step_id: int
    outputs: list[RequestOutput] = []
    errors: list[RequestError] = []
    lane_times: LaneTimes | None = None


class CacheGroupInfo(msgspec.Struct, **_STRUCT):
    name: str
    kind: str  # "full_attention", "sliding_window" or "compressed"
    num_blocks: int
    block_size: int = 0  # token positions per block (0: WorkerReady.block_size)
    window: int = 0  # sliding_window: positions a query reads behind itself


class WorkerReady(msgspec.Struct, tag=True, **_STRUCT):
    """The worker handshake: what the engine learns at start-up."""

    cache_groups: list[CacheGroupInfo]
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    model_dir: str  # HF-style directory (a GGUF file's converted cache dir)
    device: str
    weight_dtype: str
    kernels: str
    load_s: float
    # expert parallelism: the routed experts (global ids) this rank holds; [] = all
    local_experts: list[int] = []


class WorkerFailed(msgspec.Struct, tag=True, **_STRUCT):
    message: str
    bad_input: bool = False  # a ValueError (bad model path, bad config) vs a crash


# worker -> engine
WorkerMessage = StepResult | WorkerReady | WorkerFailed

_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _ENCODER.encode(msg)


def decode_command(data: bytes) -> StepCommand:
    return msgspec.msgpack.decode(data, type=StepCommand)


def decode_result(data: bytes) -> StepResult:
    return msgspec.msgpack.decode(data, type=StepResult)


def decode_worker_message(data: bytes) -> WorkerMessage:
    return msgspec.msgpack.decode(data, type=WorkerMessage)
