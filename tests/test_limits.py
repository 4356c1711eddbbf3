"""A `max_model_len` beyond the checkpoint's limit is refused before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from laneserve.engine_args import EngineArgs
from laneserve.model.limits import context_limit


def test_limits_read_without_loading(tiny_models: dict[str, Path]) -> None:
    assert context_limit(str(tiny_models["llama"])) == 512  # config.json
    assert context_limit(None) == 8192  # the embedded GGUF's header
    assert context_limit("/no/such/model") is None  # the loader reports that one


def test_too_long_context_refused_before_the_load(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"max_model_len=100000 exceeds the model's limit of 8192"):
        EngineArgs(max_model_len=100_000).create_config()
    with pytest.raises(ValueError, match="limit of 512 tokens"):
        EngineArgs(model=str(tiny_models["llama"]), max_model_len=513).create_config()
    EngineArgs(model=str(tiny_models["llama"]), max_model_len=512).create_config()
