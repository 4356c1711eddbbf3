"""Batch-1 decode of the default GGUF against the machine's read bandwidth, in one run.

Per variant: greedy decode tok/s at batch 1 (the peers' 12-token prompt, EOS ignored),
the weight bytes one decode step reads (every packed linear weight, the LM head included),
the achieved weight GB/s (bytes x tok/s) and its share of the read bandwidth measured in
the same run (a torch sum over a 1 GiB float32 tensor on all threads, median of 5), plus
a per-op profile of one generation (self time per step and the share of the step).

Variants run in turn, one per subprocess, for ``--rounds`` rounds (a change in machine
load hits all alike); medians count. ``fp32-weights`` packs every GGUF weight as its
exact fp32 dequantization (what ``--gguf-weights quantized`` did on CPUs without
AVX-512), the others are ``--gguf-weights`` modes.

    PYTHONPATH=$PWD python benchmarks/bench_batch1_bandwidth.py --variants fp32-weights,quantized
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch

TOKENS = 64
FP32_WEIGHTS = "fp32-weights"


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Median GB/s of torch.sum over a float32 tensor of `gib` GiB (read once per sum)."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def _packed_bytes(variant: str) -> list[int]:
    """Wraps CpuKernels' packers to record each packed weight's bytes (in this process);
    the `fp32-weights` variant packs GGUF weights as their fp32 dequantization."""
    from laneserve.kernels import CpuKernels, quant

    sizes: list[int] = []
    pack_dense, pack_gguf = CpuKernels.pack_linear_weight, CpuKernels.pack_gguf_weight

    def dense(self, w, quantize=None):  # type: ignore[no-untyped-def]
        pw = pack_dense(self, w, quantize)
        sizes.append(pw.data.nbytes)
        return pw

    def gguf(self, w):  # type: ignore[no-untyped-def]
        if variant == FP32_WEIGHTS:
            return dense(self, quant.dequantize(w))
        pw = pack_gguf(self, w)
        sizes.append(pw.data.nbytes)
        return pw

    CpuKernels.pack_linear_weight = dense  # type: ignore[method-assign]
    CpuKernels.pack_gguf_weight = gguf  # type: ignore[method-assign]
    return sizes


def run_variant(variant: str, repeats: int, profile: bool, threads: int) -> dict:
    from laneserve import LLM, SamplingParams
    from laneserve.bench.workload import corpus_ids, prompt_token_ids

    torch.set_num_threads(threads)
    sizes = _packed_bytes(variant)
    mode = "quantized" if variant == FP32_WEIGHTS else variant
    with LLM(
        gguf_weights=mode, enable_prefix_caching=False, worker_mode="thread", num_threads=threads
    ) as llm:
        ids = prompt_token_ids(corpus_ids(llm.get_tokenizer()), "short", 1)[0]
        prompt = {"prompt_token_ids": ids}
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        full = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        llm.generate([prompt], full, use_tqdm=False)
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            llm.generate([prompt], first, use_tqdm=False)
            ttft = time.perf_counter() - t
            t = time.perf_counter()
            llm.generate([prompt], full, use_tqdm=False)
            rates.append((TOKENS - 1) / (time.perf_counter() - t - ttft))
        ops = _profile(llm, prompt, full, _time_kernels()) if profile else {}
    return {"variant": variant, "tok_s": rates, "weight_bytes": sum(sizes), "ops": ops}


_OPS = (
    "linear",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "paged_attention",
    "write_kv_cache",
    "slot_mapping",
    "top_tokens",
)


def _time_kernels() -> dict[str, list[float]]:
    """Wraps CpuKernels' decode-path ops with timers (they run on the worker's device
    lane, which torch.profiler started here does not see): name -> [seconds, calls,
    bytes]; a linear is keyed by its weight's shape and counts the weight's bytes."""
    from laneserve.kernels import CpuKernels

    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])

    def timed(name, fn):  # type: ignore[no-untyped-def]
        def run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = fn(self, *args, **kwargs)
            dt = time.perf_counter() - t
            key, nbytes = name, 0
            if name == "linear":
                w = args[1]
                key, nbytes = f"linear {w.out_features}x{w.in_features}", w.data.nbytes
            row = acc[key]
            row[0] += dt
            row[1] += 1
            row[2] += nbytes
            return out

        return run

    for name in _OPS:
        setattr(CpuKernels, name, timed(name, getattr(CpuKernels, name)))
    return acc


def _profile(llm, prompt, params, acc) -> dict:  # type: ignore[no-untyped-def]
    """µs per decode step, calls per step and MB per step of each timed op."""
    acc.clear()
    t = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - t
    steps = params.max_tokens
    ops = {k: [v[0] / steps * 1e6, v[1] / steps, v[2] / steps / 1e6] for k, v in acc.items()}
    ops["(wall per step)"] = [wall / steps * 1e6, 1.0, 0.0]
    return ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=f"{FP32_WEIGHTS},quantized")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads (worker and sum)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child:
        print(json.dumps(run_variant(ns.child, ns.repeats, ns.profile, ns.threads)))
        return
    variants = ns.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    bandwidth = []
    torch.set_num_threads(ns.threads)
    for r in range(ns.rounds):
        bandwidth.append(read_bandwidth_gbs())
        for v in variants:
            cmd = [sys.executable, __file__, "--child", v, "--repeats", str(ns.repeats)]
            cmd += ["--threads", str(ns.threads)]
            cmd += ["--profile"] if r == ns.rounds - 1 else []
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r} {v}: {runs[v][-1]['tok_s']}", file=sys.stderr, flush=True)
    bw = statistics.median(bandwidth)
    print(f"read bandwidth: {bw:.1f} GB/s (median of rounds: {[round(b, 1) for b in bandwidth]})")
    print("| variant | weight MB / step | decode tok/s (median) | weight GB/s | of bandwidth |")
    print("|---|---:|---:|---:|---:|")
    for v in variants:
        rate = statistics.median(x for run in runs[v] for x in run["tok_s"])
        mb = runs[v][0]["weight_bytes"] / 1e6
        gbs = mb * rate / 1e3
        print(f"| {v} | {mb:.1f} | {rate:.1f} | {gbs:.1f} | {gbs / bw:.0%} |")
    for v in variants:
        ops = runs[v][-1]["ops"]
        wall = ops.pop("(wall per step)")[0]
        print(f"\n{v}: per decode step (wall {wall:.0f} µs)\n")
        print("| op | µs / step | calls / step | MB / step | GB/s | share of step |")
        print("|---|---:|---:|---:|---:|---:|")
        rows = sorted(ops.items(), key=lambda kv: -kv[1][0])
        for name, (us, calls, mb) in rows:
            gbs = f"{mb / us * 1e3:.1f}" if mb else ""
            print(f"| `{name}` | {us:.0f} | {calls:.1f} | {mb:.1f} | {gbs} | {us / wall:.0%} |")
        rest = wall - sum(us for us, _, _ in ops.values())
        print(
            f"| everything else (Python, sampling, lanes) | {rest:.0f} | | | | {rest / wall:.0%} |"
        )
    print(json.dumps({"bench": "batch1_bandwidth", "bandwidth_gbs": bandwidth, "runs": runs}))


if __name__ == "__main__":
    main()
