"""The cache: content-addressed GGUF conversion keys, stale partial conversions,
and `laneserve cache info | clear`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from laneserve.entrypoints.cli import main
from laneserve.model.gguf import content_key, remove_stale_partials


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_content_key_ignores_name_and_mtime_but_not_content(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    a = _file(tmp_path / "a.gguf", data)
    b = _file(tmp_path / "b.gguf", data)
    os.utime(b, (1, 1))  # a reinstall gives a new mtime
    assert content_key(a) == content_key(b)
    changed = bytearray(data)
    changed[len(data) // 2] ^= 0xFF  # one byte in the middle (a sampled region)
    assert content_key(_file(tmp_path / "c.gguf", bytes(changed))) != content_key(a)
    assert content_key(_file(tmp_path / "d.gguf", data + b"x")) != content_key(a)


def test_stale_partial_conversions_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True).stdout.strip()  # fmt: skip
    stale = tmp_path / f"model-abc-bfloat16-v1.tmp{dead}"
    live = tmp_path / f"model-abc-bfloat16-v1.tmp{os.getpid()}"
    done = tmp_path / "model-abc-bfloat16-v1"
    for d in (stale, live, done):
        d.mkdir()
    assert remove_stale_partials(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and done.exists()


def test_cache_info_and_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("LANESERVE_CACHE_DIR", str(tmp_path))
    (tmp_path / "gguf" / "m-1").mkdir(parents=True)
    (tmp_path / "gguf" / "m-1" / "model.safetensors").write_bytes(b"x" * 2048)
    (tmp_path / "torch_extensions" / "k-1").mkdir(parents=True)
    (tmp_path / "torch_extensions" / "k-1" / "lib.so").write_bytes(b"y" * 100)
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "converted GGUF models: m-1" in out and "2.0 KiB" in out
    assert "built CPU kernels: k-1" in out and "2 entries" in out
    assert main(["cache", "clear", "gguf"]) == 0
    assert not (tmp_path / "gguf" / "m-1").exists()
    assert (tmp_path / "torch_extensions" / "k-1").exists()
    assert main(["cache", "clear"]) == 0
    assert not (tmp_path / "torch_extensions" / "k-1").exists()
