"""Peers timed side by side on a shared machine: every peer is loaded once, then the timed
runs are interleaved (A, B, C, A, B, C, ...) and each peer's median counts.

A load spike on a shared machine then lands on one repetition of every peer alike
instead of on all the repetitions of one of them, and the median drops the repetition it
hit. Ratios between peers of one sitting are what such a run can tell; the absolute
figures move with the machine's load.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from laneserve import LLM, SamplingParams

Batch = list[list[int]]
RunFn = Callable[[Batch], None]  # generates `tokens` new tokens for every prompt of a batch


@contextmanager
def laneserve_peer(
    model: Path, dtype: str, tokens: int, stats: dict | None = None, **kw: object
) -> Iterator[RunFn]:
    """An open `LLM` (greedy, EOS ignored, prefix caching off) for the span of the block;
    `stats`, if given, receives its `get_stats()` before it closes."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(str(model), dtype=dtype, enable_prefix_caching=False, **kw) as llm:

        def run(batch: Batch) -> None:
            llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)

        yield run
        if stats is not None:
            stats.update(llm.get_stats())


def load_transformers(model: Path, dtype: str, tokens: int) -> tuple[Any, Any, str]:
    """(transformers model, greedy config for exactly `tokens` new tokens, device)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch_dtype).to(device).eval()
    cfg = GenerationConfig(
        do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    return hf, cfg, device


@contextmanager
def transformers_peer(model: Path, dtype: str, tokens: int) -> Iterator[RunFn]:
    """transformers `generate` on `model` (greedy, exactly `tokens` new tokens)."""
    hf, cfg, device = load_transformers(model, dtype, tokens)

    def run(batch: Batch) -> None:
        ids = torch.tensor(batch, device=device)  # equal lengths: no padding
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        if device == "cuda":
            torch.cuda.synchronize()

    yield run


def interleaved(peers: dict[str, RunFn], batch: Batch, repeats: int) -> dict[str, list[float]]:
    """Seconds of each peer's `repeats` timed runs of `batch`, taken in turn (one warm-up
    run of each first, at this batch size)."""
    for run in peers.values():
        run(batch)
    times: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(repeats):
        for name, run in peers.items():
            start = time.perf_counter()
            run(batch)
            times[name].append(time.perf_counter() - start)
    return times


def tok_s(times: dict[str, list[float]], tokens: int) -> dict[str, float]:
    """Each peer's median throughput (new tokens per second) over its runs."""
    return {name: tokens / statistics.median(ts) for name, ts in times.items()}


@contextmanager
def open_peers(
    makers: dict[str, Callable[[], AbstractContextManager[RunFn]]],
) -> Iterator[dict[str, RunFn]]:
    """Every peer opened (loaded) at once for the span of the block, closed after."""
    with ExitStack() as stack:
        yield {name: stack.enter_context(make()) for name, make in makers.items()}
