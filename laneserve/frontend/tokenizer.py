"""The checkpoint's tokenizer (HF `tokenizer.json`, GGUF ones converted into the
cache) and its chat template."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, directory: Path | str) -> None:
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(directory))
        except Exception as e:
            raise ValueError(f"cannot load a tokenizer from {directory}: {e}") from None
        self.vocab_size = len(self.hf)
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.all_special_ids = set(self.hf.all_special_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return _text(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token as text; a token that is only part of a UTF-8 character is
        shown as its raw vocabulary entry (unique, unlike U+FFFD)."""
        text = _text(self.hf.decode([token_id], skip_special_tokens=False))
        if "\ufffd" in text:
            raw = self.hf.convert_ids_to_tokens(token_id)
            return raw if isinstance(raw, str) else text
        return text

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"message {i} has unknown role {m['role']!r}")
        text = _text(
            self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )
        # NOTE: the template already writes any BOS it wants.
        return self.encode(text, add_special_tokens=False)


def _text(value: object) -> str:
    """HF tokenizers return str for one sequence; their annotations allow lists too."""
    if not isinstance(value, str):
        raise TypeError(f"expected text from the tokenizer, got {type(value).__name__}")
    return value
