"""The engine on two tensor-parallel ranks against the engine on one device."""

from __future__ import annotations

from collections.abc import Sequence

from laneserve import LLM
from tests.e2e.test_tiny_models import run


def two_ranks(model: str, **kw: object) -> LLM:
    """`LLM` with its worker split over two rank processes (fp32)."""
    return LLM(model, dtype="float32", tensor_parallel_size=2, worker_mode="process", **kw)


def assert_two_ranks_generate_what_one_device_does(
    model: str, prompts: list[list[int]], async_modes: Sequence[bool] = (False, True)
) -> None:
    """Greedy tokens of one batch on two ranks (each async mode) == on one device."""
    with LLM(model, dtype="float32") as llm:
        want = run(llm, prompts)
    for async_scheduling in async_modes:
        with two_ranks(model, async_scheduling=async_scheduling) as llm:
            assert run(llm, prompts) == want
