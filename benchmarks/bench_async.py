"""Async vs sync scheduling on the embedded model, in one run.

For each mode: N concurrent greedy requests (EOS ignored, fixed output length),
run without tracing for throughput, then once more with --profile-dir for the
trace analyzer's summary (device span, exposed host gap between consecutive
device invocations, prepare(N+1) finished before device(N) ended). Modes: sync and async
with the worker in this process (lanes as threads), and both with a spawned worker process.

    .venv/bin/python benchmarks/bench_async.py --concurrency 8 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from laneserve import LLM, SamplingParams
from laneserve.bench.workload import corpus_ids, prompt_token_ids
from laneserve.obs.trace_analysis import load_events, report, step_spans, summarize

MODES = {
    "sync": {"async_scheduling": False, "worker_mode": "thread"},
    "async (lanes, this process)": {"async_scheduling": True, "worker_mode": "thread"},
    "sync (worker process)": {"async_scheduling": False, "worker_mode": "process"},
    "async (worker process)": {"async_scheduling": True, "worker_mode": "process"},
}


def run_mode(name: str, kw: dict, n: int, max_tokens: int, repeats: int) -> dict:
    """Throughput without tracing, then one traced run for the analyzer."""
    times = _generate(kw, None, n, max_tokens, repeats)
    trace = Path(tempfile.mkdtemp(prefix="ls-trace-"))
    traced = _generate(kw, str(trace), n, max_tokens, 1)
    summary = summarize(step_spans(load_events([trace])))
    out = {
        "mode": name,
        "tok_s": [round(n * max_tokens / t, 1) for t in times],
        "traced_tok_s": round(n * max_tokens / traced[0], 1),
        "summary": summary.as_dict() if summary else None,
        "report_tail": report([trace]).splitlines()[-1],
    }
    shutil.rmtree(trace, ignore_errors=True)
    return out


def _generate(
    kw: dict, profile_dir: str | None, n: int, max_tokens: int, repeats: int
) -> list[float]:
    llm = LLM(enable_prefix_caching=False, profile_dir=profile_dir, **kw)
    ids = corpus_ids(llm.get_tokenizer())
    prompts = [{"prompt_token_ids": p} for p in prompt_token_ids(ids, "short", n)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (also in the trace)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    llm.shutdown()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ns = ap.parse_args()
    rows = [
        run_mode(name, kw, ns.concurrency, ns.max_tokens, ns.repeats) for name, kw in MODES.items()
    ]
    base = rows[0]["summary"]
    print(
        "| mode | tok/s (untraced runs) | tok/s traced | device ms (mean) "
        "| exposed gap us (mean / median) | overlapped | gap vs sync |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        s = r["summary"]
        cut = 1 - s["mean_gap_us"] / base["mean_gap_us"] if base["mean_gap_us"] else 0.0
        print(
            f"| {r['mode']} | {' / '.join(map(str, r['tok_s']))} | {r['traced_tok_s']} "
            f"| {s['mean_device_us'] / 1000:.2f} | "
            f"{s['mean_gap_us']:.0f} / {s['median_gap_us']:.0f} | {s['overlapped']}/{s['num_pairs']} | "
            f"{'-' if r is rows[0] else f'{100 * cut:.0f}% smaller'} |"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
