"""Kernel selection, the JIT build (fallbacks, build key, cache directory) and
concurrent builds."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from laneserve.kernels import TorchKernels, get_kernels, load_kernels, ninja_build
from laneserve.kernels import build as kbuild


def test_get_kernels_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(get_kernels(torch.device("meta")), TorchKernels)
    assert isinstance(get_kernels(torch.device("cpu"), enable=False), TorchKernels)
    monkeypatch.setenv(kbuild.DISABLE_ENV, "1")
    assert load_kernels() is None
    assert isinstance(get_kernels(torch.device("cpu")), TorchKernels)


def test_build_failure_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(name: str, build_dir: Path) -> str:
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(kbuild, "_compile", broken)
    with caplog.at_level("WARNING", logger=kbuild.__name__):
        # __wrapped__: bypass the per-process cache of successful loads.
        assert kbuild._build_and_load.__wrapped__("laneserve_cpu_test", str(tmp_path)) is None
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "compiler exploded" in warnings[0].getMessage()


def test_unsupported_cpu_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kbuild, "cpu_supported", lambda: False)
    assert load_kernels() is None
    assert isinstance(get_kernels(torch.device("cpu")), TorchKernels)


def test_build_key_covers_every_source_and_header(tmp_path: Path) -> None:
    """The build directory is keyed by every .cpp and .h beside build.py, by name and
    text: an edit to any file, a moved line or other flags pick a new directory; the
    same files elsewhere (an installed copy) or listed in another order share one."""
    on_disk = sorted(p.name for p in kbuild.KERNEL_DIR.iterdir() if p.suffix in (".cpp", ".h"))
    files = kbuild.read_sources()
    assert sorted(files) == on_disk
    name = kbuild.extension_name(files)
    for file in on_disk:
        (tmp_path / file).write_bytes((kbuild.KERNEL_DIR / file).read_bytes())
    assert kbuild.extension_name(kbuild.read_sources(tmp_path)) == name
    assert kbuild.extension_name(dict(reversed(files.items()))) == name
    for file, text in files.items():
        assert kbuild.extension_name({**files, file: text + "\n// edit"}) != name, file
    first, second = sorted(files)[:2]  # the first line of one file moved to the end of another
    head, rest = files[second].split("\n", 1)
    moved = {**files, first: files[first] + head + "\n", second: rest}
    assert kbuild.extension_name(moved) != name
    assert kbuild.extension_name({**files, "extra.h": ""}) != name


def test_compile_builds_every_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One extension from all the .cpp files, with the flags that the key hashes."""
    from torch.utils import cpp_extension

    seen: dict = {}
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: seen.update(kwargs) or "lib.so")
    assert kbuild._compile("laneserve_cpu_test", tmp_path) == "lib.so"
    compiled = sorted(Path(s).name for s in seen["sources"])
    assert compiled == sorted(p.name for p in kbuild.KERNEL_DIR.glob("*.cpp"))
    assert seen["extra_cflags"] == list(kbuild.CFLAGS)
    assert seen["build_directory"] == str(tmp_path)


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(kbuild.CACHE_ENV, str(tmp_path))
    assert kbuild.cache_root() == tmp_path / "torch_extensions"


_BUILD_SNIPPET = """
import torch
from laneserve.kernels import get_kernels, CpuKernels
k = get_kernels(torch.device("cpu"))
assert isinstance(k, CpuKernels), k
print(k.linear(torch.ones(1, 8), k.pack_linear_weight(torch.ones(3, 8))).sum().item())
"""


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("LANESERVE_SLOW_TESTS") != "1", reason="cold builds: set LANESERVE_SLOW_TESTS=1"
)
def test_concurrent_cold_builds(tmp_path: Path) -> None:
    """Two processes building into an empty cache at once both end up with the kernels."""
    env = dict(os.environ, **{kbuild.CACHE_ENV: str(tmp_path)})
    env.pop(kbuild.DISABLE_ENV, None)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUILD_SNIPPET], env=env, stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["24.0", "24.0"]


# Cheap stand-ins for the cold build above, run everywhere: the same loader and lock code
# in real processes, with the compiler replaced by a file write.

_RACE_SNIPPET = r"""
import os, sys, time
from pathlib import Path
from laneserve.kernels import build as kbuild
from laneserve.kernels import ninja_build

build_dir, log_path, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]


def log(event):
    with open(log_path, "a") as f:  # O_APPEND: each line lands whole
        f.write(f"{event} {os.getpid()}\n")


def other_queued():
    # /proc/locks marks a process blocked on a lock with "->"
    ino = os.stat(build_dir / "laneserve.flock").st_ino
    return any("->" in ln.split() and ln.split()[-3].endswith(f":{ino}") for ln in open("/proc/locks"))


def other_entered():  # the lock let the other loader in too (the test then fails)
    return any(ln.startswith("enter") and ln.split()[1] != str(os.getpid()) for ln in open(log_path))


def fake_compile(name, path):
    library = path / f"{name}.so"
    log("enter")
    if library.exists():
        log("reuse")
    else:
        deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
        while not (other_queued() or other_entered()):  # hold the build until the other waits
            if time.monotonic() > deadline:
                log("alone")
                break
            time.sleep(0.01)
        library.write_bytes(b"")
        log("build")
    log("leave")
    return str(library)


kbuild._compile = fake_compile
kbuild.OPS = kbuild.INTERNAL_OPS = ()  # nothing is really loaded
log("start")
print("ok" if kbuild._build_and_load.__wrapped__(name, str(build_dir)) is not None else "none")
"""


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, **kwargs
    )


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux /proc/locks")
def test_concurrent_loaders_build_once(tmp_path: Path) -> None:
    """Two processes loading into the same empty build directory: the first builds while
    the second waits on the lock, then the second finds the library and reuses it."""
    build_dir, log = tmp_path / "build", tmp_path / "events.log"
    procs = [_python(_RACE_SNIPPET, str(build_dir), str(log), "laneserve_cpu_race") for _ in "ab"]
    outs = [p.communicate(timeout=600)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs == ["ok", "ok"]
    events = [line.split() for line in log.read_text().splitlines() if not line.startswith("start")]
    first, second = events[0][1], events[3][1]
    assert first != second
    want = [["enter", first], ["build", first], ["leave", first]]
    want += [["enter", second], ["reuse", second], ["leave", second]]
    assert events == want


_HOLD_SNIPPET = r"""
import sys, time
from pathlib import Path
from laneserve.kernels import build as kbuild
from laneserve.kernels import ninja_build

build_dir = Path(sys.argv[1])
with kbuild._build_lock(build_dir):
    (build_dir / "lock").write_text("")  # torch's build baton, as a compile leaves it
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_killed_build_does_not_block_the_next(tmp_path: Path) -> None:
    """A build killed while holding the lock leaves torch's baton file behind: the next
    loader still gets the lock (the kernel drops a dead holder's flock) and clears it."""
    holder = _python(_HOLD_SNIPPET, str(tmp_path))
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
    holder.kill()
    holder.wait(timeout=60)
    assert (tmp_path / "lock").exists()
    acquired = threading.Event()

    def acquire() -> None:
        with kbuild._build_lock(tmp_path):
            acquired.set()

    threading.Thread(target=acquire, daemon=True).start()
    assert acquired.wait(timeout=300), "the lock of a killed build was never released"
    assert not (tmp_path / "lock").exists()


def test_build_key_covers_the_python_environment() -> None:
    """Two checkouts or virtual environments (another sources folder, prefix or include
    paths) never share a build directory: torch's build files record those paths, so a
    shared one would be rebuilt by each in turn."""
    files = kbuild.read_sources()
    env = kbuild.build_environment()
    assert env["prefix"] == sys.prefix
    name = kbuild.extension_name(files)
    assert kbuild.extension_name(files, env) == name
    for key in env:
        assert kbuild.extension_name(files, {**env, key: env[key] + "-other"}) != name, key


def _fake_build(folder: Path, info: dict[str, str]) -> None:
    folder.mkdir(parents=True)
    (folder / kbuild.BUILD_INFO).write_text(__import__("json").dumps(info))


def test_build_reason_names_what_changed(tmp_path: Path) -> None:
    new = tmp_path / "laneserve_cpu_new"
    assert kbuild.build_reason(new) == "first build on this machine"
    now = kbuild._build_info()
    _fake_build(tmp_path / "laneserve_cpu_a", {**now, "prefix": "/elsewhere/.venv"})
    assert kbuild.build_reason(new) == f"another Python environment ({sys.prefix})"
    _fake_build(tmp_path / "laneserve_cpu_d", {**now, "sources_dir": "/elsewhere/kernels"})
    os.utime(tmp_path / "laneserve_cpu_d" / kbuild.BUILD_INFO, (1.9e9, 1.9e9))
    assert kbuild.build_reason(new) == f"another checkout ({kbuild.KERNEL_DIR})"
    _fake_build(tmp_path / "laneserve_cpu_b", {**now, "sources": "0" * 16})
    os.utime(tmp_path / "laneserve_cpu_b" / kbuild.BUILD_INFO, (2e9, 2e9))  # the newest
    assert kbuild.build_reason(new) == "the kernel sources changed"
    _fake_build(tmp_path / "laneserve_cpu_c", {**now, "flags": "-O0"})
    os.utime(tmp_path / "laneserve_cpu_c" / kbuild.BUILD_INFO, (2.1e9, 2.1e9))
    assert kbuild.build_reason(new) == "changed: flags"


# The real loader (key, build directory, ninja choice, log lines) on a one-file
# extension, so that no test recompiles the kernels themselves.

_TINY = 'extern "C" int laneserve_tiny() {{ return {}; }}\n'


class TinyKernels:
    """`build.py` pointed at a one-file extension in `root`, with the compiler wrapped
    by a script that counts its runs."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from torch.utils import cpp_extension

        self.src = root / "src"
        self.src.mkdir()
        (self.src / "tiny.cpp").write_text(_TINY.format(1))
        self.calls = root / "compiler-calls.log"
        self.monkeypatch = monkeypatch
        self.cpp_extension = cpp_extension
        for attr, value in {
            "KERNEL_DIR": self.src,
            "SOURCES": (self.src / "tiny.cpp",),
            "HEADERS": (),
            "CFLAGS": ("-O0",),
            "LDFLAGS": (),
            "OPS": (),
            "INTERNAL_OPS": (),
        }.items():
            monkeypatch.setattr(kbuild, attr, value)
        monkeypatch.setenv(kbuild.CACHE_ENV, str(root / "cache"))
        self.use_compiler(root / "cxx")

    def use_compiler(self, wrapper: Path) -> None:
        wrapper.write_text(f'#!/bin/sh\necho "$*" >> {self.calls}\nexec c++ "$@"\n')
        wrapper.chmod(0o755)
        self.monkeypatch.setenv("CXX", str(wrapper))

    def compiles(self) -> int:
        """Compiler runs that compiled a source (the link runs it too, without -c)."""
        if not self.calls.exists():
            return 0
        return sum(" -c " in f" {line} " for line in self.calls.read_text().splitlines())

    def load(self) -> kbuild.KernelLib | None:
        """What `load_kernels` does, as a fresh process would (torch remembers what it
        built in this process and would not even run ninja again)."""
        from torch.utils.cpp_extension import ExtensionVersioner

        self.monkeypatch.setattr(
            self.cpp_extension, "JIT_EXTENSION_VERSIONER", ExtensionVersioner()
        )
        name = kbuild.extension_name(kbuild.read_sources(self.src))
        return kbuild._build_and_load.__wrapped__(name, str(kbuild.cache_root() / name))


def _path_with_ninja(first: str) -> str:
    return os.pathsep.join([first, "/usr/bin", "/bin"])


_ENV_NINJA = ninja_build.environment_ninja_dir()
_SYSTEM_NINJA = "/usr/bin/ninja"


@pytest.mark.skipif(
    _ENV_NINJA is None
    or not os.access(_SYSTEM_NINJA, os.X_OK)
    or ninja_build.ninja_version(_ENV_NINJA) == ninja_build.ninja_version("/usr/bin"),
    reason="needs the environment's ninja and another version in /usr/bin",
)
def test_another_ninja_on_path_rebuilds_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An activated environment (its ninja first on PATH) and a plain shell (/usr/bin's
    first) take turns: one compile in all, the same build key, no build announced after
    the first (two ninja releases would otherwise each rebuild the other's objects)."""
    assert _ENV_NINJA is not None
    tiny = TinyKernels(tmp_path, monkeypatch)
    names = []
    with caplog.at_level("INFO", logger="laneserve.kernels"):
        for first in ("/usr/bin", _ENV_NINJA, "/usr/bin", _ENV_NINJA):
            monkeypatch.setenv("PATH", _path_with_ninja(first))
            assert tiny.load() is not None
            names.append(kbuild.extension_name(kbuild.read_sources(tiny.src)))
    assert tiny.compiles() == 1
    assert len(set(names)) == 1
    announced = [r.getMessage() for r in caplog.records if "building CPU kernels" in r.getMessage()]
    assert len(announced) == 1 and "first build on this machine" in announced[0]
    assert not [r for r in caplog.records if "out of date" in r.getMessage()]


def test_without_the_environments_ninja_its_version_keys_the_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where the ninja package is missing, PATH's ninja builds, and its version is part
    of the key: another ninja on PATH builds into a directory of its own."""
    fake = {}
    for version in ("1.11.1", "1.13.2"):
        folder = tmp_path / version
        folder.mkdir()
        (folder / "ninja").write_text(f"#!/bin/sh\necho {version}\n")
        (folder / "ninja").chmod(0o755)
        fake[version] = str(folder)
    files = kbuild.read_sources()
    monkeypatch.setenv("PATH", fake["1.11.1"])
    with_env_ninja = kbuild.extension_name(files)
    assert "ninja" not in kbuild.build_environment()  # the environment's ninja: no entry
    monkeypatch.setattr(ninja_build, "environment_ninja_dir", lambda: None)
    keys = {}
    for version, folder in fake.items():
        monkeypatch.setenv("PATH", folder)
        assert kbuild.build_environment()["ninja"] == version
        keys[version] = kbuild.extension_name(files)
    assert len({with_env_ninja, *keys.values()}) == 3


def test_every_compile_is_announced_with_its_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An edited source gets a new build directory, announced as such; another compiler
    in the same directory (ninja sees a changed command) is announced with ninja's
    reason; each object is logged when written, and the build's time is recorded for the
    next estimate."""
    tiny = TinyKernels(tmp_path, monkeypatch)
    assert tiny.load() is not None
    (tiny.src / "tiny.cpp").write_text(_TINY.format(2))
    caplog.clear()
    with caplog.at_level("INFO", logger="laneserve.kernels"):
        assert tiny.load() is not None
    assert tiny.compiles() == 2
    messages = [r.getMessage() for r in caplog.records]
    building = [m for m in messages if "building CPU kernels" in m]
    assert len(building) == 1 and "the kernel sources changed" in building[0], messages
    assert "about" in building[0] and "by the last build here" in building[0]
    assert any(m.startswith("compiled tiny (1 of 1") for m in messages), messages
    assert any(m.startswith("built CPU kernels in") for m in messages), messages

    tiny.use_compiler(tmp_path / "other-cxx")
    caplog.clear()
    with caplog.at_level("INFO", logger="laneserve.kernels"):
        assert tiny.load() is not None
    assert tiny.compiles() == 3
    messages = [r.getMessage() for r in caplog.records]
    stale = [m for m in messages if "out of date" in m]
    assert len(stale) == 1 and "compiling 1 of 1 sources" in stale[0], messages
    assert "command line changed for tiny.o" in stale[0]
    assert any(m.startswith("compiled tiny (1 of 1") for m in messages), messages
