"""The output lane's product: a step's device results read back into a StepResult
(emitted tokens per request, their logprobs, drafts verified, prompt logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laneserve.protocol import RequestError, RequestOutput, StepResult, TokenLogprobs
from laneserve.worker import prompt_logprobs
from laneserve.worker.step_inputs import StepInputs


@dataclass
class DeviceOutputs:
    inputs: StepInputs
    tokens: torch.Tensor | None  # [Rs, 1 + max_spec] emitted tokens (padded)
    num_emitted: torch.Tensor | None  # [Rs]
    logprobs: tuple[torch.Tensor, ...] | None  # chosen, rank, top ids, top lps per logits row
    num_drafts: torch.Tensor | None  # [Rs] real drafts verified (None: no speculation)
    errors: list[RequestError]
    prompt_logprobs: tuple[torch.Tensor, ...] | None = None  # see prompt_logprobs.py


def reclaim(out: DeviceOutputs) -> StepResult:
    inp = out.inputs
    if out.errors:
        return StepResult(step_id=inp.step_id, errors=out.errors)
    outputs = _sampled_outputs(out) if out.tokens is not None else []
    if out.prompt_logprobs is not None:
        assert inp.prompt_rows is not None
        prompt_logprobs.attach(inp.prompt_rows, out.prompt_logprobs, outputs)
    return StepResult(step_id=inp.step_id, outputs=outputs)


def _sampled_outputs(out: DeviceOutputs) -> list[RequestOutput]:
    inp = out.inputs
    assert out.tokens is not None and out.num_emitted is not None
    tokens = out.tokens.tolist()
    emitted = out.num_emitted.tolist()
    lp = _logprobs_lists(out) if out.logprobs is not None else None
    sampled = [r for r in inp.rows if r.sample]
    outputs = []
    drafts = out.num_drafts.tolist() if out.num_drafts is not None else None
    for i, row in enumerate(sampled):
        toks = tokens[i][: emitted[i]]
        logprobs = []
        if lp is not None and row.num_logprobs is not None:
            logprobs = [_trim(lp[(i, j)], row.num_logprobs) for j in range(len(toks))]
        nd = drafts[i] if drafts is not None else 0
        outputs.append(RequestOutput(row.handle, toks, logprobs, nd, len(toks) - 1))
    return outputs


def _logprobs_lists(out: DeviceOutputs) -> dict[tuple[int, int], TokenLogprobs]:
    rows = out.inputs.sample_rows
    assert out.logprobs is not None and out.tokens is not None
    chosen, rank, top_ids, top_lp = (t.tolist() for t in out.logprobs)
    tokens = out.tokens.tolist()
    offs = rows.offset.tolist()
    table = {}
    for n, (i, j) in enumerate(zip(rows.row_host, offs, strict=True)):
        table[(i, j)] = TokenLogprobs(tokens[i][j], chosen[n], rank[n], top_ids[n], top_lp[n])
    return table


def _trim(x: TokenLogprobs, n: int) -> TokenLogprobs:
    return TokenLogprobs(x.token_id, x.logprob, x.rank, x.top_ids[:n], x.top_logprobs[:n])
