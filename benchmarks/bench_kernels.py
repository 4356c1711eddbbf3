"""Microbenchmarks for laneserve.kernels on the SmolLM2-135M decode shapes.

Usage:
    python benchmarks/bench_kernels.py            # full table (~3 min on 2 cores)
    python benchmarks/bench_kernels.py --quick    # fewer repetitions, no decode step

Timings are the best of several bursts (the minimum is the most stable statistic on a
shared machine). Linear weights are cycled over enough distinct copies (>= 96 MB) that
every call streams its weight from DRAM, as a real decode step over 30 layers does; the
GB/s column is weight bytes / time.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from laneserve.kernels import CpuKernels, Kernels, PackedWeight, TorchKernels, load_kernels

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
HQ, HK, HEAD_DIM = 9, 3, 64
LINEARS = {  # name: (in_features, out_features)
    "qkv": (HIDDEN, (HQ + 2 * HK) * HEAD_DIM),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTER),
    "down": (INTER, HIDDEN),
    "lm_head": (HIDDEN, VOCAB),
}
COLD_BYTES = 96 << 20  # > L3 (32 MiB) so weights come from DRAM
BLOCK_SIZE = 16


def best_time(fn: Callable[[], object], bursts: int, per_burst: int) -> float:
    """Best-of-`bursts` mean seconds per call over `per_burst` calls."""
    fn()
    best = math.inf
    for _ in range(bursts):
        t0 = time.perf_counter()
        for _ in range(per_burst):
            fn()
        best = min(best, (time.perf_counter() - t0) / per_burst)
    return best


def cycler(items: list) -> Callable[[], object]:
    state = {"i": 0}

    def next_item() -> object:
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]

    return next_item


@dataclass
class Row:
    name: str
    m: int
    results: dict[str, tuple[float, float]]  # impl -> (us, GB/s)


def bench_linear(ck: CpuKernels, name: str, m: int, bursts: int) -> dict[str, tuple[float, float]]:
    k, n = LINEARS[name]
    out: dict[str, tuple[float, float]] = {}
    for dtype in (torch.bfloat16, torch.float32):
        nbytes = n * k * dtype.itemsize
        copies = max(2, math.ceil(COLD_BYTES / nbytes))
        raw = [torch.randn(n, k).to(dtype) for _ in range(copies)]
        packed: list[PackedWeight] = [ck.pack_linear_weight(w) for w in raw]
        x = torch.randn(m, k)
        xd = x.to(dtype)
        nxt_p, nxt_w = cycler(packed), cycler(raw)
        slow = name == "lm_head" or (dtype == torch.bfloat16 and m > 1)
        per_burst = 2 if slow else 10
        tag = "bf16" if dtype == torch.bfloat16 else "fp32"
        t = best_time(lambda x=x, nxt=nxt_p: ck.linear(x, nxt()), bursts, per_burst)
        out[f"ours {tag}"] = (t * 1e6, nbytes / t / 1e9)
        t = best_time(lambda x=xd, nxt=nxt_w: F.linear(x, nxt()), max(2, bursts // 2), per_burst)
        out[f"F.linear {tag}"] = (t * 1e6, nbytes / t / 1e9)
        del raw, packed
    return out


def print_linear_table(rows: list[Row]) -> None:
    impls = list(rows[0].results)
    head = f"{'linear':<9}{'M':>3} " + "".join(f"{i:>22}" for i in impls)
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = "".join(f"{us:>11.0f}us {gbs:>5.1f}GB/s" for us, gbs in r.results.values())
        print(f"{r.name:<9}{r.m:>3} {cells}")
    print("(us per call, GB/s = weight bytes / time; F.linear bf16 uses bf16 activations)")


def bench_prefill_linear(
    ck: CpuKernels, name: str, m: int, bursts: int
) -> dict[str, tuple[float, float]]:
    """bf16 weights at M prompt rows: the decode kernel (fp32 activations), the prompt-row
    path (AMX or AVX-512 BF16 dot products, rows rounded to bf16) and torch's bf16
    F.linear (oneDNN), the last including the activation's conversion to bf16 and the
    output's back to fp32."""
    k, n = LINEARS[name]
    copies = max(2, math.ceil(COLD_BYTES / (n * k * 2)))
    raw = [torch.randn(n, k).bfloat16() for _ in range(copies)]
    packed = [ck.pack_linear_weight(w) for w in raw]
    x = torch.randn(m, k)
    nxt_p, nxt_w = cycler(packed), cycler(raw)
    per_burst = max(1, min(10, 2048 // m))
    flop = 2 * m * k * n
    impls: dict[str, Callable[[], object]] = {
        "decode kernel": lambda: ck.linear(x, nxt_p()),
        "F.linear bf16": lambda: F.linear(x.bfloat16(), nxt_w()).float(),
    }
    if ck.amx or ck.dpbf16:
        path = "amx" if ck.amx else "avx512_bf16"
        impls[f"{path} prefill"] = lambda: ck.linear(x, nxt_p(), first_prefill=0)
    out = {}
    for impl, fn in impls.items():
        t = best_time(fn, bursts, per_burst)
        out[impl] = (t * 1e6, flop / t / 1e9)
    return out


def print_prefill_table(rows: list[Row]) -> None:
    impls = list(rows[0].results)
    head = f"{'linear':<9}{'M':>5} " + "".join(f"{i:>24}" for i in impls)
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = "".join(f"{us:>11.0f}us {gf:>6.0f}GFLOP/s" for us, gf in r.results.values())
        print(f"{r.name:<9}{r.m:>5} {cells}")
    print("(bf16 weights; us per call, GFLOP/s = 2*M*K*N / time)")


# ----------------------------------------------------------------------------- attention


def make_cache(batch: int, ctx: int, dtype: torch.dtype):
    blocks_per_seq = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, HK, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks).to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    return k_cache, v_cache, block_tables, seq_lens


def bench_attention(ck: CpuKernels, tk: TorchKernels, bursts: int) -> None:
    print(f"\npaged_attention (Hq={HQ}, Hk={HK}, D={HEAD_DIM}, block {BLOCK_SIZE}, 1 query/seq)")
    print(f"{'batch':>5}{'ctx':>6}{'cache':>6}{'ours':>12}{'fallback':>12}{'speedup':>9}")
    for dtype in (torch.bfloat16, torch.float32):
        for ctx in (140, 1024):
            for batch in (1, 8, 32):
                kc, vc, bt, sl = make_cache(batch, ctx, dtype)
                q = torch.randn(batch, HQ, HEAD_DIM)
                qsl = torch.arange(batch + 1, dtype=torch.int32)
                args = (q, kc, vc, bt, sl, qsl, HEAD_DIM**-0.5)
                t_ck = best_time(partial(ck.paged_attention, *args), bursts, 10)
                t_tk = best_time(partial(tk.paged_attention, *args), max(2, bursts // 2), 2)
                tag = "bf16" if dtype == torch.bfloat16 else "fp32"
                print(
                    f"{batch:>5}{ctx:>6}{tag:>6}{t_ck * 1e6:>10.0f}us{t_tk * 1e6:>10.0f}us"
                    f"{t_tk / t_ck:>8.1f}x"
                )


def bench_small_ops(ck: CpuKernels, tk: TorchKernels, bursts: int) -> None:
    print("\nsmall ops (us per call)")
    print(f"{'op':<26}{'M':>3}{'ours':>9}{'torch':>9}")
    w = torch.randn(HIDDEN)
    cache = torch.randn(4096, HEAD_DIM)
    for m in (1, 8, 32):
        x = torch.randn(m, HIDDEN)
        res = torch.randn(m, HIDDEN)
        gu = torch.randn(m, 2 * INTER)
        qkv = torch.randn(m, (HQ + 2 * HK) * HEAD_DIM)
        q, k = qkv[:, : HQ * HEAD_DIM], qkv[:, HQ * HEAD_DIM : (HQ + HK) * HEAD_DIM]
        kv = torch.randn(m, HK, HEAD_DIM)
        kc = torch.zeros(64, BLOCK_SIZE, HK, HEAD_DIM, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        pos = torch.arange(m) + 100
        slots = torch.arange(m) + 37
        ops: dict[str, tuple[str, tuple]] = {
            "rms_norm": ("rms_norm", (x, w, 1e-5)),
            "fused_add_rms_norm": ("fused_add_rms_norm", (x, res, w, 1e-5)),
            "rotary_embedding": ("rotary_embedding", (pos, q, k, HEAD_DIM, cache)),
            "silu_and_mul": ("silu_and_mul", (gu,)),
            "write_kv_cache(bf16)": ("write_kv_cache", (kv, kv, kc, vc, slots)),
        }
        for label, (method, op_args) in ops.items():
            t_ck = best_time(partial(getattr(ck, method), *op_args), bursts, 200)
            t_tk = best_time(partial(getattr(tk, method), *op_args), bursts, 200)
            print(f"{label:<26}{m:>3}{t_ck * 1e6:>9.1f}{t_tk * 1e6:>9.1f}")
        res.normal_()  # fused_add_rms_norm grew it
        x.normal_()


# ----------------------------------------------------------------------------- decode step


@dataclass
class Layer:
    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight
    norm1: torch.Tensor
    norm2: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def build_model(kern: Kernels, dtype: torch.dtype, batch: int, ctx: int):
    layers = []
    kc, vc, bt, sl = make_cache(batch, ctx + 1, torch.bfloat16)
    for _ in range(LAYERS):
        packed = {}
        for name in ("qkv", "o", "gate_up", "down"):
            k, n = LINEARS[name]
            packed[name] = kern.pack_linear_weight((torch.randn(n, k) * 0.02).to(dtype))
        norms = torch.ones(HIDDEN), torch.ones(HIDDEN)
        layers.append(Layer(**packed, norm1=norms[0], norm2=norms[1], k_cache=kc, v_cache=vc))
    lm_head = kern.pack_linear_weight((torch.randn(VOCAB, HIDDEN) * 0.02).to(dtype))
    return layers, lm_head, bt, sl


def decode_step(kern, layers: list[Layer], lm_head: PackedWeight, bt, sl, cache) -> torch.Tensor:
    m = sl.numel()
    hidden = torch.randn(m, HIDDEN)
    residual = torch.zeros(m, HIDDEN)
    positions = (sl - 1).long()
    slots = (
        bt[torch.arange(m), positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    )
    qsl = torch.arange(m + 1, dtype=torch.int32)
    q_end, k_end = HQ * HEAD_DIM, (HQ + HK) * HEAD_DIM
    for layer in layers:
        kern.fused_add_rms_norm(hidden, residual, layer.norm1, 1e-5)
        qkv = kern.linear(hidden, layer.qkv)
        q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
        kern.rotary_embedding(positions, q, k, HEAD_DIM, cache)
        k3, v3 = k.view(m, HK, HEAD_DIM), v.view(m, HK, HEAD_DIM)
        kern.write_kv_cache(k3, v3, layer.k_cache, layer.v_cache, slots)
        attn = kern.paged_attention(
            q.reshape(m, HQ, HEAD_DIM), layer.k_cache, layer.v_cache, bt, sl, qsl, HEAD_DIM**-0.5
        )
        hidden = kern.linear(attn.view(m, -1), layer.o)
        kern.fused_add_rms_norm(hidden, residual, layer.norm2, 1e-5)
        hidden = kern.linear(kern.silu_and_mul(kern.linear(hidden, layer.gate_up)), layer.down)
    kern.fused_add_rms_norm(hidden, residual, layers[0].norm1, 1e-5)
    return kern.linear(hidden, lm_head)


def bench_decode(
    ck: CpuKernels, tk: TorchKernels, bursts: int, ctx: int, batches: list[int]
) -> None:
    print(f"\n30-layer decode step (context {ctx}, bf16 KV cache; ms per step)")
    cache = torch.randn(4096, HEAD_DIM)
    configs = [
        ("ours bf16 weights", ck, torch.bfloat16),
        ("ours fp32 weights", ck, torch.float32),
        ("torch fallback (fp32)", tk, torch.bfloat16),
    ]
    print(f"{'impl':<24}" + "".join(f"{'M=' + str(m):>10}" for m in batches))
    for label, kern, dtype in configs:
        cells = []
        for m in batches:
            layers, lm_head, bt, sl = build_model(kern, dtype, m, ctx)
            reps = max(2, bursts // (2 if kern is tk else 1))
            step = partial(decode_step, kern, layers, lm_head, bt, sl, cache)
            cells.append(f"{best_time(step, reps, 1) * 1e3:>10.1f}")
            del layers, lm_head, step
        print(f"{label:<24}" + "".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no decode")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--only", choices=["linear", "prefill", "attention", "small", "decode"])
    parser.add_argument(
        "--batches",
        default="1,8,32",
        help="comma-separated M (rows) for the linear and decode tables; 1,2,3 shows what a "
        "k=1 / k=2 verify step costs over a plain decode",
    )
    args = parser.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches needs comma-separated integers, got {args.batches!r}")
    if min(batches) < 1:
        parser.error("--batches needs positive integers")
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = load_kernels()
    if lib is None:
        raise SystemExit("CPU kernels unavailable on this machine")
    ck, tk = CpuKernels(lib), TorchKernels()
    bursts = 3 if args.quick else 7
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {bursts}")
    if args.only in (None, "linear"):
        rows = [Row(n, m, bench_linear(ck, n, m, bursts)) for n in LINEARS for m in batches]
        print_linear_table(rows)
    if args.only == "prefill":  # opt-in: prompt-row sizes, e.g. --batches 1,8,32,128,512
        names = [n for n in LINEARS if n != "lm_head"]  # prompt rows never reach lm_head
        rows = [Row(n, m, bench_prefill_linear(ck, n, m, bursts)) for n in names for m in batches]
        print_prefill_table(rows)
    if args.only in (None, "attention"):
        bench_attention(ck, tk, bursts)
    if args.only in (None, "small"):
        bench_small_ops(ck, tk, bursts)
    if args.only == "decode" or (args.only is None and not args.quick):
        for ctx in (140, 1024):
            bench_decode(ck, tk, bursts, ctx, batches)


if __name__ == "__main__":
    main()
