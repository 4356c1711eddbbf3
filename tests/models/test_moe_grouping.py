"""Routed experts grouped on the device (`StackedExperts`) against grouping on the host
(`grouped_experts`): bit-identical in fp32, no host read, chosen by kernels, and a
grouped matmul that refuses leaves the host path in place."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from laneserve.engine_args import EngineArgs
from laneserve.kernels.reference import TorchKernels
from laneserve.model.layers.linear import Linear
from laneserve.model.layers.moe import MoE, StackedExperts, grouped_experts
from laneserve.worker.worker import Worker
from tests.host_reads import no_host_reads


def _experts(e: int, h: int, i: int, seed: int) -> tuple[list[Linear], list[Linear]]:
    gen = torch.Generator().manual_seed(seed)
    k = TorchKernels()
    w13 = [Linear(k, torch.randn(2 * i, h, generator=gen), None) for _ in range(e)]
    w2 = [Linear(k, torch.randn(h, i, generator=gen), None) for _ in range(e)]
    return w13, w2


def _on_host(
    w13: list[Linear], w2: list[Linear], x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    k = TorchKernels()

    def expert(e: int, rows: torch.Tensor, _: int | None) -> torch.Tensor:
        return w2[e](k.silu_and_mul(w13[e](rows)))

    return grouped_experts(x, weights, ids, expert)


@pytest.mark.parametrize("tokens", [1, 2, 13])
def test_device_grouping_equals_host_grouping(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random routings (some experts unused, some shared by many tokens): the same bits,
    and no host read on the device path."""
    e, h, i, k = 8, 48, 24, 3
    w13, w2 = _experts(e, h, i, seed=tokens)
    stacked = StackedExperts.build(TorchKernels(), w13, w2)
    assert stacked is not None and stacked.w13.shape == (e, 2 * i, h)
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, h, generator=gen)
    ids = torch.stack([torch.randperm(e - 2, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    with no_host_reads(monkeypatch):
        got = stacked(x, weights, ids)
    assert torch.equal(got, _on_host(w13, w2, x, weights, ids))


def test_stacking_keeps_one_copy_of_the_weights() -> None:
    w13, w2 = _experts(4, 16, 8, seed=0)
    stacked = StackedExperts.build(TorchKernels(), w13, w2)
    assert stacked is not None
    for e, (a, b) in enumerate(zip(w13, w2, strict=True)):
        assert a.weight.data.data_ptr() == stacked.w13[e].data_ptr()
        assert b.weight.data.data_ptr() == stacked.w2[e].data_ptr()


def test_a_refusing_grouped_matmul_leaves_host_grouping(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("grouped gemm is not supported for this dtype")

    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    w13, w2 = _experts(4, 16, 8, seed=1)
    with caplog.at_level(logging.INFO, logger="laneserve.model.layers.moe"):
        assert StackedExperts.build(TorchKernels(), w13, w2) is None
    assert "grouped on the host" in caplog.text


@pytest.mark.parametrize("use_kernels", [True, False])
def test_kernels_choose_the_grouping(deepseek_models: dict[str, Path], use_kernels: bool) -> None:
    """CPU kernels group on the host (their packed weights, decode / prompt rows split);
    torch kernels on the device."""
    args = EngineArgs(model=str(deepseek_models["v3"]), dtype="float32", use_kernels=use_kernels)
    worker = Worker(args.create_config())
    moes = [layer.mlp for layer in worker.model.layers if isinstance(layer.mlp, MoE)]
    worker.shutdown()
    assert moes and all((m.stacked is None) == use_kernels for m in moes)
