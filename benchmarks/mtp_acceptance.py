"""Greedy acceptance of MTP heads on several prompt sets, in one run: prompts the
trainer used, prompts it held out (unseen topics and templates), and free-form chat
prompts no training set contains. A large gap between the first and the others means
the head memorised its data. With several `--draft-weights`, one column per head.

    .venv/bin/python benchmarks/mtp_acceptance.py [--draft-weights head.safetensors ...]
        [--tree "[(0,), (1,), (2,)]"]   # acceptance of the head's top-3 instead of its top-1
        [--ngram-first]                 # prompt-lookup drafts first, the head's elsewhere
        [--ignore-eos]                  # every prompt runs --max-tokens (as bench_spec.py)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm import tqdm

from laneserve import LLM, SamplingParams
from laneserve.training.mtp_prompts import heldout_prompts, prompt_ids, training_prompts

CHAT = [
    "Explain why the sky is blue.",
    "Write a short story about a lighthouse keeper.",
    "Give me three tips for learning a new language.",
    "What is the difference between weather and climate?",
    "Explain glaciers to a ten-year-old.",
    "List five interesting facts about owls.",
    "Write a short poem about autumn rain.",
    "Why is sleep important?",
]  # the first 4 are bench_spec.py's chat prompts
FURTHER_CHAT = [  # written in stop 15 to compare heads; none is a training prompt
    "How do magnets attract metal?",
    "What is the difference between a cold and the flu?",
    "Why do bicycles not fall over when they move?",
    "Write a short story about a baker who wins a contest.",
    "How can I become a better listener?",
    "What makes music sound happy or sad?",
    "Why do we celebrate new year?",
    "Explain how a vending machine works.",
    "What should I know before adopting a rabbit?",
    "Describe a walk through an old library.",
    "Why do mosquitoes bite some people more than others?",
    "Give me three ideas for a science fair project.",
    "Why do we have leap years?",
    "What is the difference between a tortoise and a turtle?",
    "Write a short story about a lost umbrella.",
    "How can I keep my kitchen clean?",
    "Why do people get hiccups?",
    "Explain what a volcano eruption does to the air.",
    "What are some tips for a first trip abroad?",
    "How does a washing machine clean clothes?",
    "Write a poem about a quiet morning.",
    "What is the best way to memorize facts?",
    "Why are some rivers brown?",
    "Tell me how to make pancakes.",
    "What does a pilot do before a flight?",
    "Why do we use money instead of trading goods?",
    "Describe a thunderstorm from the point of view of a child.",
    "What is the difference between a sea and an ocean?",
]


def prompt_sets() -> dict[str, list[tuple[str, bool]]]:
    return {
        "training prompts (chat)": [p for p in training_prompts(40) if p[1]][:8],
        "training prompts (raw text)": [p for p in training_prompts(40) if not p[1]][:8],
        "held-out prompts": heldout_prompts(8),
        "free chat prompts": [(c, True) for c in CHAT],
        "bench_spec.py's 4 chat prompts": [(c, True) for c in CHAT[:4]],
        "held-out prompts (16)": heldout_prompts(16),
        f"further free chat prompts ({len(FURTHER_CHAT)})": [(c, True) for c in FURTHER_CHAT],
    }


def spec_config(ns: argparse.Namespace, weights: str | None) -> dict:
    spec: dict = {"method": "mtp", "num_speculative_tokens": 1}
    if ns.tree:
        spec = {"method": "mtp", "speculative_token_tree": ns.tree}
    if weights:
        spec["draft_weights"] = weights
    if ns.ngram_first:
        spec["ngram_first"] = True
    return spec


def acceptance(spec: dict, ns: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """(drafts, accepted) per prompt set."""
    llm = LLM(speculative_config=spec, enable_prefix_caching=False)
    tok = llm.engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=ns.max_tokens, ignore_eos=ns.ignore_eos)
    got = {}
    for name, prompts in tqdm(prompt_sets().items(), desc=spec.get("draft_weights", "shipped")):
        before = llm.get_stats()
        batch = [{"prompt_token_ids": prompt_ids(tok, text, chat)} for text, chat in prompts]
        llm.generate(batch, params, use_tqdm=False)
        after = llm.get_stats()
        got[name] = tuple(after[k] - before[k] for k in ("spec_num_drafts", "spec_num_accepted"))
    llm.shutdown()
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--draft-weights", action="append", default=None, help="repeatable; default: shipped"
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tree", default=None, help="a speculative_token_tree (default: k=1)")
    ap.add_argument("--ngram-first", action="store_true", help='"ngram_first": true')
    ap.add_argument("--ignore-eos", action="store_true")
    ns = ap.parse_args()
    heads = ns.draft_weights or [None]
    results = [acceptance(spec_config(ns, w), ns) for w in heads]
    names = [Path(w).name if w else "shipped head" for w in heads]
    print("| prompts | " + " | ".join(f"{n}: drafts, accepted" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for name in prompt_sets():
        cells = [f"{d}, {a} = {100 * a / max(1, d):.1f} %" for d, a in (r[name] for r in results)]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
