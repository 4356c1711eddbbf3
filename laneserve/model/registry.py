"""Model registry: HF `architectures` value -> the family that runs it.

A family names its model class (a `model/interface.py` `CausalLM`), its cache
groups (`CacheGroupSpec`: the layout the worker allocates and the engine core
accounts), the tensor shapes config.json fixes (checked at load, `open_weights`),
and how its MTP draft head (a `DraftHead`) is loaded. Adding a family is one
package under `model/` and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from laneserve.kernels import Kernels
from laneserve.kv_cache_interface import CacheGroupSpec
from laneserve.model.arch import ArchConfig, UnsupportedModelError
from laneserve.model.deepseek import model as deepseek
from laneserve.model.deepseek.mtp import load_deepseek_mtp
from laneserve.model.deepseek_v4 import model as deepseek_v4
from laneserve.model.deepseek_v4.mtp import load_deepseek_v4_mtp
from laneserve.model.deepseek_v4.parallel import parallel_sizes as deepseek_v4_parallel_sizes
from laneserve.model.deepseek_v32 import model as deepseek_v32
from laneserve.model.deepseek_v32.mtp import load_deepseek_v32_mtp
from laneserve.model.llama import model as llama
from laneserve.model.llama.mtp import load_mtp_head
from laneserve.model.loader import Checkpoint, WeightStore

# (arch, block_size, dtype_bytes, mtp_layers[, tp_size]) -> groups; the target's group first
CacheGroupsFn = Callable[..., list[CacheGroupSpec]]
# (store, model, kernels, draft_weights, known_name, quantization) -> MTP head
MtpLoader = Callable[[Any, Any, Kernels, str | None, str | None, str | None], Any]


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]
    model_class: type  # (arch, kernels, weights, device, act_dtype, max_positions)
    cache_groups: CacheGroupsFn
    weight_shapes: Callable[[ArchConfig], dict[str, tuple[int, ...]]]
    load_mtp: MtpLoader
    # token-tree side rows need a K/V cache the side-row scratch logic can copy
    supports_side_rows: bool = True
    # what tensor parallelism splits (name -> size; each must divide by the TP size);
    # None: the family has no tensor-parallel model yet
    parallel_sizes: Callable[[ArchConfig], dict[str, int]] | None = None
    # its MTP draft head shards with the model (speculative method "mtp" with TP > 1)
    parallel_mtp: bool = False
    # its routed experts divide over data-parallel ranks (enable_expert_parallel; its
    # model, and MTP head, list them as `moe_layers`)
    expert_parallel: bool = False


def _llama_mtp(
    store: Any,
    model: Any,
    kernels: Kernels,
    draft_weights: str | None,
    known_name: str | None,
    quantize: str | None,
) -> Any:
    return load_mtp_head(store, model, kernels, draft_weights, known_name, quantize)


def _deepseek_mtp(
    store: Any,
    model: Any,
    kernels: Kernels,
    draft_weights: str | None,
    known_name: str | None,
    quantize: str | None,
) -> Any:
    return load_deepseek_mtp(store, model, kernels, draft_weights, quantize)


def _deepseek_v4_mtp(
    store: Any,
    model: Any,
    kernels: Kernels,
    draft_weights: str | None,
    known_name: str | None,
    quantize: str | None,
) -> Any:
    return load_deepseek_v4_mtp(store, model, kernels, draft_weights, quantize)


def _deepseek_v32_mtp(
    store: Any,
    model: Any,
    kernels: Kernels,
    draft_weights: str | None,
    known_name: str | None,
    quantize: str | None,
) -> Any:
    return load_deepseek_v32_mtp(store, model, kernels, draft_weights, quantize)


FAMILIES = (
    ModelFamily(
        "llama",
        ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
        llama.LlamaModel,
        llama.cache_groups,
        llama.weight_shapes,
        _llama_mtp,
        parallel_sizes=llama.parallel_sizes,
    ),
    ModelFamily(
        "deepseek",
        ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
        deepseek.DeepseekModel,
        deepseek.cache_groups,
        deepseek.weight_shapes,
        _deepseek_mtp,
        parallel_sizes=deepseek.parallel_sizes,
        parallel_mtp=True,
        expert_parallel=True,
    ),
    ModelFamily(
        "deepseek_v32",
        ("DeepseekV32ForCausalLM",),
        deepseek_v32.DeepseekV32Model,
        deepseek_v32.cache_groups,
        deepseek_v32.weight_shapes,
        _deepseek_v32_mtp,
        supports_side_rows=False,
        parallel_sizes=deepseek.parallel_sizes,
        parallel_mtp=True,
        expert_parallel=True,
    ),
    ModelFamily(
        "deepseek_v4",
        ("DeepseekV4ForCausalLM",),
        deepseek_v4.DeepseekV4Model,
        deepseek_v4.cache_groups,
        deepseek_v4.weight_shapes,
        _deepseek_v4_mtp,
        supports_side_rows=False,
        parallel_sizes=deepseek_v4_parallel_sizes,
        parallel_mtp=True,
        expert_parallel=True,
    ),
)


def family_for(arch: ArchConfig) -> ModelFamily:
    for family in FAMILIES:
        if arch.architecture in family.architectures:
            return family
    raise UnsupportedModelError(f"no model family runs {arch.architecture!r}")


def open_weights(ckpt: Checkpoint, device: torch.device, act_dtype: torch.dtype) -> WeightStore:
    """The checkpoint's weight store, checking tensor shapes against its family's."""
    shapes = family_for(ckpt.arch).weight_shapes(ckpt.arch)
    return WeightStore(ckpt, device, act_dtype, expected=shapes)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
