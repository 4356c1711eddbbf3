"""lm-evaluation-harness itself (`local-completions`) scores a small multiple-choice
task against `laneserve serve`: every per-choice loglikelihood equals transformers
fp32 on the same weights, and the accuracy is the one those loglikelihoods give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.server.conftest import Server
from tests.tiny_models import _cached_model

DATA = Path(__file__).parent / "data"
TASK = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
"""


def _hf_loglikelihood(model_dir: Path, ctx: list[int], cont: list[int]) -> float:
    with torch.no_grad():
        logits = _cached_model(str(model_dir))(torch.tensor([ctx + cont])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return sum(lp[len(ctx) + i - 1, t].item() for i, t in enumerate(cont))


# NOTE: slow (the harness itself and a transformers reference); its requests, reproduced
# one for one against transformers, run by default in test_echo_logprobs.py
@pytest.mark.slow
def test_lm_eval_local_completions_matches_transformers(
    server: Server, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    (tmp_path / "tiny_mc.yaml").write_text(TASK.format(data=DATA / "tiny_mc.jsonl"))
    model_dir = tiny_models["llama"]
    lm = LocalCompletionsAPI(
        model="tiny",
        base_url=f"{server.url}/v1/completions",
        tokenizer=str(model_dir),
        tokenizer_backend="huggingface",
        batch_size=8,
        max_length=256,
        max_retries=1,
    )
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    assert out is not None
    samples = out["samples"]["tiny_mc"]
    items = [json.loads(line) for line in (DATA / "tiny_mc.jsonl").read_text().splitlines()]
    assert len(samples) == len(items)
    correct = 0
    for s in samples:
        got = [r[0][0] for r in s["resps"]]  # one [(loglikelihood, is_greedy)] per choice
        want = []
        for context, continuation in s["arguments"]:
            ctx, cont = lm._encode_pair(context, continuation)  # lm-eval's own split
            want.append(_hf_loglikelihood(model_dir, ctx, cont))
        assert got == pytest.approx(want, abs=1e-4)
        correct += int(max(range(len(want)), key=want.__getitem__) == s["doc"]["gold"])
    assert out["results"]["tiny_mc"]["acc,none"] == pytest.approx(correct / len(samples))
