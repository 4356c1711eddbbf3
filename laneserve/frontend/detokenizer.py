"""Incremental detokenization and stop strings (OpenAI semantics).

Text is emitted only when the decoded window does not end in a partial UTF-8
character (U+FFFD), so a streamed delta is never broken. Decoding works on a
small sliding window (prefix_offset..end) seeded with the last prompt tokens,
so leading-space rules of the tokenizer come out as in a full decode.

Stop strings: the first match in the output text ends the request; the text is
cut before the match (or after it with include_stop_str_in_output). While a
stop string could still be forming, its possible prefix is held back from
streaming.
"""

from __future__ import annotations

from laneserve.frontend.no_tokenizer import NoTokenizer
from laneserve.frontend.tokenizer import Tokenizer
from laneserve.sampling_params import SamplingParams

_SEED_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer | NoTokenizer, prompt_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = list(prompt_ids[-_SEED_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # full output text so far
        self.sent = 0  # characters of self.text already handed out
        self.stop_reason: str | None = None

    def add_tokens(self, token_ids: list[int]) -> int | None:
        """Append tokens. If a stop string completes, stop there and return how
        many of `token_ids` were consumed (the rest are not part of the output)."""
        for i, token in enumerate(token_ids):
            self.ids.append(token)
            old_len = len(self.text)
            self._decode_step()
            if self.stop and len(self.text) > old_len and self._check_stop(old_len):
                return i + 1
        return None

    def flush(self) -> None:
        """At the end: whatever is left undecoded (a dangling partial character)."""
        if self.stop_reason is not None or self.read_offset == len(self.ids):
            return
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = decode(self.ids[self.prefix_offset :], self.skip_special)
        self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.ids)

    def new_text(self, finished: bool) -> str:
        """The text not handed out yet (minus a possible stop prefix unless finished)."""
        if finished:
            self.flush()
        end = (
            len(self.text)
            if finished or self.stop_reason
            else max(self.sent, len(self.text) - self.hold)
        )
        if not self.stop:
            end = len(self.text)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta

    def _decode_step(self) -> None:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = decode(self.ids[self.prefix_offset :], self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def _check_stop(self, old_len: int) -> bool:
        # NOTE: a new match must end inside the new delta, so it starts at most
        # len(stop) - 1 characters before it.
        start = max(0, old_len - self.hold)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.sent = min(self.sent, len(self.text))
        self.stop_reason = s
        return True
