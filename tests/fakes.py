"""A fake worker at the runner boundary: deterministic tokens, a real KV check.

`FakeWorker` implements the WorkerClient protocol. Its "model" writes each
input token into a simulated paged KV cache (block id, offset) and samples the
next token as a hash of the sequence it *reads back through the block table*.
So a wrong block table, a bad prefix-cache hit or a lost token after
preemption changes the output, and tests compare against `reference()` which
applies the same rule to the true sequence.

Steps execute lazily, in FIFO order, when `get_result` is called: with two
steps in flight, step N+1 is already submitted when step N runs, like the real
lanes.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from laneserve.protocol import (
    CacheGroupInfo,
    RequestError,
    RequestOutput,
    StepCommand,
    StepResult,
    WorkerReady,
)

VOCAB = 1000


def next_token(seq: list[int]) -> int:
    h = hashlib.blake2b(repr(seq).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % VOCAB


def reference(
    prompt: list[int], n: int, stop: Callable[[int], bool] = lambda t: False
) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        t = next_token(seq)
        out.append(t)
        seq.append(t)
        if stop(t):
            break
    return out


# drafter(sequence so far, k) -> k draft tokens
Drafter = Callable[[list[int], int], list[int]]


def perfect_drafter(seq: list[int], k: int) -> list[int]:
    return reference(seq, k)


def wrong_drafter(seq: list[int], k: int) -> list[int]:
    return [(t + 1) % VOCAB for t in reference(seq, k)]


@dataclass
class _Req:
    prompt: list[int]
    tokens: list[int]  # committed: prompt + outputs
    blocks: list[int] = field(default_factory=list)


class FakeWorker:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 4,
        max_model_len: int = 256,
        drafter: Drafter = perfect_drafter,
        fail_steps: set[int] | None = None,
        exact_plans: bool = False,
    ) -> None:
        self.block_size = block_size
        self.ready = WorkerReady(
            cache_groups=[CacheGroupInfo("main", "full_attention", num_blocks)],
            block_size=block_size,
            max_model_len=max_model_len,
            vocab_size=VOCAB,
            eos_token_ids=[],
            model_dir="",
            device="cpu",
            weight_dtype="fake",
            kernels="fake",
            load_s=0.0,
        )
        self.drafter = drafter
        # sync scheduling: the plan must equal the worker's committed state
        self.exact_plans = exact_plans
        self.fail_steps = fail_steps or set()
        self.kv: dict[tuple[int, int], int] = {}
        self.reqs: dict[int, _Req] = {}
        self.pending: deque[StepCommand] = deque()
        self.commands: list[StepCommand] = []
        self.max_in_flight = 0
        self.released: list[int] = []

    # -- WorkerClient --------------------------------------------------------
    def submit(self, cmd: StepCommand) -> None:
        self.pending.append(cmd)
        self.commands.append(cmd)
        self.max_in_flight = max(self.max_in_flight, len(self.pending))

    def get_result(self) -> StepResult:
        return self._run(self.pending.popleft())

    def shutdown(self) -> None:
        self.pending.clear()

    # -- the fake model -------------------------------------------------------
    def _run(self, cmd: StepCommand) -> StepResult:
        for new in cmd.new_requests:
            assert new.handle not in self.reqs, "registered twice"
            self.reqs[new.handle] = _Req(list(new.prompt_token_ids), list(new.prompt_token_ids))
        for h in cmd.preempted:
            self.reqs[h].blocks = []
        if cmd.step_id in self.fail_steps:
            return StepResult(
                step_id=cmd.step_id,
                errors=[RequestError(s.handle, "injected failure") for s in cmd.scheduled],
            )
        outputs = []
        for s in cmd.scheduled:
            req = self.reqs[s.handle]
            if s.new_block_ids:
                if s.resumed:
                    req.blocks = []
                req.blocks.extend(s.new_block_ids[0])
            out = self._run_one(req, s)
            if out is not None:
                outputs.append(RequestOutput(s.handle, *out))
        for h in cmd.finished:
            self.reqs.pop(h, None)
            self.released.append(h)
        return StepResult(step_id=cmd.step_id, outputs=outputs)

    def _write(self, req: _Req, pos: int, token: int) -> None:
        bs = self.block_size
        assert pos // bs < len(req.blocks), f"position {pos} beyond the block table {req.blocks}"
        self.kv[(req.blocks[pos // bs], pos % bs)] = token

    def _read(self, req: _Req, n: int) -> list[int]:
        bs = self.block_size
        return [self.kv[(req.blocks[p // bs], p % bs)] for p in range(n)]

    def _run_one(self, req: _Req, s) -> tuple[list[int], list, int, int] | None:
        if s.decode:
            start = len(req.tokens) - 1  # the worker's committed count, not the plan
            assert s.num_tokens == 1 + s.num_spec, "a decode is one token plus its draft slots"
            assert s.start >= start, "the plan must be an upper bound of the committed state"
            assert -(-(s.start + s.num_tokens) // self.block_size) <= len(req.blocks)
            if self.exact_plans:
                assert s.start == start, f"sync plan {s.start} != committed {start}"
            drafts = self.drafter(list(req.tokens), s.num_spec) if s.num_spec else []
            inputs = [req.tokens[-1], *drafts]
        else:
            start = s.start
            inputs = req.tokens[start : start + s.num_tokens]
            assert len(inputs) == s.num_tokens, "prefill beyond the known tokens"
            drafts = []
        for i, tok in enumerate(inputs):
            self._write(req, start + i, tok)
        if not s.sample:
            return None
        seen = self._read(req, start + 1)
        assert seen == req.tokens[: start + 1], "KV cache content does not match the sequence"
        emitted = []
        seq = list(req.tokens)
        for d in [*drafts, None]:
            t = next_token(seq)
            emitted.append(t)
            seq.append(t)
            if d is None or d != t:
                break
        req.tokens.extend(emitted)
        accepted = len(emitted) - 1
        return emitted, [], len(drafts), accepted
