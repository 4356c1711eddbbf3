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
