from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def deepseek_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random DeepSeek checkpoints: v3 (the layout of the family's issue config) and v2."""
    from tests.tiny_models import build_tiny_deepseek

    root = tmp_path_factory.mktemp("deepseek")
    return {
        "v3": build_tiny_deepseek(root / "v3", 3, seed=1),
        "v2": build_tiny_deepseek(root / "v2", 2, seed=2),
    }


@pytest.fixture(scope="session")
def deepseek_v4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DeepSeek V4 checkpoint (save_pretrained layout), see tiny_deepseek_v4."""
    from tests.models.tiny_deepseek_v4 import build_tiny_deepseek_v4

    return build_tiny_deepseek_v4(tmp_path_factory.mktemp("deepseek_v4") / "v4", seed=0)
