"""Decode steps through worker/cuda_graphs.py: bucketing, padding, fixed buffers.

On CPU the buckets run eagerly (`capture=False`): the same padded, fixed-tensor forward
a CUDA graph replays. The capture itself is checked by the `cuda`-marked test."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from laneserve.sampling_params import SamplingParams
from laneserve.worker.clients import InlineClient
from laneserve.worker.cuda_graphs import Bucket, Captured, GraphBuckets, capture_sizes
from laneserve.worker.cuda_graphs_tables import TokenTableDecodeGraphs
from laneserve.worker.worker import Worker
from tests.host_reads import no_host_reads
from tests.models.test_deepseek_v4 import _reference as v4_reference
from tests.models.tiny_deepseek_v4 import (
    add_v4_mtp_layer,
    build_tiny_deepseek_v4,
    to_release_layout,
)
from tests.tiny_models import (
    build_bigram_model,
    build_exact_deepseek_mtp,
    build_exact_mtp_head,
    build_tiny_deepseek,
    hf_greedy,
)


def test_capture_sizes_and_buckets() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    graphs = GraphBuckets(torch.device("cpu"), 16, 20, (40,), capture=False)
    assert graphs.bucket(3, 1, (5,)) == Bucket(4, 1, (8,))
    assert graphs.bucket(17, 3, (33,)) == Bucket(20, 3, (40,))  # capped at the longest request
    assert graphs.bucket(20, 1, (1,)) == Bucket(20, 1, (1,))
    assert graphs.bucket(21, 1, (4,)) is None  # more rows than any capture
    assert graphs.bucket(4, 1, (41,)) is None
    assert graphs.bucket(4, 8, (4,)) == Bucket(4, 8, (4,))
    assert graphs.bucket(4, 9, (4,)) is None  # beyond the attention's gathered path
    assert graphs.bucket(4, 1, (4,), max_len=37) == Bucket(4, 1, (4,))  # no bound kept
    v4 = GraphBuckets(torch.device("cpu"), 16, 8, (40, 10, 5), capture=False, max_len_cap=100)
    assert v4.bucket(3, 1, (5, 2, 1), max_len=37) == Bucket(4, 1, (8, 2, 1), 64)
    assert v4.bucket(3, 1, (33, 9, 5), max_len=99) == Bucket(4, 1, (40, 10, 5), 100)
    assert v4.bucket(3, 1, (5, 11, 1), max_len=37) is None  # one group too wide
    assert v4.bucket(3, 1, (5, 2, 1), max_len=101) is None  # past the bound's cap


def _guard(graphs: GraphBuckets, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every padded forward of these buckets under the host-read guard."""
    forward = graphs._forward

    def guarded(cap: Captured) -> tuple[torch.Tensor, ...]:
        with no_host_reads(monkeypatch):
            return forward(cap)

    monkeypatch.setattr(graphs, "_forward", guarded)


def _engine(
    model: Path, kernels: bool, spec: dict | None, async_on: bool = False, **kw: object
) -> LLMEngine:
    """Sync: steps inline in this thread; async: the worker's lanes (two steps in flight)."""
    args = EngineArgs(
        model=str(model),
        dtype="float32",
        use_kernels=kernels,
        async_scheduling=async_on,
        max_num_seqs=8,
        speculative_config=spec,
        **kw,
    )
    config = args.create_config()
    if async_on:
        return LLMEngine(config)
    return LLMEngine(config, client=InlineClient(config, Worker(config)))


def _attach(eng: LLMEngine, monkeypatch: pytest.MonkeyPatch | None) -> GraphBuckets:
    """The worker's decode-step buckets, run eagerly; guarded against host reads when a
    monkeypatch is given."""
    worker = eng.client.worker
    graphs = worker.decode_graphs(capture=False)
    assert graphs is not None
    if monkeypatch is not None:
        _guard(graphs, monkeypatch)
    worker.runner.graphs = graphs
    return graphs


def _poison_caches(eng: LLMEngine) -> None:
    """Every cache group's tensors NaN, as uninitialised memory may be: nothing past a
    row's length may reach the output."""
    for group in eng.client.worker.kv.layers:
        for layer in group:
            for t in layer:
                t.fill_(float("nan"))


def _work(seed: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_tokens): staggered, so the batch grows and shrinks."""
    rng = random.Random(seed)
    return [
        (rng.randint(0, 12), [rng.randrange(3, 300) for _ in range(rng.randint(3, 40))], n)
        for n in (30, 9, 25, 4, 18, 30)
    ]


def _run(eng: LLMEngine, work: list[tuple[int, list[int], int]]) -> list[list[int]]:
    got: dict[int, list[int]] = {i: [] for i in range(len(work))}
    pending = sorted(enumerate(work), key=lambda x: x[1][0])
    step = 0
    while pending or eng.has_unfinished:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, n) = pending.pop(0)
            eng.add_request(
                str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            )
        for d in eng.step():
            got[int(d.state.group_id)] += d.token_ids
        step += 1
    return [got[i] for i in range(len(work))]


@pytest.fixture
def model(tiny_models: dict[str, Path]) -> Iterator[Path]:
    yield tiny_models["llama"]


@pytest.mark.parametrize(
    ("kernels", "async_on"),
    [(True, False), (False, False), (True, True)],
    ids=["cpu-kernels", "torch-kernels", "cpu-kernels-async"],
)
def test_padded_buckets_give_the_plain_tokens(
    model: Path, kernels: bool, async_on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps through padded buckets: HF's greedy tokens, several buckets used, and
    (torch kernels, CUDA's ops) no host read anywhere in the padded forward."""
    work = _work(1)
    eng = _engine(model, kernels, None, async_on)
    graphs = _attach(eng, None if kernels else monkeypatch)
    got = _run(eng, work)
    eng.shutdown()
    assert got == [hf_greedy(model, p, n) for _, p, n in work]
    rows = {b.rows for b in graphs.buckets}
    assert graphs.replays > 20 and len(rows) >= 3 and {b.qlen for b in graphs.buckets} == {1}
    assert any(b.rows * b.qlen > 1 for b in graphs.buckets)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_deepseek(tmp_path_factory.mktemp("deepseek") / "v3", 3, seed=1)


# NOTE: slow: the paged kind's buckets are the Llama test's above (default suite); this
# adds MLA's latent cache and the routed experts
@pytest.mark.slow
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-kernels"])
def test_deepseek_padded_buckets_give_the_plain_tokens(
    deepseek: Path, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek V3 (MLA latent cache, routed experts) through padded buckets: HF's greedy
    tokens; with torch kernels (CUDA's ops: experts grouped on the device, MLA decode in
    torch ops) no host read anywhere in the padded forward. The cache starts as NaN (it
    is allocated uninitialised): nothing past a row's length may reach the output."""
    work = _work(6)
    eng = _engine(deepseek, kernels, None)
    graphs = _attach(eng, None if kernels else monkeypatch)
    _poison_caches(eng)
    got = _run(eng, work)
    eng.shutdown()
    assert got == [hf_greedy(deepseek, p, n) for _, p, n in work]
    assert graphs.replays > 20 and len({b.rows for b in graphs.buckets}) >= 3


def _speculative_through_buckets(
    model: Path, work: list[tuple[int, list[int], int]], spec: dict, async_on: bool
) -> dict:
    """k = 2 drafts through padded buckets: the plain engine's tokens, q = 3 buckets
    replayed; returns the engine's stats."""
    plain = _engine(model, True, None)
    want = _run(plain, work)
    plain.shutdown()
    eng = _engine(model, True, {**spec, "num_speculative_tokens": 2}, async_on)
    graphs = _attach(eng, None)
    got = _run(eng, work)
    stats = eng.stats()
    eng.shutdown()
    assert got == want
    assert 3 in {b.qlen for b in graphs.buckets} and graphs.replays > 0
    return stats


def test_padded_buckets_under_speculation(model: Path) -> None:
    """Dense verify steps (1 + k tokens per row) replay buckets of q = k + 1; the tokens
    equal the plain engine's (CPU kernels: bit-identical rows)."""
    rng = random.Random(5)
    motif = [rng.randrange(3, 300) for _ in range(6)]
    work = [(i, motif * 4 + [rng.randrange(3, 300)], 24) for i in range(4)]
    stats = _speculative_through_buckets(model, work, {"method": "ngram"}, async_on=False)
    assert stats["spec_num_accepted"] > 0


def test_padded_buckets_under_mtp(tmp_path: Path) -> None:
    """MTP (k = 2, a head right on half the vocabulary): the verify steps' forward replays
    q = 3 buckets and the head drafts from the bucket's hidden states; the tokens equal
    the plain engine's, async on (the lanes)."""
    model = build_bigram_model(tmp_path / "bigram", "llama", seed=4)
    head = build_exact_mtp_head(model, tmp_path / "half.safetensors", list(range(0, 320, 2)))
    spec = {"method": "mtp", "draft_weights": str(head)}
    stats = _speculative_through_buckets(model, _work(4), spec, async_on=True)
    assert stats["spec_num_drafts"] > stats["spec_num_accepted"] > 0


def test_deepseek_padded_buckets_under_its_mtp(tmp_path: Path) -> None:
    """DeepSeek's own MTP layer (k = 2, async): verify steps replay q = 3 buckets, the MTP
    layer drafts from the bucket's hidden states; the plain engine's tokens."""
    model = build_exact_deepseek_mtp(tmp_path / "exact", keep_attention=True)
    stats = _speculative_through_buckets(model, _work(7), {"method": "mtp"}, async_on=True)
    assert stats["spec_num_drafts"] > stats["spec_num_accepted"] > 0


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_deepseek_v4(tmp_path_factory.mktemp("deepseek_v4") / "v4", seed=0)


# NOTE: decode graphs run on CUDA, whose ops are the torch kernels'; both cases run with
# the slow set (the default suite pads V4's buckets under its MTP, below)
@pytest.mark.parametrize(
    "kernels",
    [pytest.param(True, marks=pytest.mark.slow), pytest.param(False, marks=pytest.mark.slow)],
    ids=["cpu-kernels", "torch-kernels"],
)
def test_deepseek_v4_padded_buckets_give_the_plain_tokens(
    deepseek_v4: Path, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek V4 (every cache group read through per-token tables; compressed keys
    sized by the bucket's rounded max_len) through padded buckets: HF's greedy tokens;
    with torch kernels no host read anywhere in the padded forward. Every group's cache
    starts as NaN: nothing past a row's length may reach the output."""
    work = _work(8)
    eng = _engine(deepseek_v4, kernels, None)
    graphs = _attach(eng, None if kernels else monkeypatch)
    assert isinstance(graphs, TokenTableDecodeGraphs)
    _poison_caches(eng)
    got = _run(eng, work)
    eng.shutdown()
    for (_, prompt, n), tokens in zip(work, got, strict=True):
        assert tokens == list(v4_reference(str(deepseek_v4), tuple(prompt), n))
    buckets = graphs.buckets
    assert graphs.replays > 20 and len({b.rows for b in buckets}) >= 3
    bounds = {b.max_len for b in buckets}  # powers of two, several of them
    assert len(bounds) >= 2 and all(m & (m - 1) == 0 for m in bounds)
    assert all(len(b.columns) == len(eng.client.worker.groups) for b in buckets)


def test_deepseek_v4_padded_buckets_under_its_mtp(deepseek_v4: Path, tmp_path: Path) -> None:
    """V4's own MTP layer (k = 2, async) drafts from the residual streams a bucket
    returns: verify steps replay q = 3 buckets whose hidden states and streams equal the
    unpadded forward's with the same rounded length bound (to fp32 rounding: V4's
    attention einsums are torch matmuls over the padded rows), and the tokens are the
    plain engine's."""
    model = add_v4_mtp_layer(to_release_layout(deepseek_v4, tmp_path / "release"), seed=7)
    work = _work(9)
    plain = _engine(model, True, None)
    want = _run(plain, work)
    plain.shutdown()
    eng = _engine(model, True, {"method": "mtp", "num_speculative_tokens": 2}, async_on=True)
    graphs = _attach(eng, None)
    assert isinstance(graphs, TokenTableDecodeGraphs)
    replay, same = graphs.run, []

    def compared(ids, positions, meta, qlen):  # type: ignore[no-untyped-def]
        out = replay(ids, positions, meta, qlen)
        if out is not None:  # the same step unpadded, with the bucket's length bound
            cols = tuple(t.shape[1] for t in meta.tables)
            key = graphs.bucket(ids.shape[0] // qlen, qlen, cols, meta.max_len)
            bound = dataclasses.replace(meta, max_len=key.max_len)
            eager = graphs.model.forward(ids, positions, bound, graphs.caches)  # same writes
            close = [
                torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(out, eager, strict=True)
            ]
            same.append((qlen, all(close)))
        return out

    graphs.run = compared  # type: ignore[method-assign]
    got = _run(eng, work)
    stats = eng.stats()
    eng.shutdown()
    assert got == want
    assert all(equal for _, equal in same) and sum(q == 3 for q, _ in same) > 10
    assert stats["spec_num_drafts"] > 0


@pytest.mark.cuda
def test_captured_graphs_match_eager(tiny_models: dict[str, Path]) -> None:
    """On CUDA (fp32): the default engine captures decode graphs and gives the tokens of
    the same engine with enforce_eager."""
    model, work = tiny_models["llama"], _work(3)
    runs = []
    for eager in (True, False):
        args = EngineArgs(
            model=str(model),
            dtype="float32",
            device="cuda",
            max_num_seqs=8,
            enforce_eager=eager,
            async_scheduling=False,
        )
        config = args.create_config()
        eng = LLMEngine(config, client=InlineClient(config, Worker(config)))
        runs.append(_run(eng, work))
        graphs = eng.client.worker.runner.graphs
        assert (graphs is None) == eager
        if graphs is not None:
            assert graphs.replays > 20 and graphs.capture
        eng.shutdown()
    assert runs[0] == runs[1]
    assert runs[0] == [hf_greedy(model, p, n) for _, p, n in work]
    torch.cuda.synchronize()


def test_a_failed_capture_leaves_steps_eager(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A capture that raises (here: CUDA calls on a CPU build) turns graphs off with a
    warning; every step still runs, eagerly, with the plain tokens."""
    work = _work(2)
    eng = _engine(model, True, None)
    graphs = _attach(eng, None)
    graphs.capture = True
    with caplog.at_level("WARNING", logger="laneserve.worker.cuda_graphs"):
        got = _run(eng, work)
    eng.shutdown()
    assert got == [hf_greedy(model, p, n) for _, p, n in work]
    assert graphs.failure is not None and graphs.replays == 0 and not graphs.buckets
    assert sum("decode graphs off" in r.message for r in caplog.records) == 1
