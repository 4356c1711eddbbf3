"""Speculative decoding on the embedded model, in one run: no speculation vs MTP
(the shipped head) vs n-gram, batch 1 and N concurrent, greedy, fixed length.

Every configuration runs the same prompts; the table prints tokens/s, the
ratio to no speculation, the acceptance rate and the mean accepted length, and
checks that every output equals the no-speculation output token for token.

    .venv/bin/python benchmarks/bench_spec.py --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time

from laneserve import LLM, SamplingParams

CHAT = [
    "Explain why the sky is blue.",
    "Write a short story about a lighthouse keeper.",
    "Give me three tips for learning a new language.",
    "What is the difference between weather and climate?",
]
REPEAT = "Repeat this paragraph twice, word for word: The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun all afternoon, and the fox runs back into the forest."

CONFIGS = {
    "no speculation": None,
    "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
    "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2},
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3},
    "mtp k=1, disable_by_batch_size=4": {
        "method": "mtp",
        "num_speculative_tokens": 1,
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
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
        outs += [o.outputs[0].token_ids for o in llm.generate(group, params, use_tqdm=False)]
    elapsed = time.perf_counter() - start
    stats = llm.get_stats()
    llm.shutdown()
    steps_tokens = stats["num_generation_tokens"] / max(1, stats["num_steps"])
    return {
        "tok_s": len(prompts) * max_tokens / elapsed,
        "acceptance": stats.get("spec_acceptance_rate"),
        "per_position": stats.get("spec_acceptance_per_position"),
        "mean_accepted_len": 1
        + stats["spec_num_accepted"]
        / max(1, stats["spec_num_drafts"] / spec["num_speculative_tokens"])
        if spec
        else 1.0,
        "tokens_per_step": steps_tokens,
        "outputs": outs,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--no-async", action="store_true")
    ap.add_argument("--worker-mode", default="thread", choices=("thread", "process"))
    ns = ap.parse_args()
    first = LLM(enable_prefix_caching=False)
    tok = first.engine.tokenizer
    first.shutdown()  # only its tokenizer is needed
    chat = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    cases = [
        ("chat prompts, batch 1", chat, 1, list(CONFIGS)),
        (
            "repetition prompt, batch 1",
            [tok.apply_chat_template([{"role": "user", "content": REPEAT}])],
            1,
            ["no speculation", "ngram k=3", "mtp k=1"],
        ),
        (
            f"chat prompts x2, {ns.concurrency} concurrent",
            (chat * ns.concurrency)[: ns.concurrency],
            ns.concurrency,
            ["no speculation", "mtp k=1", "ngram k=3", "mtp k=1, disable_by_batch_size=4"],
        ),
    ]
    rows = []
    for title, prompts, batch, names in cases:
        base = None
        mode = f"async {'off' if ns.no_async else 'on'}, worker {ns.worker_mode}"
        print(f"\n{title} ({mode}, {ns.max_tokens} tokens, greedy)")
        print(
            "| config | tok/s | vs none | acceptance | per position | tokens/step | same output |"
        )
        print("|---|---:|---:|---:|---|---:|---|")
        for name in names:
            r = measure(
                CONFIGS[name], prompts, batch, ns.max_tokens, not ns.no_async, ns.worker_mode
            )
            base = base or r
            same = r["outputs"] == base["outputs"]
            acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
            per = (
                "-"
                if not r["per_position"]
                else ", ".join(f"{100 * a:.0f}%" for a in r["per_position"])
            )
            print(
                f"| {name} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | {acc} | {per} | {r['tokens_per_step']:.2f} | {same} |"
            )
            rows.append(
                {
                    "case": title,
                    "config": name,
                    **{k: v for k, v in r.items() if k != "outputs"},
                    "same_output": same,
                }
            )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
