"""Data-parallel attention + expert parallelism (DP = 2, EP = 2) against one rank, on
the mid-size random DeepSeek V3 / V4 checkpoints of `bench_deepseek.py`.

Both runs generate the same greedy tokens for N concurrent requests (checked); the DP + EP
run is traced (`--profile-dir`), and from its trace each rank's exchanges per step (count,
bytes sent, milliseconds in the all-to-alls, waiting included) and `laneserve profile
analyze`'s per-rank host gaps and critical rank are printed. Not a timed test: on a
2-core machine the two ranks share the cores with each other, so this is the cost of
the correctness path, not a speed-up. On CUDA each rank takes its own GPU (cuda:0 ..
cuda:D-1, NCCL) and the single rank runs on cuda:0.

    .venv/bin/python benchmarks/bench_dp_ep.py                        # V3, 32 requests
    .venv/bin/python benchmarks/bench_dp_ep.py --family v4 --requests 8 --max-tokens 16
    .venv/bin/python benchmarks/bench_dp_ep.py --quick                # tiny fp32 smoke run
    .venv/bin/python benchmarks/bench_dp_ep.py --device cuda --ranks 8 --requests 256
                                               # one GPU per rank (NCCL): needs --ranks GPUs

Run from the repository root (the checkpoint builders live in tests/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.bench_deepseek import MID, MID_V4, QUICK, prompts
from laneserve import LLM, SamplingParams
from laneserve.obs.trace_analysis import load_processes, report
from tests.models.tiny_deepseek_v4 import build_tiny_deepseek_v4
from tests.tiny_models import build_tiny_deepseek


def generate(model: Path, reqs: list[list[int]], tokens: int, **kw: object) -> tuple[float, list]:
    """(tok/s, token ids) of one timed greedy run of every request at once."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(str(model), enable_prefix_caching=False, skip_tokenizer_init=True, **kw) as llm:
        batch = [{"prompt_token_ids": p} for p in reqs]
        llm.generate(batch[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return len(reqs) * tokens / elapsed, [o.outputs[0].token_ids for o in outs]


def exchanges(trace_dir: Path) -> list[str]:
    """Per rank: mean exchanges, bytes sent and all-to-all ms per step with exchanges."""
    lines = []
    for name, events in sorted(load_processes([trace_dir]).items()):
        steps = [
            e["args"]
            for e in events
            if e.get("name") == "device" and "exchanges" in e.get("args", {})
        ]
        if not steps:
            continue
        work = [s for s in steps if s["exchange_bytes"]]
        mb = statistics.mean(s["exchange_bytes"] for s in steps) / 1e6
        ms = statistics.mean(s["exchange_ms"] for s in steps)
        lines.append(
            f"{name}: {len(steps)} steps, {statistics.mean(s['exchanges'] for s in steps):.0f} "
            f"exchanges/step, {mb:.3f} MB sent/step, {ms:.2f} ms in all-to-alls/step "
            f"({len(steps) - len(work)} steps without rows to send)"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="v3", choices=["v3", "v4"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--quick", action="store_true", help="the tiny test config in fp32")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ranks", type=int, default=2, help="data-parallel = expert-parallel size")
    args = ap.parse_args()
    if args.device == "cuda" and not 0 < args.ranks <= torch.cuda.device_count():
        ap.error(f"--ranks {args.ranks} needs that many GPUs; {torch.cuda.device_count()} seen")
    v4 = args.family == "v4"
    cfg, dtype = (MID_V4 if v4 else MID), args.dtype
    if args.quick:
        cfg, dtype = QUICK, "float32"
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        build = build_tiny_deepseek_v4 if v4 else build_tiny_deepseek
        model = build(root / "ckpt", seed=0, **cfg)  # type: ignore[operator]
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        reqs = prompts(args.requests, args.prompt_len, vocab)
        kw: dict = {"dtype": dtype, "worker_mode": "process", "async_scheduling": True}
        kw["device"] = args.device
        one, want = generate(model, reqs, args.max_tokens, **kw)
        trace = root / "trace"
        ep = {"data_parallel_size": args.ranks, "enable_expert_parallel": True}
        ep["profile_dir"] = str(trace)
        two, got = generate(model, reqs, args.max_tokens, **kw, **ep)
        print(f"DeepSeek {args.family.upper()} {'tiny' if args.quick else 'mid-size'}, {dtype}, "
              f"{args.requests} requests x {args.max_tokens} tokens, prompt {args.prompt_len}, "
              f"{args.device}")  # fmt: skip
        d = args.ranks
        print(f"one rank: {one:.1f} tok/s | DP {d} + EP {d}: {two:.1f} tok/s ({two / one:.2f}x) | "
              f"greedy tokens equal: {got == want}")  # fmt: skip
        print("\n".join(exchanges(trace)))
        lines = report([trace]).splitlines()
        print("\n".join(x for x in lines if x.startswith(("summary", "critical", "== "))))


if __name__ == "__main__":
    main()
