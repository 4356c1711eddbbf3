"""OpenAI Responses API requests (`POST /v1/responses`) and their translation to a
chat request, so that the chat path (template, tools, structured output, limits)
serves them.

`input` is a string (one user message) or a list of items: messages (roles user /
system / developer / assistant, content a string or `input_text` / `output_text`
parts), `function_call` items (an earlier answer's calls) and
`function_call_output` items (their results). `instructions` becomes a leading
system message, `max_output_tokens` the token limit, `text.format` the structured
output (`json_schema` / `json_object`), `tools` the function tools. Nothing is
stored: `store: true`, `previous_response_id` and `background` are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from laneserve.entrypoints.openai_protocol import ChatCompletionRequest, Text


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_schema", "json_object"] = "text"
    name: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: StrictBool | None = None

    def response_format(self) -> dict | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise ValueError("text.format: a json_schema format needs `schema`")
        spec: dict[str, Any] = {"name": self.name or "response", "schema": self.schema_}
        if self.strict is not None:
            spec["strict"] = self.strict
        return {"type": "json_schema", "json_schema": spec}

    def body(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat = Field(default_factory=TextFormat)


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: Text


# accepted and ignored: bookkeeping that does not change the tokens generated
_IGNORED = ("metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    input: Text | list[dict]
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = None
    previous_response_id: Text | None = None
    background: StrictBool | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: dict | None = None
    include: list[str] | None = None
    metadata: dict | None = None
    user: Text | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a field this server cannot honour."""
        if self.store:
            return "store", "store: laneserve keeps no responses; send store: false"
        if self.previous_response_id is not None:
            return (
                "previous_response_id",
                "previous_response_id: laneserve keeps no responses; send the whole "
                "conversation in `input`",
            )
        if self.background:
            return "background", "background: not supported by laneserve"
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            return "reasoning", "reasoning: not supported by laneserve"
        if self.include:
            return "include", f"include: not supported by laneserve (got {self.include})"
        return None

    def format(self) -> TextFormat:
        return self.text.format if self.text is not None else TextFormat()

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion (ValueError / pydantic's: a 400)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += input_messages(self.input)
        body: dict[str, Any] = {"messages": messages, "stream": False}
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.format().response_format(),
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        return ChatCompletionRequest.model_validate(body)


def input_messages(items: str | list[dict]) -> list[dict]:
    """Chat messages from the Responses `input`; consecutive function calls form one
    assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"input[{i}]: expected an object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")}
            )
        else:
            raise ValueError(f"input[{i}]: items of type {kind!r} are not supported by laneserve")
    return out


def _content(content: object, i: int) -> object:
    """Message content as chat reads it: a string, or its text parts joined."""
    if isinstance(content, str) or content is None:
        return content
    if not isinstance(content, list):
        raise ValueError(f"input[{i}].content: expected a string or a list of parts")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"input[{i}].content: only text parts are supported (got {kind!r})")
        parts.append({"type": "text", "text": part.get("text")})
    return parts
