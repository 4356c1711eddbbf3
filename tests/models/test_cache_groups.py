"""Cache-group layouts and block counts against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from laneserve.model.arch import ArchConfig
from laneserve.model.registry import family_for
from laneserve.worker.kv_cache import KvCache, num_blocks_for
from tests.tiny_models import deepseek_v3_config


def _v3_arch() -> ArchConfig:
    cfg = deepseek_v3_config().to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    return ArchConfig.from_hf(cfg)


def test_mla_group_bytes_per_block() -> None:
    arch = _v3_arch()
    main, mtp = family_for(arch).cache_groups(arch, 16, 4, 1)
    # one latent of kv_lora_rank 32 + rope 8 = 40 fp32 values per token and layer
    assert (main.tensors_per_entry, main.values_per_entry) == (1, 40)
    assert main.bytes_per_block == 3 * 16 * 40 * 4 == 7680
    assert mtp.bytes_per_block == 1 * 16 * 40 * 4 == 2560
    assert main.bytes_per_token == 480


def test_blocks_from_a_budget() -> None:
    arch = _v3_arch()
    groups = family_for(arch).cache_groups(arch, 16, 4, 1)
    # 1 MiB / (480 + 160 bytes per token) = 1638 tokens = 102 blocks of 16 in each group
    assert num_blocks_for(groups, 2**20, None, 16, 512) == [102, 102]
    assert num_blocks_for(groups, 2**20, 40, 16, 512) == [40, 40]
    with pytest.raises(ValueError, match="max_model_len"):
        num_blocks_for(groups, 2**20, None, 16, 2048)


def test_sliding_window_group_sized_by_its_window() -> None:
    """A full group of 100 bytes per token and a sliding group of 50 (window 64, 16-token
    blocks): 1 MiB split by bytes per token would give each 6990 tokens; 4 requests of
    steps up to 32 tokens and lookahead 5 hold at most ceil((64 + 5 + 32) / 16) + 1 = 8
    blocks each of the window, so it gets 32 blocks and the full group the rest."""
    from laneserve.kv_cache_interface import CacheGroupSpec
    from laneserve.worker.kv_cache import StepBounds

    full = CacheGroupSpec("full", "full_attention", 16, 1, 1, (25,), 4)
    window = CacheGroupSpec("swa", "sliding_window", 16, 1, 1, (25,), 2, window=64)
    assert (full.bytes_per_token, window.bytes_per_token) == (100, 50)
    bounds = StepBounds(lookahead=5, step_tokens=32, max_num_seqs=4)
    assert num_blocks_for([full, window], 2**20, None, 16, 512) == [436, 436]
    # 32 window blocks = 32 * 800 bytes; (1 MiB - 25 600) / 100 bytes = 10 229 tokens
    assert num_blocks_for([full, window], 2**20, None, 16, 512, bounds) == [639, 32]
    # a small budget: the proportional share is below the cap and stays
    assert num_blocks_for([full, window], 2**15, None, 16, 128, bounds) == [13, 13]
    with pytest.raises(ValueError, match="'swa' window"):
        num_blocks_for([full, window], 2**20, 7, 16, 64, bounds)
    # only sliding-window groups (a model whose every layer is windowed): each its cap
    other = CacheGroupSpec("swa2", "sliding_window", 16, 1, 1, (25,), 2, window=32)
    assert num_blocks_for([window, other], 2**20, None, 16, 512, bounds) == [32, 24]


def test_llama_group_keeps_k_and_v() -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16,
    }  # fmt: skip
    arch = ArchConfig.from_hf(cfg)
    (main,) = family_for(arch).cache_groups(arch, 16, 2, 0)
    assert main.bytes_per_block == 2 * 3 * 16 * 2 * 16 * 2 == 6144


def test_allocation_shapes_and_scratch() -> None:
    arch = _v3_arch()
    groups = family_for(arch).cache_groups(arch, 16, 4, 1)
    kv = KvCache.allocate(groups, [10, 10], 0, torch.device("cpu"), torch.float32)
    (latent,) = kv.stacks[0]
    assert latent.shape == (3, 11, 16, 1, 40)  # + the scratch block
    assert len(kv.layers[0]) == 3 and len(kv.layers[1]) == 1
    assert kv.layers[0][1][0].data_ptr() == latent[1].data_ptr()
    assert kv.group_index("mtp") == 1 and kv.side_base == 11 * 16
