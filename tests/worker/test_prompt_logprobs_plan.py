"""Which forward rows predict which prompt tokens, per prefill chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laneserve.protocol import ScheduledRequest
from laneserve.sampling_params import SamplingParams
from laneserve.worker.input_batch import WorkerRequest
from laneserve.worker.prompt_logprobs import plan


def _req(handle: int, prompt: list[int], k: int | None) -> WorkerRequest:
    params = SamplingParams(prompt_logprobs=k)
    return WorkerRequest(handle, str(handle), prompt, params, [], None, handle, 0)


def _upload(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_chunks_decodes_and_recomputes() -> None:
    prompt = list(range(100, 110))  # 10 tokens
    sched = [
        ScheduledRequest(handle=0, num_tokens=1, start=12, decode=True),  # a decode: none
        ScheduledRequest(handle=1, num_tokens=4, start=0, sample=False),  # positions 0..3
        ScheduledRequest(handle=2, num_tokens=6, start=4),  # last chunk: positions 4..9
        ScheduledRequest(handle=3, num_tokens=3, start=10),  # recompute past the prompt
        ScheduledRequest(handle=4, num_tokens=10, start=0),  # did not ask
    ]
    reqs = [
        _req(0, prompt, 2),
        _req(1, prompt, 2),
        _req(2, prompt, 5),
        _req(3, prompt, 1),
        _req(4, prompt, None),
    ]
    starts = np.concatenate([[0], np.cumsum([s.num_tokens for s in sched])])
    rows = plan(sched, reqs, starts, _upload)
    assert rows is not None
    assert [(s.handle, s.first_position, s.count, s.offset) for s in rows.spans] == [
        (1, 1, 4, 0),  # predicts tokens 1..4 from positions 0..3
        (2, 5, 5, 4),  # tokens 5..9 from positions 4..8 (position 9 samples)
    ]
    assert rows.token_idx.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert rows.targets.tolist() == prompt[1:5] + prompt[5:10]
    assert rows.num_top == 5


@pytest.mark.parametrize("prompt", [[7], [7, 8]])
def test_short_prompts(prompt: list[int]) -> None:
    sched = [ScheduledRequest(handle=0, num_tokens=len(prompt), start=0)]
    rows = plan(sched, [_req(0, prompt, 0)], np.array([0, len(prompt)]), _upload)
    if len(prompt) == 1:
        assert rows is None  # the only position samples; nothing to predict
    else:
        assert rows is not None and rows.targets.tolist() == [8]


def test_sampling_params_bounds() -> None:
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
