"""Tensor parallelism of DeepSeek V4 on CPU: 2 gloo ranks on 127.0.0.1 against one
device (prompts past the largest compression ratio, so compressed entries and the
indexer's choice are read; then decode tokens), the ranks against each other, the MTP
layer, what a rank reads, and sizes that do not divide."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from laneserve import LLM
from laneserve.config import SpeculativeConfig
from laneserve.distributed.parallel_state import ShardingError, TensorParallel
from laneserve.engine_args import EngineArgs
from laneserve.kernels import get_kernels
from laneserve.model.arch import ArchConfig
from laneserve.model.deepseek_v4.model import DeepseekV4Model, cache_groups
from laneserve.model.deepseek_v4.parallel import parallel_sizes
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import FAMILIES, open_weights
from laneserve.worker.ranks import check_supported
from tests.distributed.tp_engine import assert_two_ranks_generate_what_one_device_does
from tests.distributed.tp_ranks import spawn_ranks
from tests.distributed.v4_ranks import run_v4_rank, v4_logits
from tests.e2e.test_tiny_models import mixed_prompts, run
from tests.models.test_deepseek_mtp import _spec
from tests.models.test_deepseek_v4 import GREEDY, prompts_of


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.tiny_deepseek_v4 import build_tiny_deepseek_v4

    return build_tiny_deepseek_v4(tmp_path_factory.mktemp("tpv4") / "v4", seed=0)


@pytest.fixture(scope="module")
def release_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The released layout (FP8 attention, FP4 experts, an `mtp.0` layer, 3 shards)."""
    from tests.models.release_deepseek_v4 import build_release_v4

    root = tmp_path_factory.mktemp("tpv4release")
    return build_release_v4(root / "release", root / "reference", seed=3)[0]


@pytest.fixture(scope="module")
def tiny_v4_mtp(tiny_v4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny V4 in the release layout with a random `mtp.0` layer (drafts rejected often)."""
    from tests.models.tiny_deepseek_v4 import add_v4_mtp_layer, to_release_layout

    release = to_release_layout(tiny_v4, tmp_path_factory.mktemp("tpv4mtp") / "r")
    return add_v4_mtp_layer(release, seed=7)


def _run_ranks(model_dir: Path, prompt_len: int, out: Path, size: int = 2) -> list[dict]:
    return spawn_ranks(run_v4_rank, (str(model_dir), prompt_len, str(out)), out, size)


def _check_ranks(ranks: list[dict], one: dict, key: str) -> None:
    # every rank holds all the logits (all-gathered), bit for bit the same on each
    assert torch.equal(ranks[0][key], ranks[1][key])
    got, want = ranks[0][key], one[key]
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _check_sharded(ranks: list[dict], one: dict) -> None:
    """The sharded path engaged: each rank holds half of every split weight (heads,
    output groups, expert features, vocabulary rows), and the K = V projection whole."""
    for shapes in (r["shapes"] for r in ranks):
        assert shapes.keys() == one["shapes"].keys()
        for name, whole in one["shapes"].items():
            want = whole if name == "wkv" else (whole[0] // 2, *whole[1:])
            assert shapes[name] == want, (name, shapes[name], whole)


@pytest.mark.slow
def test_two_ranks_match_one_device_and_each_other(tiny_v4: Path, tmp_path: Path) -> None:
    prompt = 40  # past the window (8) and both rates (4, 8): 5 HCA, 10 CSA entries (top 3)
    one = v4_logits(tiny_v4, prompt)
    ranks = _run_ranks(tiny_v4, prompt, tmp_path)
    _check_ranks(ranks, one, "logits")
    assert one["shapes"]["wq_b"] == (4 * 32,) and one["shapes"]["wo_a"] == (2, 16, 64)
    _check_sharded(ranks, one)
    # every rank caches the same groups as one device (the K = V head is whole on each)
    assert ranks[0]["groups"] == ranks[1]["groups"] == one["groups"]
    # each rank reads its slices: heads, groups, expert features, vocabulary rows
    assert ranks[0]["bytes"] == ranks[1]["bytes"]
    assert ranks[0]["bytes"] < 0.65 * one["bytes"], (ranks[0]["bytes"], one["bytes"])


@pytest.mark.slow
def test_release_layout_with_mtp_on_two_ranks(release_v4: Path, tmp_path: Path) -> None:
    prompt = 140  # past the HCA rate (128): its first entry is read
    one = v4_logits(release_v4, prompt)
    ranks = _run_ranks(release_v4, prompt, tmp_path)
    _check_ranks(ranks, one, "logits")
    _check_ranks(ranks, one, "mtp")  # the MTP layer sharded as the target's layers
    _check_sharded(ranks, one)
    assert "mtp wq_b" in one["shapes"]


def _arch(model_dir: Path, **changes: object) -> ArchConfig:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    return ArchConfig.from_hf(cfg)


def test_sizes_that_do_not_divide_are_refused(tiny_v4: Path) -> None:
    v4 = next(f for f in FAMILIES if f.name == "deepseek_v4")
    arch = _arch(tiny_v4)
    assert parallel_sizes(arch) == {
        "attention heads": 4,
        "output groups (o_groups)": 2,
        "MoE intermediate size": 48,
        "vocabulary size": 320,
    }
    check_supported(v4, arch, 2, False)  # 2 divides them all
    with pytest.raises(ShardingError, match=r"divide the model's attention heads \(4\)"):
        check_supported(v4, arch, 3, False)
    # heads divide by 4, the output groups do not
    with pytest.raises(ShardingError, match=r"divide the model's output groups \(o_groups\) \(2\)"):
        check_supported(v4, arch, 4, False)
    odd = _arch(tiny_v4, moe_intermediate_size=49)
    with pytest.raises(ShardingError, match=r"divide the model's MoE intermediate size \(49\)"):
        check_supported(v4, odd, 2, False)
    with pytest.raises(ShardingError, match=r"vocabulary size \(321\)"):
        check_supported(v4, _arch(tiny_v4, vocab_size=321), 2, False)


def test_a_rank_refuses_to_load_a_split_that_does_not_divide(tiny_v4: Path) -> None:
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(tiny_v4), "float32", cpu)
    store = open_weights(ckpt, cpu, torch.float32)
    with pytest.raises(ShardingError, match="attention heads"):
        DeepseekV4Model(
            ckpt.arch, get_kernels(cpu), store, cpu, torch.float32, 64, tp=TensorParallel(0, 3)
        )


@pytest.mark.slow
def test_engine_refuses_one_output_group_on_two_ranks(tmp_path: Path) -> None:
    """An LLM start with a split that does not divide fails with the sizes named."""
    from tests.models.tiny_deepseek_v4 import build_tiny_deepseek_v4

    d = build_tiny_deepseek_v4(tmp_path / "one-group", seed=1, o_groups=1)
    with pytest.raises(ValueError, match=r"2 does not divide the model's output groups"):
        LLM(str(d), dtype="float32", tensor_parallel_size=2, worker_mode="process")


def test_a_rank_caches_what_one_device_does(tiny_v4: Path) -> None:
    arch = _arch(tiny_v4)
    assert cache_groups(arch, 16, 4, 1, 2) == cache_groups(arch, 16, 4, 1)


@pytest.mark.slow
def test_engine_two_ranks_generate_what_one_device_does(tiny_v4: Path) -> None:
    prompts = mixed_prompts(6, seed=3)  # different lengths (2 .. 60), one batch
    assert_two_ranks_generate_what_one_device_does(str(tiny_v4), prompts)


def test_the_mtp_head_shards_with_the_model(tiny_v4: Path) -> None:
    """MTP speculation with N > 1 is taken for V4 (its layer is split as the target's);
    a family whose draft head is not sharded is refused before anything loads."""
    v4 = next(f for f in FAMILIES if f.name == "deepseek_v4")
    llama = next(f for f in FAMILIES if f.name == "llama")
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=2)
    check_supported(v4, _arch(tiny_v4), 2, False, spec)
    with pytest.raises(ValueError, match="llama family's MTP draft head is not sharded"):
        check_supported(llama, None, 2, False, spec)  # type: ignore[arg-type]
    tree = {"method": "mtp", "speculative_token_tree": "[(0,), (1,), (2,)]"}
    with pytest.raises(ValueError, match="speculative_token_tree with tensor_parallel_size > 1"):
        EngineArgs(
            model="m", tensor_parallel_size=2, worker_mode="process", speculative_config=tree
        ).create_config()


@pytest.mark.slow
@pytest.mark.parametrize("exact", [False, True])
def test_engine_mtp_drafts_on_two_ranks(tiny_v4_mtp: Path, tmp_path: Path, exact: bool) -> None:
    """k = 2 MTP drafts, async, on two ranks: one device's plain greedy tokens, batched
    with different prompt lengths. The random MTP layer's drafts are often rejected;
    the exact one's (a layer copying the deciding layer) are all accepted."""
    from tests.models.tiny_deepseek_v4 import build_exact_deepseek_v4_mtp

    model = (
        build_exact_deepseek_v4_mtp(tmp_path / "exact", inert_layers=3) if exact else tiny_v4_mtp
    )
    prompts = prompts_of([37, 9, 22], seed=11)
    with LLM(str(model), dtype="float32") as llm:
        want = run(llm, prompts, GREEDY)
    with LLM(
        str(model),
        dtype="float32",
        tensor_parallel_size=2,
        worker_mode="process",
        async_scheduling=True,
        **_spec(2),
    ) as llm:
        got = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
    assert got == want
    assert stats["spec_num_drafts"] > 0
    if exact:
        assert stats["spec_num_accepted"] == stats["spec_num_drafts"]
    else:
        assert stats["spec_num_accepted"] < stats["spec_num_drafts"]


@pytest.mark.slow
def test_engine_ngram_drafts_on_two_ranks(tiny_v4: Path) -> None:
    """k = 2 n-gram drafts, async, on two ranks: one device's plain greedy tokens."""
    prompts = [p * 3 for p in mixed_prompts(3, seed=13, lo=4, hi=8)]  # repeats: lookups hit
    with LLM(str(tiny_v4), dtype="float32") as llm:
        want = run(llm, prompts, GREEDY)
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with LLM(
        str(tiny_v4),
        dtype="float32",
        tensor_parallel_size=2,
        worker_mode="process",
        async_scheduling=True,
        speculative_config=spec,
    ) as llm:
        got = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
    assert got == want
    assert stats["spec_num_drafts"] > 0, stats
