"""docs/architecture.md's file map ("The layout") names every module under laneserve/
and nothing that is not there: a new, moved or removed file fails here until the map
says so."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "laneserve"
_NAME = re.compile(r"[\w.-]+/?")
_FILE_SUFFIXES = (".py", ".cpp", ".h")


def map_entries(text: str) -> set[str]:
    """Paths named in the layout block, relative to laneserve/ ("core/request.py").

    A line starts with one or more names (a folder ends with "/"), then two spaces and
    what they are; a folder's entries are indented below it. Lines whose first column
    is not all names continue the description above them."""
    block = text.split("## The layout", 1)[1].split("```", 2)[1]
    entries: set[str] = set()
    folders: list[tuple[int, str]] = []  # (indent, path) of the open folders
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0].split(" ")
        if not all(
            _NAME.fullmatch(n) and (n.endswith("/") or n.endswith(_FILE_SUFFIXES)) for n in names
        ):
            continue
        while folders and folders[-1][0] >= indent:
            folders.pop()
        prefix = folders[-1][1] if folders else ""
        for name in names:
            if name.endswith("/"):
                folders.append((indent, prefix + name))
                entries.add(prefix + name)
            else:
                entries.add(prefix + name)
    inside = {e for e in entries if e.startswith("laneserve/") and e != "laneserve/"}
    return {e.removeprefix("laneserve/") for e in inside}


def package_files() -> set[str]:
    """Every module and kernel source under laneserve/ (package __init__ files aside)."""
    return {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*")
        if p.suffix in _FILE_SUFFIXES and p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def test_the_file_map_names_every_module() -> None:
    named = map_entries((ROOT / "docs" / "architecture.md").read_text())
    files = package_files()
    missing = sorted(files - named)
    assert not missing, f"docs/architecture.md's layout does not name: {missing}"
    ghosts = sorted(e for e in named if not (PACKAGE / e).exists())
    assert not ghosts, f"docs/architecture.md's layout names files that do not exist: {ghosts}"


def test_the_map_parser_reads_folders_and_continuations() -> None:
    text = """## The layout

```
laneserve/
  top.py             a module
  sub/
    a.py b.cpp       two files on one line
                     a continuation naming x.py in passing
    deeper/
      c.h            a header
  after.py           back at the top
tests/               not the package
```
"""
    assert map_entries(text) == {
        "top.py",
        "sub/",
        "sub/a.py",
        "sub/b.cpp",
        "sub/deeper/",
        "sub/deeper/c.h",
        "after.py",
    }
