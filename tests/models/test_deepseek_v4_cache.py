"""Cache accounting of the DeepSeek V4 groups against hand-computed values: bytes per
block of every group, compressed slots per m tokens, sliding-window blocks freed behind
the window (with the lookahead margin), and every block back after a free."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from laneserve import LLM
from laneserve.core.cache_group_kinds import SlidingWindowGroup
from laneserve.core.kv_cache_manager import KVCacheManager
from laneserve.core.request import Request
from laneserve.model.arch import ArchConfig
from laneserve.model.deepseek_v4.model import cache_groups
from laneserve.model.registry import open_weights
from laneserve.sampling_params import SamplingParams


def _arch(d: Path) -> ArchConfig:
    return ArchConfig.from_hf(json.loads((d / "config.json").read_text()))


def test_groups_and_bytes_per_block(deepseek_v4_model: Path) -> None:
    arch = _arch(deepseek_v4_model)
    assert arch.sliding_window is None  # the window never caps max_model_len
    groups = {g.name: g for g in cache_groups(arch, 16, 4, 0)}
    # head_dim D = 32, index_head_dim Di = 16; layers: sliding, CSA, HCA, CSA; fp32
    want = {
        # name: (kind, tokens per block, layers, values per entry, tokens per entry)
        "swa": ("sliding_window", 16, 4, 32, 1),
        "csa_state": ("sliding_window", 16, 2, 4 * 32 + 4 * 16, 1),
        "hca_state": ("sliding_window", 16, 1, 2 * 32, 1),
        "csa": ("compressed", 16 * 4, 2, 32 + 16, 4),
        "hca": ("compressed", 16 * 8, 1, 32, 8),
    }
    assert set(groups) == set(want)
    for name, (kind, tokens, layers, values, per_entry) in want.items():
        g = groups[name]
        assert (g.kind, g.block_size, g.num_layers) == (kind, tokens, layers)
        assert (g.values_per_entry, g.tokens_per_entry, g.entries_per_block) == (
            values,
            per_entry,
            16,
        )
    assert groups["swa"].bytes_per_block == 4 * 16 * 32 * 4  # 8192
    assert groups["csa_state"].bytes_per_block == 2 * 16 * 192 * 4  # 24576
    assert groups["hca_state"].bytes_per_block == 1 * 16 * 64 * 4  # 4096
    assert groups["csa"].bytes_per_block == 2 * 16 * 48 * 4  # 6144: 64 tokens
    assert groups["hca"].bytes_per_block == 1 * 16 * 32 * 4  # 2048: 128 tokens
    assert groups["swa"].window == 8 and groups["csa_state"].window == 8  # 2m
    assert groups["hca_state"].window == 8  # m'


def _request(n: int) -> Request:
    return Request("r", 1, list(range(3, 3 + n)), SamplingParams(), (), max_model_len=1024)


def test_sliding_window_frees_behind_and_compressed_counts_slots() -> None:
    # block_size 4; a window of 8 and a lookahead of 3 keep positions >= computed - 11
    kv = KVCacheManager(
        ["sliding_window", "compressed"],
        [32, 32],
        4,
        enable_caching=True,  # turned off: these kinds cannot serve a prefix
        group_block_sizes=[4, 16],  # compressed: 4 entries of m = 4 tokens per block
        windows=[8, 0],
        lookahead=3,
    )
    assert not kv.enable_caching
    req = _request(20)
    assert kv.allocate_slots(req, 20) is not None
    sliding = kv.groups[0]
    assert isinstance(sliding, SlidingWindowGroup)
    assert sliding.num_held(req.handle) == 5  # 20 positions, nothing freed yet
    req.num_computed_tokens = 20
    assert kv.allocate_slots(req, 1) is not None  # computed 20: keep >= 9 -> free 0, 1
    assert kv.block_ids(req)[0][:3][:2] == [-1, -1] and kv.block_ids(req)[0][2] >= 0
    assert sliding.num_held(req.handle) == 4  # blocks 2..5 (positions 8..23)
    for computed in range(21, 41):  # decode to 41 tokens
        req.num_computed_tokens = computed
        assert kv.allocate_slots(req, 1) is not None
    # computed 41 before the last allocate ran at 40: first kept 40 - 11 = 29 -> blocks
    # 0..6 (positions 0..27) freed; 11 blocks cover 41 tokens: 4 held
    assert sliding.num_held(req.handle) == 4
    assert kv.groups[0].pool.num_free_blocks == 32 - 4
    # compressed: 41 positions -> 10 closed windows + 1 open -> 3 blocks of 4 entries
    assert len(kv.block_ids(req)[1]) == 3
    assert kv.groups[1].pool.num_free_blocks == 32 - 3
    kv.free(req)
    assert [g.pool.num_free_blocks for g in kv.groups] == [32, 32]


def test_sliding_window_keeps_the_margin() -> None:
    kv = KVCacheManager(["sliding_window"], [64], 4, enable_caching=False, windows=[8], lookahead=0)
    req = _request(16)
    assert kv.allocate_slots(req, 16) is not None
    req.num_computed_tokens = 16
    kv.allocate_slots(req, 1)
    # positions >= 16 - 8 = 8 kept: blocks 0 and 1 freed, block 2 (8..11) kept
    assert kv.block_ids(req)[0][:3][:2] == [-1, -1] and kv.block_ids(req)[0][2] >= 0
    wide = KVCacheManager(
        ["sliding_window"], [64], 4, enable_caching=False, windows=[8], lookahead=5
    )
    req2 = _request(16)
    wide.allocate_slots(req2, 16)
    req2.num_computed_tokens = 16
    wide.allocate_slots(req2, 1)
    # positions >= 16 - 13 = 3 kept: block 0 (0..3) still holds position 3
    assert wide.block_ids(req2)[0][0] >= 0


def tables_for(kv, n: int):  # -> per group [n, C] int64
    """Each group's table for one request of up to 64 positions, one row per token."""
    import torch

    out = []
    for g, blocks in zip(kv.groups, kv.num_blocks, strict=True):
        cols = -(-64 // g.block_size)
        row = torch.arange(cols + 1, dtype=torch.int64)
        row[-1] = blocks  # the padding column: the group's scratch block
        out.append(row[None].expand(n, -1))
    return tuple(out)


def _forward(model, kv, ids: list[int], start: int):  # -> hidden [T, H]
    import torch

    from laneserve.model.layers.attention import TokenTableMetadata

    n = len(ids)
    meta = TokenTableMetadata(tables_for(kv, n), start + n + 1)
    positions = torch.arange(start, start + n)
    hidden, _ = model.forward(torch.tensor(ids), positions, meta, kv.layers)
    return hidden


def test_rejected_draft_that_closed_windows_is_recomputed(deepseek_v4_model: Path) -> None:
    """A verify step whose wrong drafts close a CSA window (m = 4) and an HCA window
    (m' = 8) at position 15, then the true tokens at 14..16: every hidden state and every
    compressed entry equals a run that never saw the wrong drafts."""
    import torch

    from laneserve.kernels import get_kernels
    from laneserve.model.deepseek_v4.model import DeepseekV4Model
    from laneserve.model.loader import resolve_checkpoint
    from laneserve.worker.kv_cache import KvCache

    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(deepseek_v4_model), "float32", cpu)
    model = DeepseekV4Model(
        ckpt.arch, get_kernels(cpu), open_weights(ckpt, cpu, torch.float32), cpu, torch.float32, 80
    )
    groups = cache_groups(ckpt.arch, 4, 4, 0)

    def fresh() -> KvCache:
        kv = KvCache.allocate(groups, [32] * len(groups), 0, cpu, torch.float32)
        for stack in kv.stacks:
            for t in stack:
                t.fill_(float("nan"))  # a read of anything never written shows up
        return kv

    tokens = [5 + 7 * i % 300 for i in range(17)]
    clean, dirty = fresh(), fresh()
    _forward(model, clean, tokens[:13], 0)
    want = _forward(model, clean, tokens[13:17], 13)
    _forward(model, dirty, tokens[:13], 0)
    _forward(model, dirty, [tokens[13], 111, 222], 13)  # 14, 15 wrong; 15 closes windows
    _forward(model, dirty, tokens[13:14], 13)  # only position 13 was accepted...
    got = _forward(model, dirty, tokens[14:17], 14)  # ...then the true 14, 15, 16
    # NOTE: 3-row and 4-row steps round differently (fp32, ~2e-5 on some CPUs); a stale
    # draft entry in a window would move the hidden states by far more than this
    torch.testing.assert_close(got, want[1:], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got).all()
    for g, spec in enumerate(groups):
        if spec.kind == "compressed":
            closed = 16 // spec.tokens_per_entry  # entries of windows closed by 15
            a = clean.stacks[g][0].flatten(1, 2)[:, :closed]  # blocks 0.. hold entries 0..
            b = dirty.stacks[g][0].flatten(1, 2)[:, :closed]
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_engine_refuses_a_cache_whose_smallest_group_is_short(deepseek_v4_model: Path) -> None:
    """`num_kv_blocks` gives every group the same count, so the full-length group with
    the fewest tokens per block (csa: 64; hca: 128) bounds max_model_len: 3 blocks hold
    192 tokens, fewer than 256, and the engine refuses to start, naming that group's
    figure; 4 blocks (256 tokens) start and serve. A small step keeps the sliding
    groups' need (their window plus one step) under both counts."""
    kw = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    with pytest.raises(
        ValueError, match="holds 3 blocks = 192 tokens, fewer than max_model_len=256"
    ):
        LLM(str(deepseek_v4_model), num_kv_blocks=3, **kw)
    with LLM(str(deepseek_v4_model), num_kv_blocks=4, **kw) as llm:
        params = SamplingParams(temperature=0, max_tokens=2)
        [out] = llm.generate({"prompt_token_ids": list(range(3, 40))}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
