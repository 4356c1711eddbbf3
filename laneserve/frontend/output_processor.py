"""Turns confirmed tokens from the engine core into text, logprobs and finish
reasons, per request. Stop strings are found here (on text); the request is
then aborted in the core and any tokens it made after the stop are dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from laneserve.core.request import Request
from laneserve.core.scheduler import EngineCoreOutput
from laneserve.frontend.detokenizer import IncrementalDetokenizer
from laneserve.frontend.no_tokenizer import NoTokenizer
from laneserve.frontend.tokenizer import Tokenizer
from laneserve.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from laneserve.protocol import TokenLogprobs


@dataclass
class RequestState:
    request: Request
    group_id: str  # the user's request id (shared by the n samples)
    index: int  # which of the n samples
    prompt: str | None
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # set with the first output
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class Delta:
    """What one request gained in one engine step."""

    state: RequestState
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finished: bool


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | NoTokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[int, RequestState] = {}  # by core handle

    def add(self, request: Request, group_id: str, index: int, prompt: str | None) -> RequestState:
        params = request.sampling_params
        state = RequestState(
            request=request,
            group_id=group_id,
            index=index,
            prompt=prompt,
            detok=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
        )
        self.states[request.handle] = state
        return state

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[Delta], list[Request]]:
        """Deltas for the callers, and requests a stop string ended (to abort)."""
        deltas, to_abort = [], []
        for out in outputs:
            state = self.states.get(out.request.handle)
            if state is None or state.finish_reason is not None:
                continue
            delta = self._apply(state, out)
            if delta.finished and out.request.status.finished is False:
                to_abort.append(out.request)
            deltas.append(delta)
            if delta.finished:
                del self.states[out.request.handle]
        return deltas, to_abort

    def _apply(self, state: RequestState, out: EngineCoreOutput) -> Delta:
        req = out.request
        now = time.monotonic()
        if out.new_token_ids and state.first_token_time is None:
            state.first_token_time = now
        if state.prompt_logprobs is None and req.prompt_logprobs is not None:
            # NOTE: complete here: the chunk that samples is the prompt's last
            state.prompt_logprobs = [
                self._entry(lp) if lp is not None else None for lp in req.prompt_logprobs
            ]
        kept = out.new_token_ids
        consumed = state.detok.add_tokens(kept) if kept else None
        stopped = consumed is not None
        if stopped:
            # tokens after the one that completed the stop string are dropped
            kept = kept[:consumed]
        state.token_ids.extend(kept)
        lps = self._logprobs(state, out.logprobs[: len(kept)])
        finished = stopped or out.finished
        if stopped:
            state.finish_reason, state.stop_reason = "stop", state.detok.stop_reason
        elif out.finished:
            state.finish_reason = req.status.finish_reason
            state.stop_reason = req.stop_reason
            state.error = req.error
        if finished:
            state.finished_time = now
        return Delta(state, state.detok.new_text(finished), kept, lps, finished)

    def _logprobs(self, state: RequestState, raw: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
        if state.logprobs is None:
            return []
        out = []
        for lp in raw:
            out.append(self._entry(lp))
            state.cumulative_logprob = (state.cumulative_logprob or 0.0) + lp.logprob
        state.logprobs.extend(out)
        return out

    def _entry(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """The chosen token, then the top-n (vLLM's shape)."""
        dec = self.tokenizer.token_text
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, dec(lp.token_id))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
            entry.setdefault(tid, Logprob(value, rank, dec(tid)))
        return entry

    def abort(self, handle: int) -> RequestState | None:
        state = self.states.pop(handle, None)
        if state is not None and state.finish_reason is None:
            state.finish_reason = "abort"
        return state


def completion_output(state: RequestState, text: str) -> CompletionOutput:
    return CompletionOutput(
        index=state.index,
        text=text,
        token_ids=list(state.token_ids),
        cumulative_logprob=state.cumulative_logprob,
        logprobs=state.logprobs,
        finish_reason=state.finish_reason,
        stop_reason=state.stop_reason,
    )


def request_metrics(state: RequestState) -> RequestMetrics:
    req = state.request
    return RequestMetrics(
        arrival_time=req.arrival_time,
        first_token_time=state.first_token_time,
        finished_time=state.finished_time,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        num_preemptions=req.num_preemptions,
    )


__all__ = ["Delta", "OutputProcessor", "RequestOutput", "RequestState"]
