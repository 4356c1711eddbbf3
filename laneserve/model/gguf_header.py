"""A GGUF file's scalar metadata, read from its header without parsing the arrays.

`gguf.GGUFReader` builds every field, the tokenizer's ~10^5 strings included, which
takes seconds; a limit check before the load needs two numbers. The layout (all little
endian): magic "GGUF", version u32, tensor count u64, key/value count u64, then per pair
a string key (u64 length + bytes), a u32 value type and the value; an array is an element
type u32, a count u64 and the elements. Arrays are skipped, scalars and strings kept.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)  # version 1 counted in u32; no file of it is still published


class GgufHeaderError(ValueError):
    """The bytes are not a GGUF header this reader knows."""


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GgufHeaderError("the header ends early")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = int(self.take("<Q"))
        if self.pos + n > len(self.buf):
            raise GgufHeaderError("the header ends early")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip(self, kind: int, count: int = 1) -> None:
        if kind == _STRING:
            for _ in range(count):
                n = int(self.take("<Q"))  # NOTE: read before adding: take moves pos
                self.pos += n
        elif kind == _ARRAY:
            for _ in range(count):
                inner, n = int(self.take("<I")), int(self.take("<Q"))
                self.skip(inner, n)
        elif kind in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[kind]) * count
        else:
            raise GgufHeaderError(f"unknown value type {kind}")

    def value(self, kind: int) -> int | float | bool | str | None:
        """A scalar or a string; None for an array (skipped)."""
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        self.skip(kind)
        return None


def read_scalars(path: Path) -> dict[str, int | float | bool | str]:
    """Every scalar and string field of the header, by key (arrays left out)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        if buf[:4] != b"GGUF":
            raise GgufHeaderError("not a GGUF file (no GGUF magic)")
        cur.pos = 4
        version = cur.take("<I")
        if version not in _VERSIONS:
            raise GgufHeaderError(f"GGUF version {version} is not read here")
        cur.take("<Q")  # tensor count
        out: dict[str, int | float | bool | str] = {}
        for _ in range(int(cur.take("<Q"))):
            key = cur.string()
            value = cur.value(int(cur.take("<I")))
            if value is not None:
                out[key] = value
        return out
