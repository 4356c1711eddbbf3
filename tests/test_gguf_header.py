"""The GGUF header reader (the limit check before a load) against the `gguf` package's
own writer and reader, and on the embedded published GGUF."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from laneserve.model.gguf_header import GgufHeaderError, read_scalars
from laneserve.model.limits import context_limit
from laneserve.model.loader import default_model_path


def _write(path: Path) -> Path:
    """Arrays of every shape before and between the scalars: each must be skipped."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list([f"tok{i}" for i in range(300)] + ["", "é"])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_context_length(4096)
    w.add_block_count(2)
    w.add_name("tiny")
    w.add_float32("test.f32", 0.25)
    w.add_float64("test.f64", -2.5)
    w.add_bool("test.flag", True)
    w.add_int8("test.i8", -3)
    w.add_uint64("test.u64", 2**40)
    w.add_int64("test.i64", -(2**40))
    w.add_uint16("test.u16", 7)
    w.add_tensor("w", np.zeros((2, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_scalars_equal_the_gguf_reader(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.gguf")
    fields = gguf.GGUFReader(str(path)).fields
    want = {
        k: f.contents()
        for k, f in fields.items()
        if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY
    }
    got = read_scalars(path)
    assert got == want and got["llama.context_length"] == 4096 and got["test.flag"] is True
    assert "tokenizer.ggml.tokens" not in got and "test.nested" not in got
    assert context_limit(str(path)) == 4096


def test_the_embedded_gguf(tmp_path: Path) -> None:
    got = read_scalars(default_model_path())
    assert got["general.architecture"] == "llama" and got["llama.context_length"] == 8192
    assert got["llama.block_count"] == 30 and got["llama.embedding_length"] == 576


def test_bad_headers_are_errors_and_no_limit(tmp_path: Path) -> None:
    good = _write(tmp_path / "t.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[:200])  # inside the token list
    with pytest.raises(GgufHeaderError, match="ends early"):
        read_scalars(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + good[4:])
    with pytest.raises(GgufHeaderError, match="magic"):
        read_scalars(bad)
    old = tmp_path / "v1.gguf"
    old.write_bytes(good[:4] + (1).to_bytes(4, "little") + good[8:])
    with pytest.raises(GgufHeaderError, match="version 1"):
        read_scalars(old)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    for path in (cut, bad, old, empty):
        assert context_limit(str(path)) is None  # the loader reports what is wrong
