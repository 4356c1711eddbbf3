"""Batch-1 decode on the default Q4_1 GGUF: laneserve with the weights kept quantized (fp32 or
int8 activations: `--gguf-weights quantized` / `q8-dot`) vs
laneserve with them dequantized to bf16 vs llama.cpp (llama-cpp-python, shared/peers),
in one run with ratios.

Each engine runs in its own subprocess (one engine per process, so none slows another),
and the engines take turns for ``--rounds`` rounds, so a change in machine load hits all
of them alike. Per round and engine: a warm-up, then ``--repeats`` greedy generations of
128 tokens from the peers' 12-token prompt (EOS ignored); the median counts.

    PYTHONPATH=$PWD python benchmarks/bench_gguf.py --peers-home /tmp/peers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NEW_TOKENS = 128
PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/work/shared/peers"))


def run_laneserve(mode: str, repeats: int) -> dict:
    from laneserve import LLM, SamplingParams
    from laneserve.bench.workload import corpus_ids, prompt_token_ids

    with LLM(gguf_weights=mode, enable_prefix_caching=False) as llm:
        prompt = {
            "prompt_token_ids": prompt_token_ids(corpus_ids(llm.get_tokenizer()), "short", 1)[0]
        }
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        full = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        ttfts, e2es = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            llm.generate([prompt], first, use_tqdm=False)
            ttfts.append(time.perf_counter() - t)
            t = time.perf_counter()
            out = llm.generate([prompt], full, use_tqdm=False)
            e2es.append(time.perf_counter() - t)
            assert len(out[0].outputs[0].token_ids) == NEW_TOKENS
    return _row(f"laneserve-{mode}", statistics.median(ttfts), statistics.median(e2es))


def _row(engine: str, ttft: float, e2e: float) -> dict:
    return {
        "engine": engine,
        "ttft_s": round(ttft, 4),
        "e2e_s": round(e2e, 4),
        "output_tok_s": round(NEW_TOKENS / e2e, 1),
        "decode_tok_s": round((NEW_TOKENS - 1) / (e2e - ttft), 1),
    }


def run_llamacpp(peers_home: str, repeats: int) -> dict:
    env = dict(os.environ, PEERS_HOME=peers_home, PEERS_CASES="short", PEERS_REPEATS=str(repeats))
    py = f"{peers_home}/llamacpp-venv/bin/python"
    out = subprocess.run(
        [py, str(PEERS_DIR / "run_llamacpp.py")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    case = result["results"][0] if "results" in result else result
    return _row("llama.cpp", case["ttft_s"], case["e2e_s"])


def _child(engine: str, ns: argparse.Namespace) -> dict:
    if engine == "llama.cpp":
        return run_llamacpp(ns.peers_home, ns.repeats)
    cmd = [sys.executable, __file__, "--child", engine, "--repeats", str(ns.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers-home", default="/tmp/peers")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", default="quantized,q8-dot,dequantized,llama.cpp")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child:
        print(json.dumps(run_laneserve(ns.child, ns.repeats)))
        return
    engines = ns.engines.split(",")
    rows: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(ns.rounds):
        for e in engines:
            row = _child(e, ns)
            rows[e].append(row)
            print(f"round {r}: {json.dumps(row)}", file=sys.stderr, flush=True)
    med = {e: statistics.median(x["decode_tok_s"] for x in rows[e]) for e in engines}
    print("| engine | decode tok/s (median of rounds) | per round | ratio vs llama.cpp |")
    print("|---|---|---|---|")
    for e in engines:
        per = ", ".join(str(x["decode_tok_s"]) for x in rows[e])
        ratio = med[e] / med["llama.cpp"] if "llama.cpp" in med else float("nan")
        print(f"| {e} | {med[e]:.1f} | {per} | {ratio:.2f} |")
    print(json.dumps({"bench": "gguf_batch1", "rows": rows, "median_decode_tok_s": med}))


if __name__ == "__main__":
    main()
