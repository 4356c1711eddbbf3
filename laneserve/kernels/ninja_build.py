"""Which `ninja` builds the kernels, what it is about to compile, and a line per source.

torch's `cpp_extension.load` runs the `ninja` it finds on PATH. Two ninja releases
keep incompatible build logs (1.11 and 1.13 hash commands differently), so alternating
between them (an activated `.venv`, then `scripts/run.sh` with `/usr/bin` first) would
recompile every object each time. The build therefore always runs the environment's
own ninja (the `ninja` package that laneserve depends on), whatever PATH says; where
that package is missing, PATH's ninja is used and its version joins the build key.

Right before torch runs ninja (once it has written the build file), a dry run of the
same file (`ninja -n -d explain`) says which objects are out of date and why, so every
compile is announced with its reason; while it runs, a watcher thread logs each object
as it is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_STEP = re.compile(r"^\[\d+/\d+\] .* -o (\S+)\s*$")
_EXPLAIN = "ninja explain: "


def environment_ninja_dir() -> str | None:
    """The folder of the environment's ninja (the pip package's), or None without it."""
    try:
        import ninja  # the pip package

        folder = str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        return None
    return folder if os.access(os.path.join(folder, "ninja"), os.X_OK) else None


def ninja_version(folder: str | None = None) -> str:
    """`ninja --version` of the ninja in `folder` (default: PATH's); "" if none runs."""
    exe = os.path.join(folder, "ninja") if folder else shutil.which("ninja")
    if exe is None:
        return ""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def key_entries() -> dict[str, str]:
    """What the build key needs to know about ninja: nothing while the environment's
    own ninja builds (it is tied to the environment, which the key covers already),
    else the version of PATH's ninja."""
    if environment_ninja_dir() is not None:
        return {}
    return {"ninja": ninja_version()}


@contextlib.contextmanager
def environment_ninja_first() -> Iterator[str | None]:
    """PATH with the environment's ninja first while the block runs (torch reads PATH);
    yields that folder, or None where PATH's ninja is used."""
    folder = environment_ninja_dir()
    if folder is None:
        yield None
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = folder + os.pathsep + (before or "")
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


@dataclass(frozen=True)
class Plan:
    """What ninja would run in a build directory: the objects (and the library) it
    would write, and its first explanation why."""

    outputs: tuple[str, ...]
    reason: str

    @property
    def sources(self) -> int:
        return sum(1 for o in self.outputs if o.endswith(".o"))


def dry_run(build_dir: Path) -> Plan | None:
    """Ask the ninja that will build what it would do; None where it cannot say (no
    build file yet, or ninja failed)."""
    if not (build_dir / "build.ninja").is_file():
        return None
    exe = shutil.which("ninja")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "-n", "-d", "explain"], cwd=build_dir, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    lines = (out.stdout + "\n" + out.stderr).splitlines()
    outputs = tuple(m.group(1) for m in map(_STEP.match, lines) if m)
    reasons = [ln.split(_EXPLAIN, 1)[1] for ln in lines if _EXPLAIN in ln]
    return Plan(outputs, reasons[0] if reasons else "")


class ObjectWatcher:
    """Logs each object file written in `build_dir` while a build runs (ninja's own
    output is held back by torch until the end)."""

    def __init__(self, build_dir: Path, total: int, period_s: float = 1.0) -> None:
        self._dir = build_dir
        self._total = total
        self._period = period_s
        self._start = time.time()
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kernel-build-watch", daemon=True)

    def __enter__(self) -> ObjectWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # the objects written since the last look

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.poll()

    def poll(self) -> None:
        for obj in sorted(self._dir.glob("*.o")):
            try:
                fresh = obj.stat().st_mtime >= self._start
            except OSError:
                continue
            if fresh and obj.name not in self._seen:
                self._seen.add(obj.name)
                logger.info(
                    "compiled %s (%d of %d, %.0f s so far)",
                    obj.stem,
                    len(self._seen),
                    self._total,
                    time.time() - self._start,
                )


@contextlib.contextmanager
def announced_builds(announce: Callable[[Path, Plan | None], int]) -> Iterator[None]:
    """While the block runs, each ninja run of torch's `cpp_extension` is preceded by a
    dry run of the same build file, given to `announce` (which logs it and returns how
    many objects to expect), and watched object by object.

    NOTE: torch writes the build file and runs ninja inside one private function, and a
    dry run before `load` would read the previous build file (another compiler or
    include path in the new one would go unnoticed), so its `_run_ninja_build` is
    wrapped for the duration of the block (the caller holds the build lock).
    """
    from torch.utils import cpp_extension

    original = getattr(cpp_extension, "_run_ninja_build", None)
    if original is None:  # another torch: builds are still logged when they end
        yield
        return

    def run(build_directory: str, *args: object, **kwargs: object) -> None:
        folder = Path(build_directory)
        total = announce(folder, dry_run(folder))
        watch = ObjectWatcher(folder, total) if total else contextlib.nullcontext()
        with watch:
            original(build_directory, *args, **kwargs)

    cpp_extension._run_ninja_build = run
    try:
        yield
    finally:
        cpp_extension._run_ninja_build = original
