"""Token bytes: each token's real bytes (byte-level BPE stand-ins decoded), their
OpenAI display text, and character offsets, checked against the tokenizer's own
decoding of every prefix (tiny byte-level BPE, and SmolLM2's when installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from laneserve.frontend.token_bytes import CharOffsets, TokenBytes, display_text

TEXTS = [
    "Stars: 🌟🌟",
    "Zürich, São Paulo and Kraków — naïve café déjà vu",
    "東京は日本の首都です。 你好，世界",
    "mixed 🙂 ñ 東 e\u0301 👩\u200d👩\u200d👧",
]


def check_tokenizer(hf) -> None:
    tb = TokenBytes(hf)
    assert tb.byte_level
    split = 0
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        raw = [tb.of(i) for i in ids]
        assert b"".join(raw) == text.encode()
        for k in range(1, len(ids) + 1):  # the tokenizer's own decoding of each prefix
            assert b"".join(raw[:k]).decode(errors="replace") == hf.decode(ids[:k])
        offsets = CharOffsets()
        for i, r in zip(ids, raw, strict=True):
            start = offsets.feed(r)
            assert 0 <= start <= len(text)
            shown = display_text(r)
            if shown.startswith("bytes:"):
                split += 1
                assert shown == "bytes:" + "".join(f"\\x{b:02x}" for b in r)
            else:
                assert text[start : start + len(shown)] == shown == hf.decode([i])
        assert offsets.chars == len(text)
    assert split > 0  # some character was split over tokens (the case that matters)


def test_tiny_byte_level_tokenizer(tiny_models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    check_tokenizer(AutoTokenizer.from_pretrained(str(tiny_models["llama"])))


def test_special_tokens_are_their_text(tiny_models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_models["llama"]))
    tb = TokenBytes(hf)
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    assert tb.of(eos) == b"<|im_end|>" and tb.text(eos) == "<|im_end|>"


def test_display_text_and_offsets() -> None:
    assert display_text("é".encode()) == "é"
    assert display_text(b"\xf0\x9f") == "bytes:\\xf0\\x9f"
    off = CharOffsets(3)
    assert [off.feed(b) for b in (b"a", b"\xf0\x9f", b"\x8c\x9f", b"b")] == [3, 4, 4, 5]
    assert off.chars == 6
    # a lead byte with no continuation: U+FFFD, then the next token's character
    off = CharOffsets()
    assert [off.feed(b) for b in (b"\xf0", b"?", b"x")] == [0, 1, 2]
    assert off.chars == 3 == len(b"\xf0?x".decode(errors="replace"))


@pytest.mark.slow
def test_smollm2_tokenizer() -> None:
    """The default model's tokenizer (byte-level BPE), read from its GGUF."""
    from transformers import AutoTokenizer

    from laneserve.model.loader import default_model_path

    path = default_model_path()
    check_tokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))


def test_byte_table_is_gpt2s() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from laneserve.frontend.token_bytes import _byte_decoder

    assert _byte_decoder() == {c: b for b, c in bytes_to_unicode().items()}
