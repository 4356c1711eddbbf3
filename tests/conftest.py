import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# NOTE: the tests keep the model in their own process (a faster start, and several read
# the worker's counters in place); the process default is covered where it is named
# (tests/test_cli.py, tests/worker/test_worker_process.py, every server test)
os.environ.setdefault("LANESERVE_WORKER_MODE", "thread")

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random checkpoints: llama (llama3 rope), qwen2 (biases), qwen3 (q/k norm, tied)."""
    from tests.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": build_tiny_model(root / "llama", "llama", seed=1),
        "qwen2": build_tiny_model(root / "qwen2", "qwen2", seed=2),
        "qwen3": build_tiny_model(root / "qwen3", "qwen3", seed=3, tie=True),
    }


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
