"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(...)`."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Generator, Iterator, Sequence
from typing import cast

from tqdm import tqdm

from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from laneserve.frontend.engine_view import EngineView
from laneserve.frontend.interrupts import abort_and_drain, whole_step
from laneserve.frontend.output_processor import RequestState, completion_output, request_metrics
from laneserve.log_setup import show_progress_logs
from laneserve.model_path import ModelPathError, check_model_path
from laneserve.outputs import RequestOutput
from laneserve.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """vLLM-style offline engine. Keyword arguments are `EngineArgs` fields
    (`dtype`, `max_model_len`, `max_num_seqs`, `enable_prefix_caching`,
    `async_scheduling`, `speculative_config`, ...)."""

    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        show_progress_logs()
        args = EngineArgs.from_kwargs({"model": model, **kwargs})
        try:  # NOTE: a hub id is told what is accepted before anything loads
            check_model_path(args.model)
        except ModelPathError as e:  # the message says it all; laneserve's frames would not
            raise e.with_traceback(None) from None
        config = args.create_config()
        self.engine = LLMEngine(config)
        self._view: EngineView | None = None
        self._ids = itertools.count()
        # NOTE: the lane threads keep the engine (worker, model, KV cache) reachable, so
        # an LLM dropped without shutdown() would leak them; the finalizer shuts the
        # engine down when this object is collected (or at exit). It must not hold
        # `self`, and it runs at most once (shutdown() calls it too).
        self._finalizer = weakref.finalize(self, _shutdown_engine, self.engine)

    @property
    def llm_engine(self) -> EngineView:
        """vLLM's step-by-step engine calls (add_request, step, ...; engine_view.py)."""
        if self._view is None:
            self._view = EngineView(self.engine)
        return self._view

    def get_tokenizer(self):
        return self.engine.tokenizer.hf

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        items = _as_list(prompts)
        params = _params_list(sampling_params, len(items), self.engine.sampling_defaults)
        tokenized = [self.engine.tokenize(p) for p in items]
        for ids, _ in tokenized:  # NOTE: validate everything before adding anything
            self.engine.core.check_prompt(ids)
        return self._run(tokenized, params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: `chat_template` (the text) overrides the served template,
        `chat_template_kwargs` reach it as variables, `tools` (OpenAI function
        definitions) are rendered by the template; the output is plain text."""
        # one conversation (a list of messages) or a list of them
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = cast(list[list[dict]], [messages] if one else messages)
        tok = self.engine.tokenizer
        prompts = [
            {
                "prompt_token_ids": tok.apply_chat_template(
                    c,
                    add_generation_prompt and not continue_final_message,
                    chat_template=chat_template,
                    chat_template_kwargs=chat_template_kwargs,
                    continue_final_message=continue_final_message,
                    tools=tools,
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> TextStream:
        """Generate for one prompt; iterate the result for the text as it is produced,
        then read `.output` (the `RequestOutput`).

        Closing the stream early (``break`` and ``close()``, or leaving a ``with`` block)
        aborts the request, so the engine is free for the next one.
        """
        ids, text = self.engine.tokenize(prompt)
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream() generates one sequence: use n=1")
        rid = str(next(self._ids))
        states = self.engine.add_request(rid, ids, params, text)
        return TextStream(self.engine, rid, states)

    def chat_prompt(
        self, messages: list[dict], *, add_generation_prompt: bool = True
    ) -> dict[str, list[int]]:
        """The token ids of a conversation rendered with the model's chat template."""
        ids = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt)
        return {"prompt_token_ids": ids}

    def get_stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the worker and free the model and KV cache (idempotent)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _run(
        self,
        tokenized: list[tuple[list[int], str | None]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        order: list[str] = []
        groups: dict[str, list[RequestState]] = {}
        for (ids, text), p in zip(tokenized, params, strict=True):
            rid = str(next(self._ids))
            groups[rid] = self.engine.add_request(rid, ids, p, text)
            order.append(rid)
        texts: dict[int, str] = {}
        bar = tqdm(
            total=len(order), desc="generating", unit="req", disable=not use_tqdm or len(order) < 2
        )
        try:
            while self.engine.has_unfinished:
                for d in whole_step(self.engine):
                    key = d.state.request.handle
                    texts[key] = texts.get(key, "") + d.text
                    if d.finished and all(s.finish_reason for s in groups[d.state.group_id]):
                        bar.update(1)
        except KeyboardInterrupt:
            abort_and_drain(self.engine, order)
            raise KeyboardInterrupt("interrupted: the requests were aborted") from None
        finally:
            bar.close()
        return [_request_output(rid, groups[rid], texts) for rid in order]


class TextStream:
    """The text of one request as it is generated (see `LLM.stream`)."""

    def __init__(self, engine: LLMEngine, request_id: str, states: list[RequestState]) -> None:
        self._engine = engine
        self._rid = request_id
        self._states = states
        self._text = ""
        self._pieces = self._generate()
        self.output: RequestOutput | None = None  # set when the request has finished

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop early: abort the request if it still runs."""
        self._pieces.close()

    def _generate(self) -> Generator[str]:
        state = self._states[0]
        try:
            while state.finish_reason is None and self._engine.has_unfinished:
                for d in whole_step(self._engine):
                    if d.state is state and d.text:
                        self._text += d.text
                        yield d.text
        finally:
            if state.finish_reason is None:  # closed early, or Ctrl-C
                abort_and_drain(self._engine, [self._rid])
            else:
                texts = {state.request.handle: self._text}
                self.output = _request_output(self._rid, self._states, texts)


def _shutdown_engine(engine: LLMEngine) -> None:
    engine.shutdown()


def _request_output(rid: str, states: list[RequestState], texts: dict[int, str]) -> RequestOutput:
    first = states[0]
    errors = [s.error for s in states if s.error]
    return RequestOutput(
        request_id=rid,
        prompt=first.prompt,
        prompt_token_ids=list(first.request.prompt_token_ids),
        outputs=[completion_output(s, texts.get(s.request.handle, "")) for s in states],
        finished=True,
        prompt_logprobs=first.prompt_logprobs,
        metrics=request_metrics(first),
        error=errors[0] if errors else None,
    )


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


def _params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int, defaults: dict
) -> list[SamplingParams]:
    if params is None:  # NOTE: the model's generation defaults (--generation-config auto)
        return [SamplingParams(**defaults) for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
