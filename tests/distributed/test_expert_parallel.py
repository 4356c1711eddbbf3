"""Expert parallelism: the routed experts divided over two gloo ranks give every MoE
layer the same bits as one rank holding them all, with prompt rows, hash routing and a
rank without tokens; ranks at different exchanges are caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.ep_ranks import run_rank
from tests.distributed.tp_ranks import spawn_ranks


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import add_mtp_layer, build_tiny_deepseek

    return add_mtp_layer(
        build_tiny_deepseek(tmp_path_factory.mktemp("ep") / "v3", 3, seed=3), seed=4
    )


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.tiny_deepseek_v4 import build_tiny_deepseek_v4

    return build_tiny_deepseek_v4(tmp_path_factory.mktemp("ep") / "v4", seed=0)


def _check(ranks: list[dict], idle: int) -> None:
    assert [r["local"][0] for r in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # E / D each
    assert all(r["experts_held"] == 4 for r in ranks)
    for rank, r in enumerate(ranks):
        if rank != idle:
            assert r["same"] and all(r["same"]), r["same"]
    # one exchange per layer on both ranks, the idle one's included
    assert ranks[0]["calls"] == ranks[1]["calls"] == len(ranks[0]["local"])
    assert all("exchange" in str(r["out_of_step"]) for r in ranks)


@pytest.mark.parametrize("idle", [1, pytest.param(-1, marks=pytest.mark.slow)])
def test_v3_moe_layers_equal_one_rank(v3: Path, tmp_path: Path, idle: int) -> None:
    ranks = spawn_ranks(run_rank, (str(v3), str(tmp_path), idle), tmp_path, limit_s=300)
    _check(ranks, idle)


@pytest.mark.slow
def test_v4_moe_layers_equal_one_rank(v4: Path, tmp_path: Path) -> None:
    """Hash-routed and learned layers, decode and prompt rows (the kernels' two paths)."""
    ranks = spawn_ranks(run_rank, (str(v4), str(tmp_path), 0), tmp_path, limit_s=300)
    _check(ranks, 0)
