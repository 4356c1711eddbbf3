"""The real bytes of each vocabulary entry, and its OpenAI-style display text.

Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM2) store each byte as a
printable stand-in character (`Ġ` for a space, `ðŁ` for the first two bytes of
an emoji); byte-fallback SentencePiece vocabularies store lone bytes as `<0xF0>`
and spaces as `▁`. A token's bytes are what clients join to rebuild a character
split over tokens (OpenAI's logprob `bytes`). Where a token's bytes are not valid
UTF-8 on their own, its display text is `bytes:` followed by `\\xHH` escapes, the
form OpenAI's API uses; otherwise it is the decoded text.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import cache

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's table (stand-in character -> byte), as GPT-2 defines it:
    printable Latin-1 bytes map to themselves, the others to 256 + n in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def decoder_kinds(hf: object) -> set[str]:
    """The `type`s in the fast tokenizer's decoder (nested Sequence included)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        spec = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    kinds: set[str] = set()
    stack = [spec]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            kinds.add(str(node.get("type")))
            stack.extend(node.get("decoders") or [])
    return kinds


class TokenBytes:
    """Bytes per token id, computed once per id."""

    def __init__(self, hf: object) -> None:
        self.hf = hf
        kinds = decoder_kinds(hf)
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds
        added = getattr(hf, "added_tokens_decoder", {}) or {}
        self.added = {int(i): str(t) for i, t in added.items()}
        self._cache: dict[int, bytes] = {}

    def of(self, token_id: int) -> bytes:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._compute(token_id)
        return got

    def _compute(self, token_id: int) -> bytes:
        if token_id in self.added:  # added tokens are stored as plain text
            return self.added[token_id].encode()
        piece = self.hf.convert_ids_to_tokens(token_id)  # type: ignore[attr-defined]
        if isinstance(piece, str):
            if self.byte_level:
                table = _byte_decoder()
                if all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
            elif self.byte_fallback:
                m = _BYTE_PIECE.fullmatch(piece)
                if m:
                    return bytes([int(m.group(1), 16)])
                return piece.replace("\u2581", " ").encode()
        text = self.hf.decode([token_id], skip_special_tokens=False)  # type: ignore[attr-defined]
        return str(text).encode()

    def text(self, token_id: int) -> str:
        return display_text(self.of(token_id))


def display_text(raw: bytes) -> str:
    """The token as text, or `bytes:\\xHH...` where it is not valid UTF-8 alone."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class CharOffsets:
    """Character offsets of consecutive tokens in the text they decode to: each
    token starts at the character its first byte belongs to (a token that
    continues a split character shares that character's offset)."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, raw: bytes) -> int:
        offset = self.chars
        pending = self._dec.getstate()[0]
        if pending and raw and not 0x80 <= raw[0] <= 0xBF:
            # NOTE: no continuation byte: the dangling bytes become U+FFFD before it
            offset += len(pending.decode(errors="replace"))
        self.chars += len(self._dec.decode(raw))
        return offset
