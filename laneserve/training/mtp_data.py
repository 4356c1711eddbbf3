"""Self-distillation data for the MTP trainer: the frozen base model generates
greedy text from a fixed set of prompts (`mtp_prompts.py`) while a tap on the model runner
records the target's normed hidden state at every position.

A sample is one sequence: token ids (prompt + output), the hidden states
[len - 1, H] of every position that was an input, and the prompt length.
Greedy outputs make t[i+2] exactly the base model's own next-next token.

Generation is the long part of training on a CPU (≈ 20 of the default model's 28
minutes), so with a shard directory each generation batch is saved as it finishes
(`<name>-<first prompt>-<end>.pt`), and a resumed run keeps the shards that tile the
prompt list from its start and generates only the rest. Greedy decoding with
batch-invariant kernels makes the resumed data equal to an uninterrupted run's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from laneserve.training.mtp_prompts import prompt_ids
from laneserve.worker.worker import Worker

if TYPE_CHECKING:
    from laneserve.frontend.llm import LLM

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
        token_row = inp.per_token.row.tolist()
        pos = positions.tolist()
        h = hidden.to(torch.bfloat16).cpu()
        for t, (row, p) in enumerate(zip(token_row, pos, strict=True)):
            self.rows.setdefault(handles[row], {})[p] = h[t]


def in_process_worker(llm: LLM) -> Worker:
    """The trainer taps the model runner and reads the loaded model: it needs the worker
    in this process (worker_mode thread), not a spawned one."""
    worker = getattr(llm.engine.client, "worker", None)
    if not isinstance(worker, Worker):
        raise ValueError("the MTP trainer needs the worker in this process (worker_mode thread)")
    return worker


def generate_samples(
    llm: LLM,
    prompts: list[tuple[str, bool]],
    max_new_tokens: int,
    batch: int,
    desc: str,
    shards: ShardDir | None = None,
) -> list[Sample]:
    """Greedy generations of the base model with their hidden states (resumed from
    `shards` where they cover the prompts' start, and saved there batch by batch)."""
    from laneserve.sampling_params import SamplingParams

    tok = llm.engine.tokenizer
    runner = in_process_worker(llm).runner
    tap = HiddenTap()
    runner.capture = tap
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    samples: list[Sample] = []
    done = 0
    if shards is not None:
        samples, done = shards.load(prompts, max_new_tokens)
        if done:
            log.info("%s: resumed %d of %d prompts from %s", desc, done, len(prompts), shards.path)
    bar = tqdm(total=len(prompts), initial=done, desc=desc, unit="prompt")
    try:
        for start in range(done, len(prompts), batch):
            chunk = prompts[start : start + batch]
            ids = [prompt_ids(tok, text, chat) for text, chat in chunk]
            handles_before = set(tap.rows)
            outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
            new_handles = sorted(set(tap.rows) - handles_before)
            got = [
                s
                for handle, prompt, out in zip(new_handles, ids, outs, strict=True)
                if (s := _sample(tap.rows.pop(handle), prompt, out.outputs[0].token_ids))
            ]
            if shards:
                shards.save(start, chunk, max_new_tokens, got)
            samples += got
            bar.update(len(chunk))
    finally:
        bar.close()
        runner.capture = None
    log.info(
        "collected %d sequences, %d positions", len(samples), sum(len(s.tokens) for s in samples)
    )
    return samples


def _sample(by_pos: dict[int, torch.Tensor], prompt: list[int], output: list[int]) -> Sample | None:
    seq = prompt + output
    if len(seq) < len(prompt) + 2 or any(p not in by_pos for p in range(len(seq) - 1)):
        return None  # too short to teach anything (or a position was never an input)
    return Sample(seq, torch.stack([by_pos[p] for p in range(len(seq) - 1)]), len(prompt))


class ShardDir:
    """Generation batches saved one file each, so that an interrupted run can resume."""

    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = path, name

    def files(self) -> list[tuple[int, int, Path]]:
        """(first prompt, end, file) of every shard, in prompt order."""
        found = []
        for f in self.path.glob(f"{self.name}-*-*.pt"):
            first, end = f.stem.rsplit("-", 2)[1:]
            if first.isdigit() and end.isdigit():
                found.append((int(first), int(end), f))
        return sorted(found)

    def load(
        self, prompts: list[tuple[str, bool]], max_new_tokens: int
    ) -> tuple[list[Sample], int]:
        """The samples of the shards that tile prompts[0:done], and done."""
        samples: list[Sample] = []
        done = 0
        for first, end, f in self.files():
            if first != done:
                break
            d = torch.load(f)
            _check_made_for(f, d, prompts[first:end], max_new_tokens)
            samples += [Sample(**s) for s in d["samples"]]
            done = end
        return samples, done

    def file(self, first: int, end: int) -> Path:
        return self.path / f"{self.name}-{first:06d}-{end:06d}.pt"

    def save(
        self,
        first: int,
        prompts: list[tuple[str, bool]],
        max_new_tokens: int,
        samples: list[Sample],
    ) -> None:
        write_data(self.file(first, first + len(prompts)), prompts, max_new_tokens, samples)

    def clear(self) -> None:
        for _, _, f in self.files():
            f.unlink()


def _check_made_for(f: Path, d: dict, prompts: list[tuple[str, bool]], max_new_tokens: int) -> None:
    """Refuse data (a shard or a data file) generated for other prompts or settings."""
    if d["prompts"] != [list(p) for p in prompts] or d["max_new_tokens"] != max_new_tokens:
        raise ValueError(
            f"{f} was generated for other prompts or --max-new-tokens; "
            "remove it (or run without --resume)"
        )


def write_data(
    f: Path, prompts: list[tuple[str, bool]], max_new_tokens: int, samples: list[Sample]
) -> None:
    """Samples with the prompts and setting they were generated for (a shard or a data file)."""
    d = {
        "prompts": [list(p) for p in prompts],
        "max_new_tokens": max_new_tokens,
        "samples": [s.__dict__ for s in samples],
    }
    torch.save(d, f.with_suffix(".tmp"))
    f.with_suffix(".tmp").replace(f)  # complete or absent


def collect(
    llm,
    path: Path,
    prompts: list[tuple[str, bool]],
    max_new_tokens: int,
    batch: int,
    name: str,
    resume: bool,
) -> list[Sample]:
    """The `name` data file `path` for these prompts: generated (batches saved as shards
    beside it), or with `resume` read back, or extended if it holds a start of the prompts."""
    shards = ShardDir(path.parent, name)
    if resume and path.exists():
        found = _resume_file(path, prompts, max_new_tokens, shards)
        if found is not None:
            return found
    elif not resume:
        shards.clear()  # a fresh run: no batch of an earlier one
    desc = f"generating {name} data (self-distillation)"
    samples = generate_samples(llm, prompts, max_new_tokens, batch, desc, shards)
    write_data(path, prompts, max_new_tokens, samples)
    shards.clear()  # now in `path`
    return samples


def _resume_file(
    path: Path, prompts: list[tuple[str, bool]], max_new_tokens: int, shards: ShardDir
) -> list[Sample] | None:
    """The file's samples if it holds these prompts; None once a file holding a start of
    them has become the first shard (generation then makes only the rest)."""
    d = torch.load(path)
    if isinstance(d, list):  # written before data files recorded their prompts
        log.info("resumed %s data: %d sequences (no record of its prompts)", shards.name, len(d))
        return [Sample(**s) for s in d]
    have = len(d["prompts"])
    _check_made_for(path, d, prompts[:have], max_new_tokens)  # also if it holds more
    if have == len(prompts):
        log.info("resumed %s data: %d sequences", shards.name, len(d["samples"]))
        return [Sample(**s) for s in d["samples"]]
    log.info("extending %s: it holds %d of %d prompts", path, have, len(prompts))
    path.replace(shards.file(0, have))
    return None
