"""--generation-config: "auto" / a folder make the checkpoint's generation_config.json
the defaults of unset sampling fields; "vllm" ignores it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from laneserve import LLM, SamplingParams
from laneserve.frontend.generation_config import generation_defaults

PROMPT = {"prompt_token_ids": [5, 17, 42, 9, 100]}


def test_defaults_read_from_the_file(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "max_new_tokens": 7,
                "repetition_penalty": None,
                "bos_token_id": 1,
            }
        )
    )
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7}
    assert generation_defaults("auto", tmp_path) == want
    assert generation_defaults(str(tmp_path), Path("/nowhere")) == want
    assert generation_defaults("vllm", tmp_path) == {}
    assert generation_defaults("auto", tmp_path / "empty") == {}
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        generation_defaults(str(tmp_path / "empty"), tmp_path)


def test_offline_defaults_follow_the_checkpoint(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], model)
    (model / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3})
    )
    greedy3 = SamplingParams(temperature=0, max_tokens=3)
    with LLM(str(model), dtype="float32", generation_config="auto") as llm:
        assert llm.engine.sampling_defaults == {"temperature": 0.0, "max_tokens": 3}
        got = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids
        assert got == llm.generate([PROMPT], greedy3, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(model), dtype="float32", generation_config="vllm") as llm:
        assert llm.engine.sampling_defaults == {}
