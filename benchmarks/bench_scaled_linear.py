"""Block-scaled fp8 / MXFP4 weights in `scaled_linear` against the bf16 `linear`, per shape
and row count: giga weights per second (N * K / time), higher is faster.

Usage:
    python benchmarks/bench_scaled_linear.py                 # one thread, the default shapes
    python benchmarks/bench_scaled_linear.py --threads 2 --rows 1,8

Each case is the best of several bursts of calls (the minimum is the steadiest statistic on a
shared machine); the three weights of a shape are timed in turn, burst by burst. Weights are
random, quantized the way DeepSeek V4's release stores them (fp8 e4m3 with a ue8m0 scale per
128 x 128 block, MXFP4 with a ue8m0 exponent per 32 columns). Each product is checked against
the fp32 linear on the dequantized weight first (bitwise).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from laneserve.kernels import CpuKernels, PackedWeight, load_kernels, scaled
from laneserve.model.layers import fp8

SHAPES = ((1024, 1024), (4096, 4096), (2048, 7168))  # (N, K)


def best_time(
    fns: dict[str, Callable[[], object]], bursts: int, seconds: float
) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for f in fns.values():
        f()
    for _ in range(bursts):
        for name, f in fns.items():
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                t = time.perf_counter()
                f()
                best[name] = min(best[name], time.perf_counter() - t)
    return best


def weights(ck: CpuKernels, n: int, k: int) -> dict[str, tuple[PackedWeight, torch.Tensor]]:
    """Packed weights by name, each with its exact fp32 values."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02
    out = {"bf16": (ck.pack_linear_weight(w.bfloat16()), w.bfloat16().float())}
    for name, fp4 in (("fp8", False), ("fp4", True)):
        q, s = fp8.quantize_ue8m0(w, fp4)
        sw = fp8.resident(q, s, (128, 128), (n, k))
        out[name] = (ck.pack_scaled_weight(sw), scaled.dequantize(sw))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--rows", default="1,4,8,32", help="row counts (batch rows), comma separated"
    )
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.1, help="per burst")
    args = parser.parse_args()
    lib = load_kernels()
    if lib is None:
        raise SystemExit("the CPU kernels are not available here")
    ck = CpuKernels(lib)
    torch.set_num_threads(args.threads)
    print(f"isa {ck.isa} (scaled_linear isa {ck.scaled_isa}), {torch.get_num_threads()} threads")
    for n, k in SHAPES:
        packed = weights(ck, n, k)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            for name, (p, exact) in packed.items():
                want = ck.linear(x, ck.pack_linear_weight(exact))
                assert torch.equal(ck.linear(x, p), want), f"{name} {n}x{k} rows {m}"
            fns = {name: (lambda p=p, x=x: ck.linear(x, p)) for name, (p, _) in packed.items()}
            best = best_time(fns, args.bursts, args.seconds)
            rates = "  ".join(f"{name} {n * k / t / 1e9:5.1f}" for name, t in best.items())
            print(f"{n} x {k}, {m:2d} rows: {rates}  (G weights/s)", flush=True)


if __name__ == "__main__":
    main()
