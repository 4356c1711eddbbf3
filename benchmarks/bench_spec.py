"""Speculative decoding on the embedded model, in one run: no speculation vs MTP
(the shipped head, as a chain and as a token tree) vs n-gram, batch 1 and N
concurrent, greedy, fixed length.

Every configuration runs the same prompts. Timings on a shared VM swing by
10-30 % from minute to minute, so the configurations of a case run in
interleaved rounds: by default each round runs every configuration once on a
fresh engine; `--interleave prompt` keeps every engine up and runs each prompt
group on every configuration in turn, so that drift hits all of them within
seconds. The table prints the median tokens/s over the rounds, the median of
the per-round ratios to no speculation, the acceptance rate, and checks that
every output equals the no-speculation output token for token.

    .venv/bin/python benchmarks/bench_spec.py --max-tokens 128 --repeats 3
    .venv/bin/python benchmarks/bench_spec.py --repeats 5 --cases chat \
        --interleave prompt --worker-mode process
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
    # prompt-lookup drafts first, the head's where the history does not repeat
    "mtp k=1, ngram_first": {"method": "mtp", "num_speculative_tokens": 1, "ngram_first": True},
    "mtp k=2, ngram_first": {"method": "mtp", "num_speculative_tokens": 2, "ngram_first": True},
    f"mtp tree {TREE3}, ngram_first": {
        "method": "mtp",
        "speculative_token_tree": TREE3,
        "ngram_first": True,
    },
    # the head's linears as int8 (`"quantization": "int8"`): half the bytes per draft
    "mtp k=1, int8 head": {"method": "mtp", "num_speculative_tokens": 1, "quantization": "int8"},
    "mtp k=1, ngram_first, int8 head": {
        "method": "mtp",
        "num_speculative_tokens": 1,
        "ngram_first": True,
        "quantization": "int8",
    },
    f"mtp tree {TREE3}, int8 head": {
        "method": "mtp",
        "speculative_token_tree": TREE3,
        "quantization": "int8",
    },
    "mtp tree [(0,), (1,), (2,), (0, 0)], int8 head": {
        "method": "mtp",
        "speculative_token_tree": "[(0,), (1,), (2,), (0, 0)]",
        "quantization": "int8",
    },
    f"mtp tree {TREE3}, ngram_first, int8 head": {
        "method": "mtp",
        "speculative_token_tree": TREE3,
        "ngram_first": True,
        "quantization": "int8",
    },
    f"mtp tree {TREE3}, disable_by_batch_size=4": {
        "method": "mtp",
        "speculative_token_tree": TREE3,
        "disable_by_batch_size": 4,
    },
}


class Engine:
    """One configuration's engine, warmed up; `run` times one group of prompts."""

    def __init__(self, spec: dict | None, ns: argparse.Namespace, warm_prompt: list[int]) -> None:
        self.llm = LLM(
            speculative_config=spec,
            async_scheduling=not ns.no_async,
            enable_prefix_caching=False,
            worker_mode=ns.worker_mode,
            **({"kv_cache_memory": 0.25} if ns.interleave == "prompt" else {}),
        )
        self.params = SamplingParams(temperature=0, max_tokens=ns.max_tokens, ignore_eos=True)
        self.llm.generate(
            [{"prompt_token_ids": warm_prompt}], SamplingParams(max_tokens=4), use_tqdm=False
        )
        self.before = self.llm.get_stats()

    def run(self, group: list[list[int]]) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in group], self.params, use_tqdm=False
        )
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]

    def finish(self) -> dict:
        stats = self.llm.get_stats()
        self.llm.shutdown()
        steps = stats["num_steps"] - self.before["num_steps"]
        tokens = stats["num_generation_tokens"] - self.before["num_generation_tokens"]
        acceptance = per_position = None
        if "spec_num_drafts" in stats:  # this run only (the warm-up run drafted too)
            drafts, accepted = (
                [a - b for a, b in zip(stats[k], self.before[k], strict=True)]
                for k in ("spec_num_drafts_per_position", "spec_num_accepted_per_position")
            )
            acceptance = sum(accepted) / sum(drafts) if sum(drafts) else None
            per_position = [a / d if d else 0.0 for a, d in zip(accepted, drafts, strict=True)]
        return {
            "acceptance": acceptance,
            "per_position": per_position,
            "tokens_per_step": tokens / max(1, steps),
        }


def groups_of(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    return [prompts[i : i + batch] for i in range(0, len(prompts), batch)]


def measure(
    spec: dict | None, prompts: list[list[int]], batch: int, ns: argparse.Namespace
) -> dict:
    """One round of one configuration: a fresh engine, every prompt group once."""
    eng = Engine(spec, ns, prompts[0])
    elapsed, outs = 0.0, []
    for group in groups_of(prompts, batch):
        t, o = eng.run(group)
        elapsed, outs = elapsed + t, outs + o
    return {"tok_s": len(prompts) * ns.max_tokens / elapsed, "outputs": outs, **eng.finish()}


def rounds_by_config(
    names: list[str], prompts: list[list[int]], batch: int, ns: argparse.Namespace, title: str
) -> dict[str, list[dict]]:
    """--interleave config: each round runs every configuration in turn (fresh engines)."""
    runs: dict[str, list[dict]] = {n: [] for n in names}
    bar = tqdm(total=ns.repeats * len(names), desc=title, unit="run", leave=False)
    for _ in range(ns.repeats):
        for name in names:
            runs[name].append(measure(CONFIGS[name], prompts, batch, ns))
            bar.update(1)
    bar.close()
    return runs


def rounds_by_prompt(
    names: list[str], prompts: list[list[int]], batch: int, ns: argparse.Namespace, title: str
) -> dict[str, list[dict]]:
    """--interleave prompt: every engine stays up; each prompt group runs on every
    configuration in turn (the order rotating per group), so a drift of the machine's
    speed hits all configurations alike within seconds, not minutes."""
    engines = {n: Engine(CONFIGS[n], ns, prompts[0]) for n in names}
    runs: dict[str, list[dict]] = {n: [] for n in names}
    groups = groups_of(prompts, batch)
    bar = tqdm(total=ns.repeats * len(groups) * len(names), desc=title, unit="run", leave=False)
    for r in range(ns.repeats):
        took = {n: 0.0 for n in names}
        outs: dict[str, list[list[int]]] = {n: [] for n in names}
        for g, group in enumerate(groups):
            shift = (r * len(groups) + g) % len(names)
            for name in names[shift:] + names[:shift]:
                t, o = engines[name].run(group)
                took[name] += t
                outs[name] += o
                bar.update(1)
        for n in names:
            runs[n].append({"tok_s": len(prompts) * ns.max_tokens / took[n], "outputs": outs[n]})
    bar.close()
    for n in names:
        final = engines[n].finish()
        for run in runs[n]:
            run.update(final)
    return runs


def run_case(
    names: list[str], prompts: list[list[int]], batch: int, ns: argparse.Namespace, title: str
) -> list[dict]:
    """Interleaved rounds; per configuration the median tok/s and median ratio."""
    by = rounds_by_prompt if ns.interleave == "prompt" else rounds_by_config
    runs = by(names, prompts, batch, ns, title)
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
    ap.add_argument("--worker-mode", default="process", choices=("thread", "process"))
    ap.add_argument(
        "--interleave",
        default="config",
        choices=("config", "prompt"),
        help="config: a round runs each configuration on a fresh engine in turn; prompt: all "
        "engines stay up and each prompt group runs on every configuration in turn "
        "(finer interleaving; use with --worker-mode process)",
    )
    ap.add_argument(
        "--cases", default="chat,repeat,concurrent", help="comma-separated subset of the cases"
    )
    ap.add_argument(
        "--config",
        action="append",
        default=None,
        help="a configuration to keep in every case, by name; repeat for more (default: all; "
        '"no speculation" always runs, as the baseline)',
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
            ["no speculation", "ngram k=3", "mtp k=1", "mtp k=1, ngram_first", tree],
        ),
        "concurrent": (
            f"chat prompts x2, {ns.concurrency} concurrent",
            (chat * ns.concurrency)[: ns.concurrency],
            ns.concurrency,
            [
                "no speculation",
                "mtp k=1",
                "mtp k=1, ngram_first",
                tree,
                "ngram k=3",
                f"{tree}, disable_by_batch_size=4",
            ],
        ),
    }
    mode = (
        f"async {'off' if ns.no_async else 'on'}, worker {ns.worker_mode}, "
        f"interleaved by {ns.interleave}"
    )
    keep = None
    if ns.config:
        keep = {"no speculation", *ns.config}
        unknown = sorted(keep - set(CONFIGS))
        if unknown:
            ap.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    rows = []
    for key in ns.cases.split(","):
        if key not in cases:
            ap.error(f"unknown case {key!r}; known: {', '.join(cases)}")
        title, prompts, batch, names = cases[key]
        names = [n for n in names if keep is None or n in keep]
        got = run_case(names, prompts, batch, ns, title)
        print_table(title, mode, got, ns)
        rows += got
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
