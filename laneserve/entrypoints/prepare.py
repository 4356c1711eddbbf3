"""A request's preparation: prompt tokens and SamplingParams from its body.

Everything here may be slow for a large request (tokenizing megabytes, rendering
a chat template, compiling a grammar), so the server runs it on its `Offload`
threads, never on the event loop; every failure is an `APIError` naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from laneserve.entrypoints.api_errors import APIError
from laneserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from laneserve.frontend.tokenizer import TemplateKwargError
from laneserve.sampling_params import SamplingParams
from laneserve.tool_calls.choice import ToolPlan

Prompts = list[tuple[list[int], str | None]]

# characters a rendered chat template may produce per token of the context: a longer
# text cannot fit max_model_len, and is refused before it is tokenized
RENDERED_CHARS_PER_TOKEN = 64


@dataclass
class Prepared:
    prompts: Prompts
    params: SamplingParams
    tools: ToolPlan | None = None


def completion(engine, body: CompletionRequest) -> Prepared:
    prompts = [tokenize(engine, p) for p in body.prompts()]
    params = build_params(lambda: body.completion_params(engine.sampling_defaults))
    return Prepared(prompts, params)


def chat(engine, body: ChatCompletionRequest, tool_parser: str | None) -> Prepared:
    try:
        tools = body.tool_plan(tool_parser)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    ids = render(engine, body)
    params = build_params(
        lambda: body.sampling_params(
            body.max_new_tokens(), body.num_logprobs(), engine.sampling_defaults
        )
    )
    if tools is not None and tools.parser is not None and tools.parser.special_markers:
        # NOTE: the parser reads marker tokens that are special in the vocabulary
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    return Prepared([(ids, None)], params, tools)


def render(engine, body: ChatCompletionRequest) -> list[int]:
    """The conversation's tokens; a template that fails, overflows or renders too
    much is a 400 (its own template's, or the messages')."""
    field = "chat_template" if body.chat_template is not None else "messages"
    try:
        return engine.tokenizer.apply_chat_template(
            body.chat_messages(),
            body.add_generation_prompt and not body.continue_final_message,
            chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs,
            continue_final_message=body.continue_final_message,
            tools=body.template_tools(),
            max_chars=RENDERED_CHARS_PER_TOKEN * engine.max_model_len,
        )
    except TemplateKwargError as e:
        raise APIError(400, str(e), param="chat_template_kwargs") from None
    except (Exception, RecursionError, MemoryError) as e:  # NOTE: the template's or messages'
        raise APIError(400, f"{type(e).__name__}: {e}", param=field) from None


def build_params(build: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return build()
    except ValueError as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from None


def _param_of(message: str) -> str | None:
    """The request field a SamplingParams / constraint error names first."""
    head = message.split(":", 1)[0].split(" ", 1)[0].strip("'`\"")
    return head if head.replace("_", "").isalnum() and head.islower() else None


def tokenize(engine, prompt: str | list[int]) -> tuple[list[int], str | None]:
    try:
        return engine.tokenize(prompt)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"the prompt cannot be tokenized: {e}", param="prompt") from None
