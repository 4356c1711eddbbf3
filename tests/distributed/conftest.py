from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tp_deepseek(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random DeepSeek V3 (with its MTP layer) and V2 checkpoints (release layout)."""
    from tests.tiny_models import add_mtp_layer, build_tiny_deepseek

    root = tmp_path_factory.mktemp("tp_deepseek")
    return {
        "v3": add_mtp_layer(build_tiny_deepseek(root / "v3", 3, seed=1), seed=5),
        "v2": build_tiny_deepseek(root / "v2", 2, seed=2),
    }
