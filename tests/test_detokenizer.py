"""Incremental detokenization (no broken UTF-8) and stop strings across tokens."""

from __future__ import annotations

from laneserve.frontend.detokenizer import IncrementalDetokenizer
from laneserve.sampling_params import SamplingParams


class ByteTokenizer:
    """Token i is a fixed byte string; decoding joins bytes (invalid -> U+FFFD)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


EURO = "€".encode()  # 3 bytes
PIECES = [b"Hel", b"lo", b" wor", b"ld", EURO[:1], EURO[1:2], EURO[2:], b"!", b" #", b"##", b" end"]


def stream(
    ids: list[int], params: SamplingParams
) -> tuple[list[str], IncrementalDetokenizer, int | None]:
    d = IncrementalDetokenizer(ByteTokenizer(PIECES), [0], params)
    deltas, stopped_at = [], None
    for i, t in enumerate(ids):
        consumed = d.add_tokens([t])
        finished = consumed is not None or i == len(ids) - 1
        deltas.append(d.new_text(finished))
        if consumed is not None:
            stopped_at = i
            break
    return deltas, d, stopped_at


def test_multibyte_character_is_never_split() -> None:
    deltas, _, _ = stream([1, 2, 4, 5, 6, 7], SamplingParams())
    assert "".join(deltas) == "lo wor€!"
    assert all("\ufffd" not in x for x in deltas)
    assert deltas[2] == "" and deltas[3] == "" and deltas[4] == "€"


def test_stop_string_across_token_boundary_is_trimmed() -> None:
    # " #" + "##" makes " ###": the stop string "###" spans two tokens
    deltas, d, at = stream([1, 2, 8, 9, 10], SamplingParams(stop=["###"]))
    assert at == 3 and d.stop_reason == "###"
    assert "".join(deltas) == "lo wor "
    assert "#" not in "".join(deltas)  # the held-back "#" never leaked


def test_stop_string_included_on_request() -> None:
    deltas, _, _ = stream(
        [1, 2, 8, 9, 10], SamplingParams(stop=["###"], include_stop_str_in_output=True)
    )
    assert "".join(deltas) == "lo wor ###"


def test_no_stop_streams_everything() -> None:
    deltas, _, at = stream([1, 2, 3, 10], SamplingParams(stop=["zzz"]))
    assert at is None and "".join(deltas) == "lo world end"


def test_dangling_partial_character_is_flushed_at_the_end() -> None:
    deltas, _, _ = stream([1, 4], SamplingParams())
    assert "".join(deltas) == "lo\ufffd"
