"""Self-distillation data for the MTP trainer: the frozen base model generates
greedy text from a fixed set of prompts (`mtp_prompts.py`) while a tap on the model runner
records the target's normed hidden state at every position.

A sample is one sequence: token ids (prompt + output), the hidden states
[len - 1, H] of every position that was an input, and the prompt length.
Greedy outputs make t[i+2] exactly the base model's own next-next token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

from laneserve.spec_decode.mtp_prompts import prompt_ids

log = logging.getLogger(__name__)


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
