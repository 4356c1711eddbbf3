"""Prompt logprobs: the logprob of each prompt token given its prefix, taken from the
same forward as the prefill chunk that computes it.

A prefill chunk over positions [s, s + n) of a prompt of length L predicts the
prompt tokens at positions s + 1 .. min(s + n, L - 1): the hidden state at
position p gives the logits of the token at p + 1. The last prompt position's
logits are the sampling row's (the first output token), not a prompt logprob.
Position 0 has no prefix, so it never gets one (the frontend reports None there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from laneserve.protocol import RequestOutput, ScheduledRequest, TokenLogprobs
from laneserve.sample.sampler import compute_logprobs
from laneserve.worker.input_batch import WorkerRequest


@dataclass(frozen=True)
class PromptSpan:
    """One prefill row's prompt logprobs: `count` entries from `first_position`."""

    handle: int
    first_position: int  # prompt position of the first predicted token
    count: int
    num_top: int  # the request's prompt_logprobs
    offset: int  # its first entry among the step's [P] rows


@dataclass
class PromptRows:
    token_idx: torch.Tensor  # [P] int64 forward token row whose logits predict the target
    targets: torch.Tensor  # [P] int64 the prompt token at the next position
    num_top: int  # most top logprobs any span asks for
    spans: list[PromptSpan]


def plan(
    sched: Sequence[ScheduledRequest],
    reqs: Sequence[WorkerRequest],
    starts: np.ndarray,  # [R + 1] first forward token of each row
    upload: Callable[[list], torch.Tensor],
) -> PromptRows | None:
    """The step's prompt-logprob rows (None: no prefill row asks for them)."""
    token_idx: list[int] = []
    targets: list[int] = []
    spans: list[PromptSpan] = []
    for r, (s, req) in enumerate(zip(sched, reqs, strict=True)):
        k = req.params.prompt_logprobs
        if s.decode or k is None:
            continue
        prompt = req.prompt_token_ids
        count = min(s.start + s.num_tokens, len(prompt) - 1) - s.start
        if count <= 0:  # a recompute past the prompt (after preemption)
            continue
        spans.append(PromptSpan(s.handle, s.start + 1, count, k, len(token_idx)))
        first = int(starts[r])
        token_idx.extend(range(first, first + count))
        targets.extend(prompt[s.start + 1 : s.start + 1 + count])
    if not spans:
        return None
    num_top = max(sp.num_top for sp in spans)
    return PromptRows(upload(token_idx), upload(targets), num_top, spans)


def compute(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,  # [T, H] the forward's hidden states
    rows: PromptRows,
) -> tuple[torch.Tensor, ...]:
    """(logprob [P], rank [P], top ids [P, n], top logprobs [P, n]) on the device."""
    logits = compute_logits(hidden.index_select(0, rows.token_idx))
    return compute_logprobs(logits, rows.targets, rows.num_top)


def attach(
    rows: PromptRows, values: tuple[torch.Tensor, ...], outputs: list[RequestOutput]
) -> None:
    """Put each span's entries on its request's output (a new one for a prefill chunk
    that does not sample)."""
    chosen, rank, top_ids, top_lp = (t.tolist() for t in values)
    targets = rows.targets.tolist()
    by_handle = {o.handle: o for o in outputs}
    for sp in rows.spans:
        out = by_handle.get(sp.handle)
        if out is None:
            out = RequestOutput(sp.handle, [])
            outputs.append(out)
        idx = range(sp.offset, sp.offset + sp.count)
        out.prompt_logprobs = [
            TokenLogprobs(
                targets[i], chosen[i], rank[i], top_ids[i][: sp.num_top], top_lp[i][: sp.num_top]
            )
            for i in idx
        ]
        out.prompt_start = sp.first_position
