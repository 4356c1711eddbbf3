"""What the decode-graph capture records, checked on a CPU: `GraphBuckets._capture` runs
against a stand-in for `torch.cuda` that records the calls and makes a "graph" whose
replay reruns the bucket's forward on the bucket's fixed tensors (what a CUDA graph
replays). The `cuda`-marked test in test_decode_graphs.py runs the real capture."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from laneserve.worker import cuda_graphs
from laneserve.worker.cuda_graphs import Captured, GraphBuckets
from tests.tiny_models import hf_greedy
from tests.worker.test_decode_graphs import _engine, _run, _work


class FakeGraph:
    def __init__(self) -> None:
        self.rerun: Callable[[], None] | None = None
        self.replays = 0

    def replay(self) -> None:
        assert self.rerun is not None, "replayed before it was captured"
        self.replays += 1
        self.rerun()


class FakeStream:
    def wait_stream(self, other: Any) -> None:
        pass


class FakeCuda:
    """The `torch.cuda` calls `_capture` makes, recorded."""

    CUDAGraph = FakeGraph

    def __init__(self) -> None:
        self.pools = 0
        self.events: list[tuple] = []  # ("warm-up",) / ("capture", graph, pool, mode)
        self.capturing: FakeGraph | None = None
        self.warming = False

    def graph_pool_handle(self) -> str:
        self.pools += 1
        return f"pool{self.pools}"

    def synchronize(self, device: Any = None) -> None:
        pass

    def Stream(self, device: Any = None) -> FakeStream:
        return FakeStream()

    def current_stream(self, device: Any = None) -> FakeStream:
        return FakeStream()

    @contextlib.contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        self.events.append(("warm-up",))
        self.warming = True
        yield
        self.warming = False

    @contextlib.contextmanager
    def graph(self, graph: FakeGraph, pool: str, capture_error_mode: str) -> Iterator[None]:
        self.events.append(("capture", graph, pool, capture_error_mode))
        self.capturing = graph
        yield
        self.capturing = None


class TorchWithFakeCuda:
    """`torch` as cuda_graphs.py sees it, with `cuda` replaced."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN == NaN, unlike torch.equal on floats)."""
    return t.contiguous().view(torch.uint8)


def _record(graphs: GraphBuckets, fake: FakeCuda, kv: list, seen: list[str]) -> None:
    """Wrap the buckets' forward: during the warm-up and the capture, every input holds
    its padding and no cache block but the scratch block changes; the captured graph's
    replay reruns the forward into the captured outputs."""
    forward = graphs._forward

    def recorded(cap: Captured) -> tuple[torch.Tensor, ...]:
        if not (fake.warming or fake.capturing):
            seen.append("eager")
            return forward(cap)
        for name, t in cap.inputs.items():
            pad = cap.pad[name]
            assert torch.equal(t, pad.expand_as(t) if t.dim() == 2 else pad), name
        before = [[x[:, :n].clone() for x in stack] for stack, n in kv]
        out = forward(cap)
        for (stack, n), old in zip(kv, before, strict=True):
            for x, y in zip(stack, old, strict=True):
                # bitwise: the pool is torch.empty, so unwritten blocks may hold NaN
                same = torch.equal(_bits(x[:, :n]), _bits(y))
                assert same, "the capture wrote outside the scratch block"
        graph = fake.capturing
        if graph is not None:
            seen.append("capture")

            def rerun() -> None:
                for dst, new in zip(cap.outputs, forward(cap), strict=True):
                    dst.copy_(new)

            graph.rerun = rerun
        return out

    graphs._forward = recorded  # type: ignore[method-assign]


def test_capture_records_padding_only_and_replays(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each bucket: one warm-up, then one capture in the pool every bucket shares
    ("thread_local" errors, as the prepare lane uploads meanwhile), both on padding only,
    writing no cache block but the scratch block; every later step replays the graph
    (no eager forward), and the tokens are transformers'."""
    model, work = tiny_models["llama"], _work(4)
    fake = FakeCuda()
    monkeypatch.setattr(cuda_graphs, "torch", TorchWithFakeCuda(fake))
    eng = _engine(model, True, None, num_kv_blocks=64)
    worker = eng.client.worker
    graphs = worker.decode_graphs(capture=True)
    assert graphs is not None
    kv = [(stack, n) for stack, n in zip(worker.kv.stacks, worker.kv.num_blocks, strict=True)]
    seen: list[str] = []
    _record(graphs, fake, kv, seen)
    worker.runner.graphs = graphs
    got = _run(eng, work)
    eng.shutdown()
    assert got == [hf_greedy(model, p, n) for _, p, n in work]
    assert graphs.failure is None and len(graphs.buckets) >= 3
    captures = [e for e in fake.events if e[0] == "capture"]
    assert [e[0] for e in fake.events] == ["warm-up", "capture"] * len(graphs.buckets)
    assert fake.pools == 1 and {e[2] for e in captures} == {"pool1"}
    assert {e[3] for e in captures} == {"thread_local"}
    assert seen == ["capture"] * len(graphs.buckets)  # no step ran eagerly
    assert graphs.replays > 20
    assert sum(e[1].replays for e in captures) == graphs.replays
