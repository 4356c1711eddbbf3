"""Tensor parallelism of the Llama family on CPU: 2 gloo ranks on 127.0.0.1 against one
device, the ranks against each other, what a rank reads, and shapes that do not divide."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laneserve.distributed.parallel_state import ShardingError, TensorParallel
from laneserve.model.llama.model import cache_groups, parallel_sizes
from laneserve.model.loader import resolve_checkpoint
from tests.distributed.tp_ranks import check_two_ranks


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_two_ranks_match_one_device_and_each_other(
    tiny_models: dict[str, Path], tmp_path: Path, family: str
) -> None:
    check_two_ranks(tiny_models[family], tmp_path)


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
