"""Greedy k=1 acceptance of an MTP head on three prompt sets, in one run:
prompts the trainer used, prompts it held out (unseen topics and templates),
and free-form chat prompts. A large gap between the first and the others
means the head memorised its data.

    .venv/bin/python benchmarks/mtp_acceptance.py [--draft-weights head.safetensors]
        [--tree "[(0,), (1,), (2,)]"]   # acceptance of the head's top-3 instead of its top-1
        [--ngram-first]                 # prompt-lookup drafts first, the head's elsewhere
"""

from __future__ import annotations

import argparse

from laneserve import LLM, SamplingParams
from laneserve.spec_decode.mtp_prompts import heldout_prompts, prompt_ids, training_prompts

CHAT = [
    "Explain why the sky is blue.",
    "Write a short story about a lighthouse keeper.",
    "Give me three tips for learning a new language.",
    "What is the difference between weather and climate?",
    "Explain glaciers to a ten-year-old.",
    "List five interesting facts about owls.",
    "Write a short poem about autumn rain.",
    "Why is sleep important?",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft-weights", default=None, help="default: the shipped head")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tree", default=None, help="a speculative_token_tree (default: k=1)")
    ap.add_argument("--ngram-first", action="store_true", help='"ngram_first": true')
    ns = ap.parse_args()
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    if ns.tree:
        spec = {"method": "mtp", "speculative_token_tree": ns.tree}
    if ns.draft_weights:
        spec["draft_weights"] = ns.draft_weights
    if ns.ngram_first:
        spec["ngram_first"] = True
    llm = LLM(speculative_config=spec, enable_prefix_caching=False)
    tok = llm.engine.tokenizer
    sets = {
        "training prompts (chat)": [p for p in training_prompts(40) if p[1]][:8],
        "training prompts (raw text)": [p for p in training_prompts(40) if not p[1]][:8],
        "held-out prompts": heldout_prompts(8),
        "free chat prompts": [(c, True) for c in CHAT],
    }
    params = SamplingParams(temperature=0, max_tokens=ns.max_tokens)
    print("| prompts | drafts | accepted | acceptance |\n|---|---:|---:|---:|")
    for name, prompts in sets.items():
        before = llm.get_stats()
        batch = [{"prompt_token_ids": prompt_ids(tok, text, chat)} for text, chat in prompts]
        llm.generate(batch, params, use_tqdm=False)
        after = llm.get_stats()
        drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
        accepted = after["spec_num_accepted"] - before["spec_num_accepted"]
        print(f"| {name} | {drafts} | {accepted} | {100 * accepted / max(1, drafts):.1f} % |")
    llm.shutdown()


if __name__ == "__main__":
    main()
