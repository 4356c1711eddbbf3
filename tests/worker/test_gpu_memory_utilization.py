"""--gpu-memory-utilization's KV budget: F x device memory - what the weights took
(the device's numbers are stubbed: the arithmetic and the errors are under test)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from laneserve.worker.worker import kv_budget_from_utilization

GIB = 2**30


def test_budget_is_the_fraction_less_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(total_memory=100 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 30 * GIB)
    cuda = torch.device("cuda", 0)
    assert kv_budget_from_utilization(cuda, 0.9) == 60 * GIB
    with pytest.raises(ValueError, match=r"weights already use 30\.00 of the 20\.00 GiB"):
        kv_budget_from_utilization(cuda, 0.2)


def test_cpu_is_refused_with_the_cpu_setting_named() -> None:
    with pytest.raises(ValueError, match=r"CUDA devices only.*--kv-cache-memory"):
        kv_budget_from_utilization(torch.device("cpu"), 0.9)
