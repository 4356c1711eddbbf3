"""Tensor parallelism of DeepSeek V2 / V3 (MLA + MoE) on CPU: 2 gloo ranks on 127.0.0.1
against one device and each other, sharded FP8 reads, and what is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from laneserve.distributed.parallel_state import ShardingError
from laneserve.model.deepseek.model import cache_groups, parallel_sizes
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import FAMILIES, open_weights
from laneserve.worker.ranks import check_supported
from tests.distributed.tp_ranks import check_two_ranks

CPU = torch.device("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("version", ["v3", "v2"])
def test_two_ranks_match_one_device_and_each_other(
    tp_deepseek: dict[str, Path], tmp_path: Path, version: str
) -> None:
    check_two_ranks(tp_deepseek[version], tmp_path, mtp=version == "v3")  # V3: its MTP layer


def _family(name: str):  # type: ignore[no-untyped-def]
    return next(f for f in FAMILIES if f.name == name)


def test_sizes_that_do_not_divide_are_refused(tp_deepseek: dict[str, Path]) -> None:
    arch = resolve_checkpoint(str(tp_deepseek["v3"]), "float32", CPU).arch
    deepseek = _family("deepseek")
    check_supported(deepseek, arch, 2, False)  # the tiny model divides by 2
    with pytest.raises(
        ShardingError,
        match=r"tensor_parallel_size 8 does not divide the model's attention heads \(4\)",
    ):
        check_supported(deepseek, arch, 8, False)
    assert arch.deepseek is not None
    odd = dataclasses.replace(
        arch, deepseek=dataclasses.replace(arch.deepseek, moe_intermediate_size=33)
    )
    with pytest.raises(ShardingError, match=r"moe intermediate size \(33\)"):
        check_supported(deepseek, odd, 2, False)
    sizes = parallel_sizes(arch)
    assert sizes["shared experts' intermediate size"] == 32  # 1 shared expert of 32
    assert sizes["intermediate size"] == 128 and sizes["vocabulary size"] == 320


def test_every_rank_caches_the_whole_latent(tp_deepseek: dict[str, Path]) -> None:
    arch = resolve_checkpoint(str(tp_deepseek["v3"]), "float32", CPU).arch
    assert cache_groups(arch, 16, 4, 1, 2) == cache_groups(arch, 16, 4, 1)


def test_speculation_refusals() -> None:
    from laneserve.config import SpeculativeConfig
    from laneserve.engine_args import EngineArgs

    mtp = SpeculativeConfig(method="mtp", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="the llama family's MTP draft head is not sharded"):
        check_supported(_family("llama"), None, 2, False, mtp)  # type: ignore[arg-type]
    unsharded = dataclasses.replace(_family("deepseek"), parallel_sizes=None)
    with pytest.raises(ValueError, match=r"supported families: llama, deepseek"):
        check_supported(unsharded, None, 2, False)  # type: ignore[arg-type]
    tree = (
        '{"method": "mtp", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,), (1,)]"}'
    )
    with pytest.raises(ValueError, match="speculative_token_tree with tensor_parallel_size > 1"):
        EngineArgs(
            model="m", tensor_parallel_size=2, worker_mode="process", speculative_config=tree
        ).create_config()
    for spec in ('{"method": "mtp", "num_speculative_tokens": 2}', '{"method": "ngram"}'):
        EngineArgs(
            model="m", tensor_parallel_size=2, worker_mode="process", speculative_config=spec
        ).create_config()


def test_fp8_shard_dequantizes_only_the_covering_blocks(
    tp_deepseek: dict[str, Path], tmp_path: Path
) -> None:
    from tests.models.test_fp8_loader import BLOCK, _fp8_copy

    exact = _fp8_copy(tp_deepseek["v3"], tmp_path / "fp8", tmp_path / "plain")
    store = open_weights(
        resolve_checkpoint(str(tmp_path / "fp8"), "float32", CPU), CPU, torch.float32
    )
    name = "model.layers.1.self_attn.kv_b_proj.weight"  # [4 * 32, 32], blocks of 16
    for dim, start, length in [(0, 64, 64), (0, 8, 20), (1, 16, 16), (1, 3, 26)]:
        before = store.bytes_read
        got = store.shard(name, dim, start, length)
        assert torch.equal(got, exact[name].narrow(dim, start, length))
        b = BLOCK[dim]
        covered = -(-(start + length) // b) * b - start // b * b
        # fp8 values (1 byte) of the covering blocks plus their fp32 scales
        other = exact[name].shape[1 - dim]
        scales = (covered // b) * -(-other // BLOCK[1 - dim]) * 4
        assert store.bytes_read - before == covered * other + scales
    full = store.bytes_read
    store(name)
    assert store.bytes_read - full > 128 * 32  # the whole tensor: every value and scale


@pytest.mark.slow
def test_two_ranks_of_an_fp8_checkpoint(tp_deepseek: dict[str, Path], tmp_path: Path) -> None:
    from tests.models.test_fp8_loader import _fp8_copy

    _fp8_copy(tp_deepseek["v3"], tmp_path / "fp8", tmp_path / "plain")
    (tmp_path / "out").mkdir()
    check_two_ranks(tmp_path / "fp8", tmp_path / "out")
