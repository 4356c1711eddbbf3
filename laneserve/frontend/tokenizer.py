"""The checkpoint's tokenizer (HF `tokenizer.json`, GGUF ones converted into the
cache) and its chat template."""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

from laneserve.chat_formats import render_chat
from laneserve.frontend.token_bytes import TokenBytes

log = logging.getLogger(__name__)


class Tokenizer:
    def __init__(
        self,
        directory: Path | str,
        chat_template: str | None = None,
        chat_format: str | None = None,
    ) -> None:
        """`chat_template`: a file, or the template text, used instead of the model's;
        `chat_format`: a format in code (`laneserve.chat_formats`) used where no Jinja
        template is given."""
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(directory))
        except Exception as e:
            raise ValueError(f"cannot load a tokenizer from {directory}: {e}") from None
        self.vocab_size = len(self.hf)
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.all_special_ids = set(self.hf.all_special_ids)
        self.chat_template = _load_template(chat_template)
        self.chat_format = chat_format
        self._bytes = TokenBytes(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(
            self.chat_template or self.chat_format or getattr(self.hf, "chat_template", None)
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return _text(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The token's real bytes (a byte-level symbol such as `ðŁ` is two bytes)."""
        return self._bytes.of(token_id)

    def token_text(self, token_id: int) -> str:
        """One token as text; a token that is not valid UTF-8 on its own (part of a
        character) is `bytes:\\xHH...`, as OpenAI's API shows it."""
        return self._bytes.text(token_id)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        max_chars: int | None = None,
    ) -> list[int]:
        """Token ids of the conversation. `chat_template` (the text) overrides the
        served one; `chat_template_kwargs` reach the template as variables (only
        those it reads: TemplateKwargError otherwise); `continue_final_message`
        leaves the last (assistant) message open; `tools` (OpenAI function
        definitions) reach it as `tools`; a text longer than `max_chars` is a
        ValueError before it is tokenized."""
        template = chat_template or self.chat_template
        if not template and not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"message {i} has unknown role {m['role']!r}")
        reserved = _RESERVED & set(chat_template_kwargs or {})
        if reserved:
            raise TemplateKwargError(f"chat_template_kwargs may not set {sorted(reserved)}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        if not template and self.chat_format is not None:
            text = render_chat(
                self.chat_format,
                messages,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
        else:  # NOTE: a format in code checks its own kwargs (chat_formats/)
            _check_kwargs(template or _hf_template(self.hf), chat_template_kwargs or {})
            text = _text(
                _render(
                    self.hf,
                    messages,
                    template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tools=tools,
                    **(chat_template_kwargs or {}),
                )
            )
        if max_chars is not None and len(text) > max_chars:
            raise ValueError(
                f"the chat template rendered {len(text)} characters; the limit is {max_chars}"
            )
        # NOTE: the template (or format) already writes any BOS it wants.
        return self.encode(text, add_special_tokens=False)


class TemplateKwargError(ValueError):
    """A chat_template_kwargs key the chat template does not read."""


def _hf_template(hf) -> str | None:
    template = getattr(hf, "chat_template", None)
    return template if isinstance(template, str) else None


def _check_kwargs(template: str | None, kwargs: dict) -> None:
    """Every key must be a variable the template reads (a typo must not pass)."""
    if not kwargs:
        return
    known = template_variables(template) if template else frozenset()
    if known is None:
        return  # NOTE: a template that does not parse: rendering says why
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        raise TemplateKwargError(
            f"chat_template_kwargs: the chat template reads no variable named {unknown[0]!r} "
            f"(it reads {', '.join(sorted(known - _RESERVED)) or 'none'})"
        )


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str] | None:
    """The undeclared variables of a Jinja template (those a caller may set);
    None when it does not parse."""
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ast = ImmutableSandboxedEnvironment().parse(template)
    except Exception:
        return None
    return frozenset(meta.find_undeclared_variables(ast))


# set by the request itself, never through chat_template_kwargs
_RESERVED = frozenset(
    {
        "tokenize",
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
    }
)


def _load_template(template: str | None) -> str | None:
    """A path to a template file, or the template text itself (as vLLM's flag)."""
    if not template:
        return None
    path = Path(template)
    if "\n" not in template and len(template) < 4096 and path.is_file():
        return path.read_text()
    if not any(mark in template for mark in ("{{", "{%")):
        raise ValueError(f"chat_template {template!r} is neither a file nor a Jinja template")
    return template


def _render(hf, messages: list[dict], template: str | None, **kw: object) -> object:
    """The template's text; a template error is the caller's (a ValueError)."""
    from jinja2 import TemplateError

    try:
        return hf.apply_chat_template(messages, tokenize=False, chat_template=template, **kw)
    except TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from None


def _text(value: object) -> str:
    """HF tokenizers return str for one sequence; their annotations allow lists too."""
    if not isinstance(value, str):
        raise TypeError(f"expected text from the tokenizer, got {type(value).__name__}")
    return value
