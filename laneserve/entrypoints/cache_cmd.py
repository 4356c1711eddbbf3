"""`laneserve cache info | clear`: what the cache holds, and removing it."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from laneserve.paths import cache_root

KINDS = {"gguf": "converted GGUF models", "torch_extensions": "built CPU kernels"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache",
        help=f"show or clear the cache ({cache_root()}; set LANESERVE_CACHE_DIR to move it)",
    )
    verbs = p.add_subparsers(dest="cache_command", metavar="VERB")
    verbs.required = True
    info = verbs.add_parser("info", help="list the cache's entries and their sizes")
    info.set_defaults(func=run_info)
    clear = verbs.add_parser("clear", help="delete cache entries (they are rebuilt when needed)")
    clear.add_argument(
        "kind", nargs="?", choices=sorted(KINDS), help="only this kind (default: everything)"
    )
    clear.set_defaults(func=run_clear)


def entries(root: Path) -> list[tuple[str, Path, int]]:
    """(kind, entry folder, bytes) for every entry under the cache root."""
    found = []
    for kind in KINDS:
        folder = root / kind
        if folder.is_dir():
            found += [(kind, e, _size(e)) for e in sorted(folder.iterdir())]
    return found


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def run_info(ns: argparse.Namespace) -> int:
    root = cache_root()
    found = entries(root)
    print(f"cache: {root}")
    for kind, path, size in found:
        print(f"  {_human(size):>10}  {KINDS[kind]}: {path.name}")
    print(f"  {_human(sum(s for _, _, s in found)):>10}  in all ({len(found)} entries)")
    return 0


def run_clear(ns: argparse.Namespace) -> int:
    root = cache_root()
    removed = 0
    for kind, path, size in entries(root):
        if ns.kind in (None, kind):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed += size
    print(f"removed {_human(removed)} from {root}")
    return 0
