"""`LLM.llm_engine`: vLLM's `LLMEngine` calls over laneserve's engine, for scripts
that drive requests step by step: `add_request(request_id, prompt, params)`,
`step()` (a `RequestOutput` per request that moved, shaped by its params'
`output_kind`: everything so far, only the new text / tokens / logprobs, or only
the finished output), `has_unfinished_requests()`, `abort_request(ids)`,
`get_tokenizer()`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from laneserve.frontend.engine import LLMEngine
from laneserve.frontend.output_processor import RequestState, completion_output, request_metrics
from laneserve.outputs import CompletionOutput, Logprob, RequestOutput
from laneserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Tracked:
    states: list[RequestState]
    kind: RequestOutputKind
    texts: dict[int, str] = field(default_factory=dict)  # by core handle: text so far


@dataclass
class _Step:
    """What one request's samples gained in one step, by core handle."""

    text: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[dict[int, Logprob]]] = field(default_factory=dict)


class EngineView:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._live: dict[str, _Tracked] = {}

    def get_tokenizer(self):
        return self.engine.tokenizer.hf

    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None
    ) -> None:
        params = params if params is not None else SamplingParams()
        ids, text = self.engine.tokenize(prompt)
        states = self.engine.add_request(request_id, ids, params, text)
        self._live[request_id] = _Tracked(states, params.output_kind)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished

    def get_num_unfinished_requests(self) -> int:
        return len(self._live)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.engine.abort(rid)
            self._live.pop(rid, None)

    def step(self) -> list[RequestOutput]:
        moved: dict[str, _Step] = {}
        for d in self.engine.step():
            rid, key = d.state.group_id, d.state.request.handle
            tracked = self._live.get(rid)
            if tracked is None:
                continue
            s = moved.setdefault(rid, _Step())
            s.text[key] = s.text.get(key, "") + d.text
            s.tokens.setdefault(key, []).extend(d.token_ids)
            s.logprobs.setdefault(key, []).extend(d.logprobs)
            tracked.texts[key] = tracked.texts.get(key, "") + d.text
        outputs = []
        for rid, s in moved.items():
            tracked = self._live[rid]
            finished = all(st.finish_reason is not None for st in tracked.states)
            if finished:
                del self._live[rid]
            if tracked.kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            outputs.append(_output(rid, tracked, s, finished))
        return outputs


def _output(rid: str, tracked: _Tracked, s: _Step, finished: bool) -> RequestOutput:
    first = tracked.states[0]
    outs = []
    for st in tracked.states:
        key = st.request.handle
        out = completion_output(st, tracked.texts.get(key, ""))
        if tracked.kind == RequestOutputKind.DELTA:
            out = _delta(out, s, key)
        outs.append(out)
    errors = [st.error for st in tracked.states if st.error]
    return RequestOutput(
        request_id=rid,
        prompt=first.prompt,
        prompt_token_ids=list(first.request.prompt_token_ids),
        outputs=outs,
        finished=finished,
        prompt_logprobs=first.prompt_logprobs,
        metrics=request_metrics(first),
        error=errors[0] if errors else None,
    )


def _delta(out: CompletionOutput, s: _Step, key: int) -> CompletionOutput:
    return replace(
        out,
        text=s.text.get(key, ""),
        token_ids=s.tokens.get(key, []),
        logprobs=s.logprobs.get(key, []) if out.logprobs is not None else None,
    )
