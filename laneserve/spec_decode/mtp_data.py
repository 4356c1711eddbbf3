"""Self-distillation data for the MTP trainer: the frozen base model generates
greedy text from a fixed set of prompts while a tap on the model runner
records the target's normed hidden state at every position.

A sample is one sequence: token ids (prompt + output), the hidden states
[len - 1, H] of every position that was an input, and the prompt length.
Greedy outputs make t[i+2] exactly the base model's own next-next token.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

log = logging.getLogger(__name__)

TOPICS = [
    "lighthouses",
    "volcanoes",
    "photosynthesis",
    "the French Revolution",
    "machine learning",
    "coffee",
    "chess",
    "the moon",
    "bees",
    "bread baking",
    "electric cars",
    "the Roman Empire",
    "rainforests",
    "jazz",
    "black holes",
    "gardening",
    "the human heart",
    "recycling",
    "ancient Egypt",
    "solar power",
    "dinosaurs",
    "the internet",
    "climate change",
    "sleep",
    "mountains",
    "the ocean",
    "vaccines",
    "football",
    "painting",
    "trains",
    "friendship",
    "music theory",
    "earthquakes",
    "the printing press",
    "honey",
    "birds",
    "cities",
    "rivers",
    "programming in Python",
    "healthy breakfast",
    "winter",
    "time management",
    "robots",
    "the solar system",
    "tea",
    "deserts",
    "libraries",
    "bicycles",
    "whales",
    "museums",
    "airplanes",
    "the stock market",
    "pizza",
    "cats",
    "dogs",
    "yoga",
    "the brain",
    "glaciers",
    "electricity",
    "democracy",
    "the Olympic Games",
    "smartphones",
    "forests",
    "pirates",
    "the Great Wall of China",
    "chocolate",
    "astronauts",
    "volunteering",
    "photography",
    "knitting",
    "cryptography",
    "the water cycle",
    "castles",
    "hiking",
    "social media",
    "nutrition",
    "the Renaissance",
    "submarines",
    "video games",
    "wind energy",
    "tigers",
    "public speaking",
    "the periodic table",
    "coral reefs",
    "meditation",
    "bridges",
    "artificial intelligence",
    "rainbows",
    "spiders",
    "poetry",
    "the Amazon river",
    "first aid",
    "budgeting",
    "lightning",
    "penguins",
    "the violin",
    "mushrooms",
    "space telescopes",
    "origami",
    "tides",
]
TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write a short story about {t}.",
    "List five interesting facts about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a short poem about {t}.",
    "Give me a brief history of {t}.",
    "How would you describe {t} to someone who has never heard of it?",
    "Write an email to a friend about {t}.",
    "What are common misconceptions about {t}?",
    "Summarize the most important things to know about {t}.",
    "Why is {t} important?",
    "Write a dialogue between two friends talking about {t}.",
    "Give three tips for someone interested in {t}.",
    "Describe a typical day for someone who works with {t}.",
]
OPENINGS = [
    "The history of {t} begins",
    "Most people do not know that {t}",
    "In this article, we will look at {t} and",
    "Here is a simple guide to {t}:",
]


# Held-out prompts share neither topic nor template with the training prompts:
# accuracy on them estimates the acceptance on prompts the head never saw.
HELDOUT_TOPICS = [
    "glaciers", "owls", "autumn rain", "submarines", "jazz", "deserts", "bicycles",
    "the printing press", "octopuses", "wind turbines", "sourdough bread", "comets",
    "libraries", "marathons", "coral reefs", "typewriters",
]  # fmt: skip
HELDOUT_TEMPLATES = [
    "Tell me something surprising about {t}.",
    "Write a paragraph for a school textbook about {t}.",
    "How do {t} affect everyday life?",
    "Compare {t} with something similar and explain the differences.",
]


def heldout_prompts(limit: int) -> list[tuple[str, bool]]:
    pairs = [
        (tpl.format(t=t), True) for t, tpl in itertools.product(HELDOUT_TOPICS, HELDOUT_TEMPLATES)
    ]
    return pairs[:limit]


def training_prompts(limit: int) -> list[tuple[str, bool]]:
    """(text, is_chat) pairs: chat instructions and raw-text openings, interleaved."""
    chat = [(tpl.format(t=t), True) for tpl, t in itertools.product(TEMPLATES, TOPICS)]
    raw = [(o.format(t=t), False) for o, t in itertools.product(OPENINGS, TOPICS)]
    mixed = [p for pair in itertools.zip_longest(chat, raw) for p in pair if p is not None]
    return mixed[:limit]


def prompt_ids(tok, text: str, chat: bool) -> list[int]:
    """A (text, is_chat) prompt as token ids: a user turn in the chat template, or raw text."""
    return (
        tok.apply_chat_template([{"role": "user", "content": text}]) if chat else tok.encode(text)
    )


@dataclass
class Sample:
    tokens: list[int]  # prompt + generated output
    hidden: torch.Tensor  # [len(tokens) - 1, H] bf16: hidden of every input position
    prompt_len: int


class HiddenTap:
    """Collects (handle, position) -> hidden from ModelRunner.capture calls."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[int, torch.Tensor]] = {}

    def __call__(self, inp, ids, positions, hidden) -> None:
        handles = [r.handle for r in inp.rows]
        token_row = inp.token_row.tolist()
        pos = positions.tolist()
        h = hidden.to(torch.bfloat16).cpu()
        for t, (row, p) in enumerate(zip(token_row, pos, strict=True)):
            self.rows.setdefault(handles[row], {})[p] = h[t]


def generate_samples(
    llm, prompts: list[tuple[str, bool]], max_new_tokens: int, batch: int, desc: str
) -> list[Sample]:
    """Greedy generations of the base model with their hidden states."""
    from laneserve.sampling_params import SamplingParams

    tok = llm.engine.tokenizer
    runner = llm.engine.client.worker.runner
    tap = HiddenTap()
    runner.capture = tap
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    samples: list[Sample] = []
    try:
        for start in tqdm(range(0, len(prompts), batch), desc=desc, unit="batch"):
            chunk = prompts[start : start + batch]
            ids = [prompt_ids(tok, text, chat) for text, chat in chunk]
            handles_before = set(tap.rows)
            outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
            new_handles = sorted(set(tap.rows) - handles_before)
            for handle, prompt, out in zip(new_handles, ids, outs, strict=True):
                seq = prompt + out.outputs[0].token_ids
                by_pos = tap.rows.pop(handle)
                if len(seq) < len(prompt) + 2 or any(p not in by_pos for p in range(len(seq) - 1)):
                    continue  # too short to teach anything (or a position was never an input)
                hidden = torch.stack([by_pos[p] for p in range(len(seq) - 1)])
                samples.append(Sample(seq, hidden, len(prompt)))
    finally:
        runner.capture = None
    log.info(
        "collected %d sequences, %d positions", len(samples), sum(len(s.tokens) for s in samples)
    )
    return samples
