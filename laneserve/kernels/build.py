"""JIT build and load of the laneserve CPU kernels (the C++ sources beside this file).

The sources (one per op family, see :data:`SOURCES`) are compiled as one extension with
``torch.utils.cpp_extension.load`` (ninja) into ``$LANESERVE_CACHE_DIR/torch_extensions``
(default ``~/.cache/laneserve/torch_extensions``) under a name that embeds a hash of every
source and header and of the flags, so an edited file gets a fresh build directory and an
unchanged set is only re-linked-checked by ninja (~0.1 s).

Ops are registered with ``TORCH_LIBRARY(laneserve, ...)`` and reached as
``torch.ops.laneserve.<name>``; :func:`load_kernels` returns a :class:`KernelLib` handle
holding them, or ``None`` when the kernels cannot be used on this machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from laneserve import paths
from laneserve.kernels import ninja_build

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent
# Translation units of the extension, one per op family; bindings.cpp registers the ops.
SOURCES = tuple(
    KERNEL_DIR / name
    for name in (
        "linear.cpp",
        "linear_amx.cpp",
        "linear_dpbf16.cpp",
        "quant_linear.cpp",
        "quant_linear_avx2.cpp",
        "quant_linear_q8.cpp",
        "scaled_linear.cpp",
        "scaled_linear_avx512.cpp",
        "elementwise.cpp",
        "hyper.cpp",
        "attention.cpp",
        "causal_attention.cpp",
        "kv_cache.cpp",
        "spec_ops.cpp",
        "bindings.cpp",
    )
)
# Headers the sources include: part of the build key (ninja tracks them too, but the key
# picks the build directory, and a stale directory must never be reused).
HEADERS = tuple(
    KERNEL_DIR / name
    for name in (
        "vec.h",
        "vec512.h",
        "ops.h",
        "attention_tile.h",
        "linear_prefill.h",
        "quant_tiles.h",
        "scaled_tiles.h",
    )
)
DISABLE_ENV = "LANESERVE_DISABLE_KERNELS"
CACHE_ENV = "LANESERVE_CACHE_DIR"
ISA_ENV = "LANESERVE_KERNEL_ISA"
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
AVX512_CPU_FLAGS = frozenset({"avx512f", "avx512bw"})
ISAS = ("avx2", "avx512")
AMX_ENV = "LANESERVE_KERNEL_AMX"  # "0": prefill rows use the decode kernel even with AMX
AMX_CPU_FLAGS = frozenset({"amx_tile", "amx_bf16"})
DPBF16_ENV = "LANESERVE_KERNEL_DPBF16"  # "0" / "1": AVX-512 BF16 prompt-row path off / on
# where the vdpbf16ps path measured faster than the fp32 chain (AMD Zen 4: 1.5-1.9x from
# M = 128); on an Intel Xeon without AMX it measured 0.54-0.67x (docs/kernels.md)
DPBF16_FAST_VENDORS = frozenset({"AuthenticAMD"})
DPBF16_CPU_FLAG = "avx512_bf16"
VNNI_CPU_FLAG = "avx512_vnni"  # quant_linear_q8: GGUF weights with int8 activations
VBMI_CPU_FLAG = "avx512vbmi"  # scaled_linear: fp8 decoded by byte permutes
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")

# NOTE: -ffp-contract=off: the kernels place every FMA explicitly; letting the compiler
# contract a*b+c elsewhere would make scalar tails differ from vector bodies and from
# torch's unfused formulas. -fopenmp is required for at::parallel_for: its OpenMP
# implementation is a header template compiled into this extension (without the flag
# every parallel_for silently runs on one thread). The resulting DT_NEEDED libgomp.so.1
# resolves to the copy torch already loaded (same soname), so there is one OpenMP runtime.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-DNDEBUG")
LDFLAGS = ("-fopenmp",)
OPS = (
    "pack_linear_weight",
    "linear",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "hyper_pre",
    "hyper_post",
    "paged_attention",
    "causal_attention_bf16",
    "write_kv_cache",
    "verify_greedy",
    "commit_side_rows",
    "ngram_lookup",
    "slot_mapping",
    "top_tokens",
    "write_drafts",
)
# Ops that one of OPS uses behind the protocol (CpuKernels.linear: prompt rows on AMX,
# GGUF-packed weights).
INTERNAL_OPS = (
    "linear_prefill",
    "quant_linear",
    "quantize_q8",
    "quant_linear_q8",
    "scaled_linear",
)


@dataclass(frozen=True)
class KernelLib:
    """Handle on the loaded extension; callers keep it (there is no hidden global)."""

    library_path: str
    build_seconds: float
    ops: Any  # torch.ops.laneserve namespace
    isa: str = "avx2"  # linear's instruction set: "avx2" | "avx512" (see linear_isa)
    amx: bool = False  # prefill rows of bf16 linears use AMX (see prefill_amx)
    dpbf16: bool = False  # ... or, without AMX, AVX-512 BF16 dot products (prefill_dpbf16)
    vnni: bool = False  # GGUF weights with int8 activations run natively (quant_linear_q8)
    bf16_dot: bool = False  # long prompt chunks: bf16 dot products (causal_attention.cpp)
    vbmi: bool = False  # scaled_linear decodes fp8 with AVX-512 VBMI permutes (scaled_vbmi)

    def op(self, name: str) -> Any:
        return getattr(self.ops, name)


def cache_root() -> Path:
    return paths.cache_root() / "torch_extensions"


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_vendor() -> str | None:
    """The CPU's vendor_id from /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"), or None."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_supported() -> bool:
    """True on x86-64 CPUs with AVX2, FMA and F16C."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = cpu_flags()
    if flags is not None:
        return all(flag in flags for flag in REQUIRED_CPU_FLAGS)
    # No /proc/cpuinfo: torch's dispatch level implies AVX2 (+FMA/F16C on all such CPUs).
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def linear_isa() -> str:
    """Instruction set for ``linear``: "avx512" where the CPU has AVX-512 F+BW, else "avx2".

    ``LANESERVE_KERNEL_ISA=avx2`` forces the AVX2 path (both give the same bits).
    """
    want = os.environ.get(ISA_ENV, "").strip().lower()
    if want not in ("", *ISAS):
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISAS)}, got {want!r}")
    flags = cpu_flags() or set()
    has_512 = flags >= AVX512_CPU_FLAGS
    if want == "avx512" and not has_512:
        raise ValueError(f"{ISA_ENV}=avx512 but this CPU lacks {', '.join(AVX512_CPU_FLAGS)}")
    return want or ("avx512" if has_512 else "avx2")


def prefill_amx(isa: str) -> bool:
    """True where prefill rows of bf16 linears take the AMX path (``linear_prefill``): the
    CPU has amx_tile + amx_bf16, ``isa`` is "avx512" (its bf16 layout is what the AMX
    kernel reads) and ``LANESERVE_KERNEL_AMX`` is not "0"."""
    if os.environ.get(AMX_ENV, "").strip().lower() in _OFF:
        return False
    return isa == "avx512" and (cpu_flags() or set()) >= AMX_CPU_FLAGS


def prefill_dpbf16(isa: str, amx: bool) -> bool:
    """True where prefill rows of bf16 linears take the AVX-512 BF16 dot-product path
    (``linear_prefill`` method 1): no AMX path, ``isa`` is "avx512", the CPU has
    avx512_bf16, and it is faster there than the fp32 chain (a vendor of
    ``DPBF16_FAST_VENDORS``). ``LANESERVE_KERNEL_DPBF16`` "0" turns it off, "1" on (where
    the CPU has the instruction) whatever the vendor."""
    want = os.environ.get(DPBF16_ENV, "").strip().lower()
    if want not in ("", *_OFF, *_ON):
        raise ValueError(f"{DPBF16_ENV} must be 0 or 1, got {want!r}")
    if amx or want in _OFF:
        return False
    if isa != "avx512" or DPBF16_CPU_FLAG not in (cpu_flags() or set()):
        return False
    return want in _ON or cpu_vendor() in DPBF16_FAST_VENDORS


def q8_vnni(isa: str) -> bool:
    """True where ``quant_linear_q8`` can run: ``isa`` is "avx512" and the CPU has
    avx512_vnni (elsewhere such weights take TorchKernels' exact reference)."""
    return isa == "avx512" and VNNI_CPU_FLAG in (cpu_flags() or set())


def scaled_vbmi(isa: str) -> bool:
    """True where ``scaled_linear``'s AVX-512 variant decodes fp8 by VBMI byte permutes:
    ``isa`` is "avx512" and the CPU has avx512vbmi (elsewhere through fp16; same bits)."""
    return isa == "avx512" and VBMI_CPU_FLAG in (cpu_flags() or set())


def bf16_dot(isa: str) -> bool:
    """True where ``causal_attention_bf16`` runs natively: ``isa`` is "avx512" and the CPU has
    avx512_bf16 (elsewhere long prompt chunks take torch's bf16 SDPA)."""
    return isa == "avx512" and DPBF16_CPU_FLAG in (cpu_flags() or set())


def read_sources(directory: Path | None = None) -> dict[str, str]:
    """File name -> text of every source and header of the extension in ``directory``
    (default: beside this file)."""
    folder = KERNEL_DIR if directory is None else directory
    return {p.name: (folder / p.name).read_text(encoding="utf-8") for p in (*SOURCES, *HEADERS)}


def build_environment() -> dict[str, str]:
    """What torch's build files record besides the sources' text: the sources' folder,
    the interpreter's prefix and the include paths. Two checkouts or two virtual
    environments differ here, so they never share (and keep rebuilding) one directory."""
    from torch.utils import cpp_extension

    return {
        "sources_dir": str(KERNEL_DIR.resolve()),
        "prefix": sys.prefix,
        "python_include": sysconfig.get_paths()["include"],
        "torch_include": os.pathsep.join(cpp_extension.include_paths()),
        "torch": torch.__version__,
        **ninja_build.key_entries(),
    }


def extension_name(files: Mapping[str, str], environment: Mapping[str, str] | None = None) -> str:
    """Name derived from every file (name and text) + flags + torch version + the
    environment's paths (see `build_environment`), so any change rebuilds."""
    env = build_environment() if environment is None else environment
    digest = hashlib.sha256()
    parts = [f"{name}\0{text}" for name, text in sorted(files.items())]
    parts += [f"{key}={value}" for key, value in sorted(env.items())]
    for part in (*parts, " ".join(CFLAGS), " ".join(LDFLAGS), torch.__version__):
        # length-prefixed, so moving text across a file boundary changes the digest
        digest.update(f"{len(part)}:".encode())
        digest.update(part.encode())
    return f"laneserve_cpu_{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Inter-process lock around the build.

    torch's own FileBaton (``<build_dir>/lock``, O_EXCL) serializes concurrent builds, but
    a process killed mid-build leaves the file behind and every later load spins on it
    forever. An flock is released by the kernel when its holder dies; while we hold it no
    other laneserve process can be inside ``cpp_extension.load`` for this directory, so a
    leftover baton file is stale and safe to remove.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "laneserve.flock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing stale torch extension lock %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _compile(name: str, build_dir: Path) -> str:
    return compile_extension(
        name, build_dir, SOURCES, CFLAGS, LDFLAGS, lambda: build_reason(build_dir)
    )


def compile_extension(
    name: str,
    build_dir: Path,
    sources: Sequence[Path],
    cflags: Sequence[str],
    ldflags: Sequence[str],
    first_reason: Callable[[], str],
) -> str:
    """Build (what is out of date) and load the extension, with the environment's ninja;
    every compile is announced with its reason and each object is logged as it is
    written (see `laneserve.kernels.ninja_build`)."""
    from torch.utils import cpp_extension

    library = build_dir / f"{name}.so"

    def announce(folder: Path, plan: ninja_build.Plan | None) -> int:
        if plan is not None and not plan.outputs:
            return 0  # up to date
        todo = len(sources) if plan is None else plan.sources
        if not library.exists():
            reason = first_reason()
            logger.info(
                "building CPU kernels: %d sources (%s) in %s; %s",
                todo,
                reason,
                folder,
                build_estimate(folder, todo),
            )
        else:
            logger.info(
                "CPU kernels out of date in %s: compiling %d of %d sources (ninja: %s); %s",
                folder,
                todo,
                len(sources),
                (plan.reason if plan else "") or "no reason given",
                build_estimate(folder, todo),
            )
        return todo

    with ninja_build.environment_ninja_first(), ninja_build.announced_builds(announce):
        return cpp_extension.load(
            name=name,
            sources=[str(p) for p in sources],
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )


@functools.cache
def _build_and_load(name: str, build_dir: str) -> KernelLib | None:
    """Compile (if needed) and load once per process; idempotent for a given name."""
    path = Path(build_dir)
    before = _objects(path)
    start = time.perf_counter()
    try:
        with _build_lock(path):
            lib_path = _compile(name, path)
    except Exception as exc:  # compiler missing, bad toolchain, link error, ...
        logger.warning("laneserve CPU kernels unavailable (build failed: %s); using torch", exc)
        return None
    elapsed = time.perf_counter() - start
    compiled = sum(1 for obj, stamp in _objects(path).items() if before.get(obj) != stamp)
    if compiled:
        logger.info("built CPU kernels in %.1f s (%d sources compiled)", elapsed, compiled)
        _write_build_info(path, elapsed, compiled)
    ops = torch.ops.laneserve
    missing = [op for op in (*OPS, *INTERNAL_OPS) if not hasattr(ops, op)]
    if missing:
        logger.warning("laneserve CPU kernels loaded without ops %s; using torch", missing)
        return None
    return KernelLib(library_path=str(lib_path), build_seconds=elapsed, ops=ops)


BUILD_INFO = "laneserve-build.json"


def _build_info() -> dict[str, str]:
    sources = hashlib.sha256()
    for name, text in sorted(read_sources().items()):
        sources.update(f"{name}\0{text}".encode())
    flags = " ".join((*CFLAGS, *LDFLAGS))
    return {"sources": sources.hexdigest()[:16], "flags": flags, **build_environment()}


def _objects(path: Path) -> dict[str, int]:
    """Object file -> its mtime in ns: a changed stamp means the build compiled it."""
    stamps = {}
    for obj in path.glob("*.o"):
        with contextlib.suppress(OSError):
            stamps[obj.name] = obj.stat().st_mtime_ns
    return stamps


def _write_build_info(path: Path, seconds: float, compiled: int) -> None:
    info = {**_build_info(), "seconds": f"{seconds:.1f}", "compiled": str(compiled)}
    with contextlib.suppress(OSError):
        (path / BUILD_INFO).write_text(json.dumps(info, indent=1))


def build_estimate(path: Path, sources: int) -> str:
    """How long compiling `sources` sources should take, from the newest earlier build
    in the cache that recorded its time (this machine's own figure)."""
    timed = []
    for info_file in path.parent.glob("laneserve_cpu_*/" + BUILD_INFO):
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(info_file.read_text())
            per_source = float(info["seconds"]) / max(1, int(info["compiled"]))
            timed.append((info_file.stat().st_mtime, per_source))
    if not timed:
        return "no earlier timed build here to estimate from; a line follows per source"
    per_source = max(timed)[1]
    return f"about {per_source * sources:.0f} s by the last build here, a line per source"


def build_reason(path: Path) -> str:
    """Why a build starts: compared with the newest other build in the cache."""
    others = [
        p / BUILD_INFO
        for p in path.parent.glob("laneserve_cpu_*")
        if p != path and (p / BUILD_INFO).is_file()
    ]
    if not others:
        return "first build on this machine"
    newest = max(others, key=lambda f: f.stat().st_mtime)
    try:
        before = json.loads(newest.read_text())
    except (OSError, ValueError):
        return "no earlier build could be read"
    now = _build_info()
    changed = [key for key in now if before.get(key) != now[key]]
    if "sources" in changed:
        return "the kernel sources changed"
    if "sources_dir" in changed:
        return f"another checkout ({KERNEL_DIR})"
    if any(key in changed for key in ("prefix", "python_include", "torch_include")):
        return f"another Python environment ({sys.prefix})"
    if changed:
        return f"changed: {', '.join(changed)}"
    return "the earlier build is incomplete"


def kernels_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def load_kernels() -> KernelLib | None:
    """Return the CPU kernel library, building it on first use; ``None`` = use torch.

    Not available (one WARNING, then ``None``) when ``LANESERVE_DISABLE_KERNELS=1``, on
    CPUs without AVX2/FMA/F16C, or when compilation fails.
    """
    if kernels_disabled():
        logger.info("%s set: using torch fallback kernels", DISABLE_ENV)
        return None
    if not cpu_supported():
        _warn_once("CPU lacks avx2/fma/f16c (or is not x86-64): using torch fallback kernels")
        return None
    isa = linear_isa()
    name = extension_name(read_sources())
    lib = _build_and_load(name, str(cache_root() / name))
    if lib is None:
        return None
    amx = prefill_amx(isa)
    return dataclasses.replace(
        lib,
        isa=isa,
        amx=amx,
        dpbf16=prefill_dpbf16(isa, amx),
        vnni=q8_vnni(isa),
        bf16_dot=bf16_dot(isa),
        vbmi=scaled_vbmi(isa),
    )


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)
