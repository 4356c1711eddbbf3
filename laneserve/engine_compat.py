"""vLLM engine flags that laneserve accepts only with the values that describe what
it does, and refuses otherwise with the reason (docs/compatibility.md).

- `kv_cache_dtype`: `auto` (the KV cache is kept in the model's dtype); fp8 KV
  caches are not implemented.
- `quantization`: the method the checkpoint already has (`fp8` for an FP8
  checkpoint, `gguf` for a GGUF file); laneserve does not quantize at load time.
- `load_format`: `auto` / `safetensors` (and `gguf` for a GGUF file).
- `enable_chunked_prefill`: long prompts are always prefilled in chunks of the step
  budget (as vLLM V1); turning it off is refused.
- `max_logprobs`: 0..20, enforced per request.
- `swap_space`: accepted with no effect: preemption recomputes, nothing swaps to CPU.
- vLLM's multi-node data-parallel flags: `data_parallel_address` and
  `data_parallel_rpc_port` name node 0's address and the port the other nodes' ranks
  reach it at, which are `master_addr` / `master_port` here: accepted as those, for
  data-parallel ranks over several nodes only. `data_parallel_size_local` and
  `data_parallel_start_rank` are refused: every node runs `data_parallel_size / nnodes`
  ranks, node k from rank k*L (`nnodes`, `node_rank`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from laneserve.config import ParallelConfig

LOGPROBS_CAP = 20  # the most top logprobs laneserve computes per token (OpenAI's limit)


def checkpoint_quantization(model: str | None) -> str | None:
    """The quantization the checkpoint itself carries: "gguf", its config's
    `quant_method`, or None."""
    if model is None or model.endswith(".gguf"):
        return "gguf"  # NOTE: None is the embedded default model, a GGUF file
    cfg = Path(model).expanduser() / "config.json"
    try:
        q = json.loads(cfg.read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    return str(method) if method else None


def check_vllm_flags(
    model: str | None,
    *,
    kv_cache_dtype: str,
    quantization: str | None,
    load_format: str,
    enable_chunked_prefill: bool | None,
    max_logprobs: int,
) -> None:
    """ValueError with the reason for a value laneserve cannot honour."""
    if kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported: laneserve keeps the KV "
            "cache in the model's dtype (use auto)"
        )
    own = checkpoint_quantization(model)
    if quantization is not None and quantization != own:
        raise ValueError(
            f"quantization {quantization!r} is not supported: laneserve does not quantize at "
            f"load time; this checkpoint is {own or 'not quantized'} "
            f"({'pass --quantization ' + own + ' or leave it out' if own else 'leave it out'})"
        )
    formats = ("auto", "safetensors", *(("gguf",) if own == "gguf" else ()))
    if load_format not in formats:
        raise ValueError(
            f"load_format {load_format!r} is not supported: laneserve loads safetensors "
            f"checkpoints and GGUF files (use one of {', '.join(formats)})"
        )
    if enable_chunked_prefill is False:
        raise ValueError(
            "enable_chunked_prefill cannot be turned off: laneserve always prefills long "
            "prompts in chunks of --max-num-batched-tokens"
        )
    if not 0 <= max_logprobs <= LOGPROBS_CAP:
        raise ValueError(
            f"max_logprobs must be in [0, {LOGPROBS_CAP}] (laneserve computes at most "
            f"{LOGPROBS_CAP} top logprobs per token), got {max_logprobs}"
        )


def data_parallel_rendezvous(
    master_addr: str,
    master_port: int,
    *,
    address: str | None,
    rpc_port: int | None,
    size_local: int | None,
    start_rank: int | None,
    over_nodes: bool,
) -> tuple[str, int]:
    """Node 0's address and port, from ours or vLLM's names for them; ValueError for
    vLLM's flags that have no exact equivalent, or for two names that disagree."""
    if size_local is not None or start_rank is not None:
        raise ValueError(
            "data_parallel_size_local / data_parallel_start_rank are not accepted: give "
            "--nnodes N and --node-rank k (node k runs data-parallel ranks k*L .. k*L+L-1, "
            "L = data_parallel_size / N) with --headless on nodes 1..N-1"
        )
    if (address is not None or rpc_port is not None) and not over_nodes:
        raise ValueError(
            "data_parallel_address / data_parallel_rpc_port name node 0 for data-parallel "
            "ranks over several nodes (--data-parallel-size D --nnodes N > 1); otherwise "
            "use --master-addr / --master-port"
        )
    default = ParallelConfig()
    return (
        _one_of("master_addr", master_addr, "data_parallel_address", address, default.master_addr),
        _one_of(
            "master_port", master_port, "data_parallel_rpc_port", rpc_port, default.master_port
        ),
    )


def _one_of(name: str, ours: object, vllm_name: str, theirs: object, default: object) -> Any:
    if theirs is None:
        return ours
    if ours != default and ours != theirs:
        raise ValueError(f"{name} {ours!r} and {vllm_name} {theirs!r} differ: give one of them")
    return theirs
