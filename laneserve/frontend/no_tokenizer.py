"""The stand-in for the tokenizer under `skip_tokenizer_init` (vLLM's option): prompts
arrive as token ids, outputs leave as token ids with empty text, and whatever needs
the tokenizer (text prompts, chat, stop strings) is refused with a clear error."""

from __future__ import annotations

WHY = "skip_tokenizer_init is set: there is no tokenizer"


class NoTokenizer:
    eos_token_id: int | None = None
    chat_template: str | None = None
    chat_format: str | None = None
    has_chat_template = False

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.all_special_ids: set[int] = set()

    @property
    def hf(self) -> object:
        raise ValueError(f"{WHY} to return")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(f"{WHY}: send prompts as token ids (prompt_token_ids)")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""  # outputs are the token ids

    def token_text(self, token_id: int) -> str:
        """A logprob entry's token, named by its id (vLLM's `token_id:N` form)."""
        return f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> bytes:
        """No vocabulary, so no real bytes: those of the `token_id:N` name."""
        return self.token_text(token_id).encode()

    def apply_chat_template(self, messages: list[dict], *args: object, **kw: object) -> list[int]:
        raise ValueError(f"{WHY}: chat needs one; send token ids to the completions API")
