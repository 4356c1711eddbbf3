"""Which chat format a model gets, and one conversation rendered with it.

`--tokenizer-mode` (vLLM's flag): `auto` picks the format of the checkpoint's
architecture (Jinja templates for every other one), `hf` always uses the tokenizer's
Jinja template, and a format name forces that format (a fine-tune of DeepSeek V4
saved under another architecture name, say)."""

from __future__ import annotations

from collections.abc import Callable

from laneserve.chat_formats import deepseek_v4, deepseek_v32

CHAT_FORMATS: dict[str, Callable[..., str]] = {
    "deepseek_v32": deepseek_v32.encode,
    "deepseek_v4": deepseek_v4.encode,
}
TOKENIZER_MODES = ("auto", "hf", *CHAT_FORMATS)
_BY_ARCHITECTURE = {
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}
# chat_template_kwargs each format reads (as vLLM passes them to these encoders)
_FLAGS = ("thinking", "enable_thinking", "drop_thinking")
_KWARGS = {"deepseek_v32": _FLAGS, "deepseek_v4": (*_FLAGS, "reasoning_effort")}


def resolve_chat_format(mode: str, architectures: list[str]) -> str | None:
    """The chat format's name, or None for the tokenizer's Jinja template."""
    if mode == "auto":
        return next((_BY_ARCHITECTURE[a] for a in architectures if a in _BY_ARCHITECTURE), None)
    if mode == "hf":
        return None
    if mode in CHAT_FORMATS:
        return mode
    raise ValueError(f"tokenizer_mode {mode!r} is not one of {list(TOKENIZER_MODES)}")


def render_chat(
    name: str,
    messages: list[dict],
    *,
    tools: list[dict] | None,
    chat_template_kwargs: dict | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> str:
    """The prompt text; ValueError (a 400) for what the format cannot express."""
    if continue_final_message or not add_generation_prompt:
        raise ValueError(
            f"the {name} chat format always opens the assistant's turn: "
            "add_generation_prompt must stay true and continue_final_message false"
        )
    options = _options(name, chat_template_kwargs or {})
    if tools:
        messages = _with_tools(messages, tools)
    return CHAT_FORMATS[name](messages, **options)


def _options(name: str, kwargs: dict) -> dict:
    unknown = sorted(set(kwargs) - set(_KWARGS[name]))
    if unknown:
        raise ValueError(
            f"chat_template_kwargs {unknown} are not read by the {name} chat format "
            f"(it reads {list(_KWARGS[name])})"
        )
    for key in _FLAGS:
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise ValueError(f"chat_template_kwargs.{key} must be a boolean")
    options: dict = {"thinking": bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))}
    if "drop_thinking" in kwargs:
        options["drop_thinking"] = kwargs["drop_thinking"]
    if kwargs.get("reasoning_effort") is not None:
        options["reasoning_effort"] = kwargs["reasoning_effort"]
    return options


def _with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The tool schemas ride on the first system message (a new, empty one if the
    conversation has none), as DeepSeek's encoders expect."""
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
            raise ValueError(
                f"a tool must be {{'type': 'function', 'function': {{...}}}}, got {t!r}"
            )
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "tools": tools}, *messages[1:]]
    return [{"role": "system", "tools": tools}, *messages]
