"""Tensor parallelism of the Llama family on CPU: 2 gloo ranks on 127.0.0.1 against one
device, the ranks against each other, what a rank reads, and shapes that do not divide."""

from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch

from laneserve.distributed.parallel_state import ShardingError, TensorParallel
from laneserve.model.llama.model import cache_groups, parallel_sizes
from laneserve.model.loader import resolve_checkpoint
from tests.distributed.tp_ranks import forward_logits, run_rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(model_dir: Path, out: Path, size: int = 2) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=run_rank, args=(r, size, port, str(model_dir), str(out)))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * size
    return [torch.load(out / f"rank{r}.pt") for r in range(size)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_two_ranks_match_one_device_and_each_other(
    tiny_models: dict[str, Path], tmp_path: Path, family: str
) -> None:
    model_dir = tiny_models[family]
    one = forward_logits(model_dir)
    ranks = _run_ranks(model_dir, tmp_path)
    # every rank holds all the logits (all-gathered), bit for bit the same on each
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    got, want = ranks[0]["logits"], one["logits"]
    assert got.shape == want.shape
    # the sums are split differently (two partial matmuls + an all-reduce): close, and
    # the same greedy token at every position
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # each rank reads its slices only: about half the bytes (norms are replicated)
    assert ranks[0]["bytes"] == ranks[1]["bytes"]
    assert ranks[0]["bytes"] < 0.55 * one["bytes"], (ranks[0]["bytes"], one["bytes"])


def test_shards_are_the_ranks_slices(tiny_models: dict[str, Path]) -> None:
    from laneserve.model.registry import open_weights

    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(tiny_models["llama"]), "float32", cpu)
    store = open_weights(ckpt, cpu, torch.float32)
    name = "model.layers.0.mlp.down_proj.weight"
    full = store(name)
    before = store.bytes_read
    cols = store.shard(name, 1, 80, 80)
    assert torch.equal(cols, full[:, 80:])
    assert store.bytes_read - before == cols.numel() * 4  # only the slice was read
    rows = store.shard("model.layers.0.mlp.gate_proj.weight", 0, 0, 80)
    assert torch.equal(rows, store("model.layers.0.mlp.gate_proj.weight")[:80])


def test_a_size_that_does_not_divide_is_refused(tiny_models: dict[str, Path]) -> None:
    arch = resolve_checkpoint(str(tiny_models["llama"]), "float32", torch.device("cpu")).arch
    tp = TensorParallel(rank=0, size=3)
    with pytest.raises(
        ShardingError,
        match=r"tensor_parallel_size 3 does not divide the model's attention heads \(4\)",
    ):
        tp.split(parallel_sizes(arch)["attention heads"], "attention heads")
    for what, n in parallel_sizes(arch).items():
        TensorParallel(rank=1, size=2).split(n, what)  # 2 divides them all
    assert TensorParallel(rank=1, size=2).split(320, "vocabulary size") == (160, 160)


def test_a_rank_caches_its_kv_heads_only(tiny_models: dict[str, Path]) -> None:
    arch = resolve_checkpoint(str(tiny_models["llama"]), "float32", torch.device("cpu")).arch
    one = cache_groups(arch, 16, 4, 0)[0]
    two = cache_groups(arch, 16, 4, 0, tp_size=2)[0]
    assert one.entry_shape == (arch.num_kv_heads, arch.head_dim)
    assert two.entry_shape == (arch.num_kv_heads // 2, arch.head_dim)
    assert two.bytes_per_block * 2 == one.bytes_per_block
