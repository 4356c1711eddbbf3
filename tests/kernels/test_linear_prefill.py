"""linear with prompt rows (``first_prefill``): the prompt-row paths of CpuKernels, AMX
tiles and AVX-512 BF16 dot products, each tested where the CPU has it.

Decode-like rows keep the decode kernel's bits; prompt rows are rounded to bf16 and
multiplied by the path's dot products, and each row's result is independent of the
other rows.

Why they skip: the `prompt_path` tests run once per path the CPU has (AMX needs
amx_tile + amx_bf16 and the avx512 ISA; the dot products avx512_bf16), and skip, naming
the missing flag, elsewhere. Such a CPU never chooses that path at run time either
(`prefill_amx` / `prefill_dpbf16`, whose choice is tested here on any CPU), so what
skips is code that cannot run there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from laneserve.kernels import CpuKernels, TorchKernels
from laneserve.kernels import build as kbuild
from laneserve.kernels.build import DPBF16_CPU_FLAG, DPBF16_ENV, cpu_flags, prefill_dpbf16
from tests.kernels.helpers import randn

SHAPES = [(960, 576), (37, 45), (100, 33), (48, 64), (576, 1536)]  # odd K, N % 32 != 0


@pytest.fixture(scope="module", params=["amx", "dpbf16"])
def prompt_path(ck: CpuKernels, request: pytest.FixtureRequest) -> CpuKernels:
    """CpuKernels with one prompt-row path: AMX tiles or AVX-512 BF16 dot products."""
    if request.param == "amx" and not ck.amx:
        pytest.skip("no AMX (amx_tile + amx_bf16) on this CPU, or LANESERVE_KERNEL_AMX=0")
    if request.param == "dpbf16" and (
        ck.isa != "avx512" or DPBF16_CPU_FLAG not in (cpu_flags() or set())
    ):
        pytest.skip("no avx512_bf16 on this CPU (or the avx2 isa)")
    is_amx = request.param == "amx"
    return CpuKernels(dataclasses.replace(ck.lib, amx=is_amx, dpbf16=not is_amx))


def test_the_path_is_taken(prompt_path: CpuKernels) -> None:
    """Prompt rows do not take the decode kernel's bits (bf16-rounded activations)."""
    w = randn(64, 96, seed=11).bfloat16()
    pw = prompt_path.pack_linear_weight(w)
    x = randn(40, 96, seed=12)
    assert not torch.equal(prompt_path.linear(x, pw, first_prefill=0), prompt_path.linear(x, pw))


def test_the_dot_product_path_needs_avx512_bf16_no_amx_and_a_fast_vendor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    has_flag = DPBF16_CPU_FLAG in (cpu_flags() or set())
    monkeypatch.delenv(DPBF16_ENV, raising=False)
    fast = kbuild.cpu_vendor() in kbuild.DPBF16_FAST_VENDORS
    assert prefill_dpbf16("avx512", amx=False) == (has_flag and fast)
    # every answer on any machine: a CPU with the flag, and one without it
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw"}
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: avx512 | {DPBF16_CPU_FLAG})
    monkeypatch.setattr(kbuild, "cpu_vendor", lambda: "AuthenticAMD")
    assert prefill_dpbf16("avx512", amx=False)
    assert not prefill_dpbf16("avx512", amx=True)  # AMX wins where both exist
    assert not prefill_dpbf16("avx2", amx=False)
    monkeypatch.setattr(kbuild, "cpu_vendor", lambda: "GenuineIntel")
    assert not prefill_dpbf16("avx512", amx=False)  # one vdpbf16ps per cycle: not faster
    monkeypatch.setenv(DPBF16_ENV, "1")
    assert prefill_dpbf16("avx512", amx=False)  # asked for
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: avx512)
    assert not prefill_dpbf16("avx512", amx=False)  # no instruction, whatever is asked
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: avx512 | {DPBF16_CPU_FLAG})
    monkeypatch.setattr(kbuild, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setenv(DPBF16_ENV, "0")
    assert not prefill_dpbf16("avx512", amx=False)
    monkeypatch.setenv(DPBF16_ENV, "maybe")
    with pytest.raises(ValueError, match=DPBF16_ENV):
        prefill_dpbf16("avx512", amx=False)


def test_the_amx_path_needs_amx_flags_and_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the AMX tests skip, the path is never chosen: both answers on any machine."""
    monkeypatch.delenv(kbuild.AMX_ENV, raising=False)
    base = {"avx2", "fma", "f16c", "avx512f", "avx512bw"}
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: base | kbuild.AMX_CPU_FLAGS)
    assert kbuild.prefill_amx("avx512")
    assert not kbuild.prefill_amx("avx2")  # the AMX kernel reads the avx512 layout
    monkeypatch.setenv(kbuild.AMX_ENV, "0")
    assert not kbuild.prefill_amx("avx512")
    monkeypatch.delenv(kbuild.AMX_ENV)
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: base | {"amx_tile"})
    assert not kbuild.prefill_amx("avx512")


def bf16_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The prompt rows' math in float64: x rounded to bf16 (RNE), times the bf16 weight."""
    out = x.bfloat16().double() @ w.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("n,k", SHAPES)
def test_prompt_rows_match_bf16_reference(prompt_path: CpuKernels, n: int, k: int) -> None:
    w = randn(n, k, seed=n + k).bfloat16()
    b = randn(n, seed=7)
    pw = prompt_path.pack_linear_weight(w)
    x = randn(70, k, seed=k)
    for first in (0, 3, 69):
        y = prompt_path.linear(x, pw, b, first_prefill=first)
        ref = bf16_ref(x[first:], w, b)
        # fp32 accumulation of exact bf16 products over K terms
        bound = 2e-5 * (x[first:].bfloat16().double().abs() @ w.double().abs().T) + 1e-6
        assert y.shape == (70, n) and y.dtype == torch.float32
        assert ((y[first:].double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("n,k", SHAPES)
def test_decode_rows_keep_the_decode_kernel_bits(prompt_path: CpuKernels, n: int, k: int) -> None:
    w = randn(n, k, seed=n).bfloat16()
    b = randn(n, seed=1)
    pw = prompt_path.pack_linear_weight(w)
    x = randn(40, k, seed=2)
    for first in (1, 5, 39, 40):
        y = prompt_path.linear(x, pw, b, first_prefill=first)
        assert torch.equal(y[:first], prompt_path.linear(x[:first], pw, b))
    assert torch.equal(
        prompt_path.linear(x, pw, b, first_prefill=None), prompt_path.linear(x, pw, b)
    )


@pytest.mark.parametrize("n,k", SHAPES)
def test_prompt_rows_are_row_invariant(prompt_path: CpuKernels, n: int, k: int) -> None:
    """A prompt row's bits do not depend on M, on its neighbours or on the thread split."""
    w = randn(n, k, seed=3).bfloat16()
    pw = prompt_path.pack_linear_weight(w)
    x = randn(300, k, seed=4)
    full = prompt_path.linear(x, pw, None, first_prefill=0)
    for lo, hi in [(0, 1), (17, 18), (5, 37), (100, 300), (31, 64)]:
        assert torch.equal(prompt_path.linear(x[lo:hi], pw, None, first_prefill=0), full[lo:hi])
    other = torch.cat([randn(9, k, seed=5), x[50:60]])  # other rows around them
    assert torch.equal(prompt_path.linear(other, pw, None, first_prefill=2)[9:], full[50:60])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(prompt_path.linear(x, pw, None, first_prefill=0), full)
    finally:
        torch.set_num_threads(threads)


def test_other_weights_ignore_first_prefill(ck: CpuKernels) -> None:
    """fp32 / fp16 / int8 weights: every row takes the decode kernel."""
    x = randn(20, 64, seed=6)
    w = randn(48, 64, seed=7)
    for pw in (
        ck.pack_linear_weight(w),
        ck.pack_linear_weight(w.half()),
        ck.pack_linear_weight(w, "int8"),
    ):
        assert torch.equal(ck.linear(x, pw, first_prefill=0), ck.linear(x, pw))


def test_torch_kernels_accept_first_prefill(tk: TorchKernels) -> None:
    x, w = randn(6, 32, seed=8), randn(16, 32, seed=9)
    pw = tk.pack_linear_weight(w)
    assert torch.equal(tk.linear(x, pw, first_prefill=2), tk.linear(x, pw))
