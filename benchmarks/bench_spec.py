"""Speculative decoding on the embedded model, in one run: no speculation vs MTP
(the shipped head, as a chain and as a token tree) vs n-gram, batch 1 and N
concurrent, greedy, fixed length.

Every configuration runs the same prompts. Timings on a shared VM swing by
10-30 % from minute to minute, so the configurations of a case run in
interleaved rounds (each round: every configuration once, a fresh engine each);
the table prints the median tokens/s over the rounds, the median of the
per-round ratios to no speculation, the acceptance rate, and checks that every
output equals the no-speculation output token for token.

    .venv/bin/python benchmarks/bench_spec.py --max-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tqdm import tqdm

from laneserve import LLM, SamplingParams
from laneserve.config import SpeculativeConfig

CHAT = [
    "Explain why the sky is blue.",
    "Write a short story about a lighthouse keeper.",
    "Give me three tips for learning a new language.",
    "What is the difference between weather and climate?",
]
REPEAT = "Repeat this paragraph twice, word for word: The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun all afternoon, and the fox runs back into the forest."

TREE3 = "[(0,), (1,), (2,)]"
CONFIGS = {
    "no speculation": None,
    "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
    "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2},
    "mtp tree [(0,), (1,)]": {"method": "mtp", "speculative_token_tree": "[(0,), (1,)]"},
    f"mtp tree {TREE3}": {"method": "mtp", "speculative_token_tree": TREE3},
    "mtp tree [(0,), (1,), (2,), (3,)]": {
        "method": "mtp",
        "speculative_token_tree": "[(0,), (1,), (2,), (3,)]",
    },
    "mtp tree [(0,), (1,), (2,), (0, 0)]": {
        "method": "mtp",
        "speculative_token_tree": "[(0,), (1,), (2,), (0, 0)]",
    },
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3},
    f"mtp tree {TREE3}, disable_by_batch_size=4": {
        "method": "mtp",
        "speculative_token_tree": TREE3,
        "disable_by_batch_size": 4,
    },
}


def measure(
    spec: dict | None,
    prompts: list[list[int]],
    batch: int,
    max_tokens: int,
    async_on: bool,
    worker_mode: str,
) -> dict:
    llm = LLM(
        speculative_config=spec,
        async_scheduling=async_on,
        enable_prefix_caching=False,
        worker_mode=worker_mode,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    before = llm.get_stats()
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
        outs += [o.outputs[0].token_ids for o in llm.generate(group, params, use_tqdm=False)]
    elapsed = time.perf_counter() - start
    stats = llm.get_stats()
    llm.shutdown()
    steps = stats["num_steps"] - before["num_steps"]
    tokens = stats["num_generation_tokens"] - before["num_generation_tokens"]
    return {
        "tok_s": len(prompts) * max_tokens / elapsed,
        "acceptance": stats.get("spec_acceptance_rate"),
        "per_position": stats.get("spec_acceptance_per_position"),
        "tokens_per_step": tokens / max(1, steps),
        "outputs": outs,
    }


def run_case(
    names: list[str], prompts: list[list[int]], batch: int, ns: argparse.Namespace, title: str
) -> list[dict]:
    """Interleaved rounds; per configuration the median tok/s and median ratio."""
    runs: dict[str, list[dict]] = {n: [] for n in names}
    bar = tqdm(total=ns.repeats * len(names), desc=title, unit="run", leave=False)
    for _ in range(ns.repeats):
        for name in names:
            runs[name].append(
                measure(
                    CONFIGS[name], prompts, batch, ns.max_tokens, not ns.no_async, ns.worker_mode
                )
            )
            bar.update(1)
    bar.close()
    base = runs[names[0]]
    rows = []
    for name in names:
        r = runs[name]
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(r, base, strict=True)]
        rows.append(
            {
                "case": title,
                "config": name,
                "tok_s": statistics.median(x["tok_s"] for x in r),
                "tok_s_runs": [round(x["tok_s"], 1) for x in r],
                "ratio": statistics.median(ratios),
                "ratios": [round(x, 3) for x in ratios],
                "acceptance": r[-1]["acceptance"],
                "per_position": r[-1]["per_position"],
                "tokens_per_step": r[-1]["tokens_per_step"],
                "same_output": all(x["outputs"] == base[0]["outputs"] for x in r),
            }
        )
    return rows


def print_table(title: str, mode: str, rows: list[dict], ns: argparse.Namespace) -> None:
    print(f"\n{title} ({mode}, {ns.max_tokens} tokens, greedy, median of {ns.repeats} rounds)")
    print(
        "| config | tok/s | vs none (per round) | acceptance | per position | tokens/step | same output |"
    )
    print("|---|---:|---|---:|---|---:|---|")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        per = ", ".join(f"{100 * a:.0f}%" for a in r["per_position"] or []) or "-"
        each = ", ".join(f"{x:.2f}" for x in r["ratios"])
        print(
            f"| {r['config']} | {r['tok_s']:.1f} | {r['ratio']:.2f}x ({each}) | {acc} | {per} "
            f"| {r['tokens_per_step']:.2f} | {r['same_output']} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per case")
    ap.add_argument("--draft-weights", default=None, help="MTP head file (default: shipped)")
    ap.add_argument("--no-async", action="store_true")
    ap.add_argument("--worker-mode", default="thread", choices=("thread", "process"))
    ap.add_argument(
        "--cases", default="chat,repeat,concurrent", help="comma-separated subset of the cases"
    )
    ns = ap.parse_args()
    if ns.repeats < 1:
        ap.error("--repeats must be >= 1")
    for spec in CONFIGS.values():
        if spec and spec["method"] == "mtp" and ns.draft_weights:
            spec["draft_weights"] = ns.draft_weights
        SpeculativeConfig.parse(spec)  # fail early on a typo
    first = LLM(enable_prefix_caching=False)
    tok = first.engine.tokenizer
    first.shutdown()  # only its tokenizer is needed
    chat = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    tree = f"mtp tree {TREE3}"
    cases = {
        "chat": ("chat prompts, batch 1", chat, 1, [n for n in CONFIGS if "disable" not in n]),
        "repeat": (
            "repetition prompt, batch 1",
            [tok.apply_chat_template([{"role": "user", "content": REPEAT}])],
            1,
            ["no speculation", "ngram k=3", "mtp k=1", tree],
        ),
        "concurrent": (
            f"chat prompts x2, {ns.concurrency} concurrent",
            (chat * ns.concurrency)[: ns.concurrency],
            ns.concurrency,
            ["no speculation", "mtp k=1", tree, "ngram k=3", f"{tree}, disable_by_batch_size=4"],
        ),
    }
    mode = f"async {'off' if ns.no_async else 'on'}, worker {ns.worker_mode}"
    rows = []
    for key in ns.cases.split(","):
        if key not in cases:
            ap.error(f"unknown case {key!r}; known: {', '.join(cases)}")
        title, prompts, batch, names = cases[key]
        got = run_case(names, prompts, batch, ns, title)
        print_table(title, mode, got, ns)
        rows += got
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
