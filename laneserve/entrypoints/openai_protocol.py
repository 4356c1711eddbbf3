"""OpenAI request bodies (pydantic) and their translation to SamplingParams.

Field names follow the OpenAI API plus vLLM's extensions (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `min_tokens`, ...).
Types, and the validity of every string (no lone surrogates: JSON can carry
them, UTF-8 and the tokenizer cannot), are checked here; value ranges by
SamplingParams (one source of truth); limits of the served model (vocabulary,
max_model_len, --max-n) by the server.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, cast

import msgspec
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
)

from laneserve.entrypoints.field_policy import unsupported_field
from laneserve.sampling_params import SamplingParams, is_valid_utf8
from laneserve.structured.params import KINDS, StructuredOutputsParams
from laneserve.structured.request_fields import from_request
from laneserve.tool_calls.choice import ToolPlan, forced_schema, plan


def _utf8(text: str) -> str:
    if not is_valid_utf8(text):
        raise ValueError("the string is not valid Unicode (it holds a lone surrogate)")
    return text


Text = Annotated[str, AfterValidator(_utf8)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` object, every field strictly typed (a mistyped
    one is a 400 naming it, never a surprise for the worker)."""

    model_config = ConfigDict(extra="forbid")

    json_: Text | dict[str, Any] | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = None
    whitespace_pattern: Text | None = None

    @field_validator("json_object", "disable_any_whitespace", mode="before")
    @classmethod
    def _not_null(cls, v: Any) -> Any:
        # NOTE: left out means the default; an explicit null is a mistyped value
        if v is None:
            raise ValueError("must be a boolean, not null")
        return v

    def fields(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_unset=True)


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    def fields(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_unset=True)


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class _Common(BaseModel):
    # NOTE: extra fields are kept so that `unsupported_field` can name them (a 400)
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    n: StrictInt = 1
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False  # vLLM's: the prompt's and the answer's token ids
    user: Text | None = None
    logit_bias: dict[str, StrictFloat] | None = None  # OpenAI: token ids as strings
    prompt_logprobs: StrictInt | None = None  # vLLM's: top-n logprobs of every prompt token
    # structured output (laneserve/structured/request_fields.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: Text | dict[str, Any] | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None
    ) -> SamplingParams:
        """`defaults`: values for the fields the request leaves unset (--generation-config)."""
        defaults = defaults or {}
        kw: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens if max_tokens is not None else defaults.get("max_tokens"),
            "logprobs": logprobs,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "seed": self.seed,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": self._token_bias(),
            "structured_outputs": self.structured(),
            "prompt_logprobs": self._prompt_logprobs(),
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        kw.update({k: v for k, v in defaults.items() if k in optional and optional[k] is None})
        kw.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParams(**kw)

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint the request asks for (ValueError: a 400)."""
        guided = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
            "guided_whitespace_pattern": self.guided_whitespace_pattern,
        }
        return from_request(self._response_format(), self._structured_fields(), guided)

    def _response_format(self) -> dict[str, Any] | None:
        return self.response_format.fields() if self.response_format else None

    def _structured_fields(self) -> dict[str, Any] | None:
        return self.structured_outputs.fields() if self.structured_outputs else None

    def _prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available when streaming (as in vLLM)")
        return self.prompt_logprobs

    def _token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"logit_bias: keys must be token ids, got {key!r}")
            out[int(key)] = value
        return out

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, message) for a field this request may not carry (see field_policy)."""
        return unsupported_field(dict(self.model_extra or {}), self.n)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, p: str | list) -> str | list:
        if isinstance(p, list) and (not p or any(isinstance(x, list) and not x for x in p)):
            raise ValueError("the prompt must not be empty (nor any prompt in a batch)")
        return p

    @property
    def prompt_only(self) -> bool:
        """`echo` with `max_tokens=0` (not streamed): the prompt and its logprobs only."""
        return self.echo and self.max_tokens == 0 and not self.stream

    def completion_params(self, defaults: dict | None = None) -> SamplingParams:
        """`echo` + `logprobs` asks for the prompt's logprobs too; a prompt-only request
        runs one step (its token is dropped)."""
        max_tokens = 1 if self.prompt_only else self.max_tokens
        params = self.sampling_params(max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None and not self.stream:
            wanted = max(self.logprobs, params.prompt_logprobs or 0)
            params = msgspec.structs.replace(params, prompt_logprobs=wanted)
        return params

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [cast(list[int], p)]
        return cast(list[str | list[int]], list(p))


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: ToolName
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema
    # NOTE: enforced under tool_choice "required" / named (the grammar); "auto" parses only
    strict: StrictBool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: ToolName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: Text
    arguments: Text  # JSON text, as the API returned it


class MessageToolCall(BaseModel):
    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict:
        """As chat templates read it: the arguments as an object where they parse."""
        args: object = self.function.arguments
        try:
            parsed = json.loads(self.function.arguments)
            args = parsed if isinstance(parsed, dict) else args
        except json.JSONDecodeError:
            pass
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": args},
        }


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers
    name: Text | None = None

    def for_template(self) -> dict:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls (got {self.role})")
        out: dict = {"role": "system" if self.role == "developer" else self.role}
        out["content"] = self.text()
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        reasoning = self.reasoning_text()
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out

    def reasoning_text(self) -> str | None:
        """An earlier assistant turn's thinking (vLLM's `reasoning_content`, or
        `reasoning`), for chat formats that replay it."""
        extra = self.model_extra or {}
        value = extra.get("reasoning_content", extra.get("reasoning"))
        if value is None:
            return None
        if self.role != "assistant" or not isinstance(value, str):
            raise ValueError("reasoning_content is a string on assistant messages only")
        return value

    def text(self) -> str:
        """The content as one string; ValueError for non-text or invalid parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(_utf8(part["text"]))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    def chat_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates read them (OpenAI's shape)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def _functions(self) -> list[dict]:
        return [
            {"name": t.function.name, "parameters": t.function.parameters} for t in self.tools or []
        ]

    def _choice(self) -> object:
        c = self.tool_choice
        return c.model_dump() if isinstance(c, NamedToolChoice) else c

    def tool_plan(self, parser: str | None) -> ToolPlan | None:
        """How the answer's tool calls are read (ValueError: a 400); `parser`: the
        server's auto tool-choice parser, if enabled."""
        return plan(
            self._functions() or None, self._choice(), self.parallel_tool_calls is not False, parser
        )

    def structured(self) -> StructuredOutputsParams | None:
        """A "required" or named tool choice is an output constraint of its own."""
        tools = self._functions()
        schema = (
            forced_schema(tools, self._choice(), self.parallel_tool_calls is not False)
            if tools
            else None
        )
        if schema is None:
            return super().structured()
        so = self._structured_fields() or {}
        others = any(so.get(k) is not None for k in KINDS) or any(
            getattr(self, f) is not None for f in GUIDED_FIELDS
        )
        if others or (self._response_format() or {}).get("type", "text") != "text":
            raise ValueError(
                "tool_choice: a required or named tool choice cannot be combined with "
                "response_format, structured_outputs or guided_* fields"
            )
        options = {k: so[k] for k in ("disable_any_whitespace", "whitespace_pattern") if k in so}
        try:
            return StructuredOutputsParams(json=schema, **options)
        except ValueError as e:
            raise ValueError(
                f"tools: the function parameters are not a usable JSON schema: {e}"
            ) from None

    def max_new_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0
