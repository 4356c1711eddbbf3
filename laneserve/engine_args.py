"""Engine arguments with vLLM's names, shared by `LLM(...)` and every CLI command.

Each field carries its help text (and its flag name where it differs) in the field
metadata; `add_cli_args` generates the flags from the fields, so a default is
written once. Defaults that the frozen config also has are read from it
(`_from_config`), so config, `EngineArgs` and the CLI cannot disagree.
"""

from __future__ import annotations

import argparse
import logging
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

import msgspec

from laneserve.chat_formats import TOKENIZER_MODES
from laneserve.config import (
    DEVICES,
    DTYPES,
    GGUF_WEIGHTS,
    QUANTIZED_WEIGHTS,
    WORKER_MODES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
    default_worker_mode,
    speculative_keys_help,
)
from laneserve.engine_compat import check_vllm_flags, data_parallel_rendezvous


def _arg(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A field with its CLI help; `flag` when the flag is not --field-name."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


def _from_config(struct: type[msgspec.Struct], name: str, help: str, **kw: Any) -> Any:
    """A field whose default is the config struct's own default for `name`."""
    (info,) = (f for f in msgspec.structs.fields(struct) if f.name == name)
    assert info.default is not msgspec.NODEFAULT, f"{struct.__name__}.{name} has no default"
    return _arg(info.default, help, **kw)


log = logging.getLogger(__name__)

_SPECULATIVE_HELP = "JSON object (default: no speculation); " + speculative_keys_help()


@dataclass
class EngineArgs:
    model: str | None = _arg(
        None, "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    tokenizer: str | None = _from_config(
        ModelConfig, "tokenizer", "tokenizer directory (default: the model's own)"
    )
    chat_template: str | None = _from_config(
        ModelConfig,
        "chat_template",
        "chat template: a file or the Jinja text itself (default: the tokenizer's)",
    )
    tokenizer_mode: str = _from_config(
        ModelConfig,
        "tokenizer_mode",
        "chat format: auto (DeepSeek V3.2 / V4 get their encoders in code, others their "
        "Jinja template), hf (always the Jinja template), or a format name for fine-tunes",
        choices=TOKENIZER_MODES,
    )
    skip_tokenizer_init: bool = _from_config(
        ModelConfig,
        "skip_tokenizer_init",
        "load no tokenizer: prompts are token ids, outputs token ids (text stays empty); "
        "text prompts, chat and stop strings are refused",
    )
    generation_config: str = _from_config(
        ModelConfig,
        "generation_config",
        "auto: unset sampling fields come from the model's generation_config.json; vllm: ignore it; or a folder",
    )
    dtype: str = _from_config(
        ModelConfig,
        "dtype",
        "weight and activation dtype; auto: the checkpoint's (bfloat16 for float16 on CPU)",
        choices=DTYPES,
    )
    gguf_weights: str = _from_config(
        ModelConfig,
        "gguf_weights",
        "GGUF files on CPU: quantized keeps q4_0/q4_1/q8_0/q4_k linear weights quantized, "
        "multiplied in exact fp32 (the results of dtype float32); q8-dot keeps them and "
        "rounds activations to int8 per 32 for integer dot products (llama.cpp's "
        "arithmetic); dequantized: every weight to --dtype; auto: q8-dot where the CPU has "
        "AVX-512 VNNI and --dtype is not float32, else quantized",
        choices=GGUF_WEIGHTS,
    )
    quantized_weights: str = _from_config(
        ModelConfig,
        "quantized_weights",
        "block-scaled fp8 / mxfp4 checkpoints (DeepSeek V3 / V4): keep the linear weights "
        "resident in their stored bytes and scales (CPU kernels: the same results as "
        "dequantized float32), or dequantize them to --dtype at load; auto: resident with the "
        "CPU kernels, else dequantized",
        choices=QUANTIZED_WEIGHTS,
    )
    device: str = _from_config(
        ModelConfig, "device", "auto: cuda when available, else cpu", choices=DEVICES
    )
    seed: int = _from_config(ModelConfig, "seed", "seed of requests sampled without their own")
    max_model_len: int | None = _from_config(
        ModelConfig,
        "max_model_len",
        "longest prompt + output in tokens (default: the model's own limit)",
    )
    block_size: int = _from_config(CacheConfig, "block_size", "tokens per KV cache block")
    kv_cache_memory: float = _from_config(
        CacheConfig, "kv_cache_memory_gib", "KV cache budget in GiB"
    )
    gpu_memory_utilization: float | None = _from_config(
        CacheConfig,
        "gpu_memory_utilization",
        "CUDA only: fraction of device memory for weights + KV, wins over --kv-cache-memory",
    )
    num_kv_blocks: int | None = _from_config(
        CacheConfig,
        "num_kv_blocks",
        "explicit KV block count, wins over --kv-cache-memory (default: from the budget)",
    )
    enable_prefix_caching: bool = _from_config(
        CacheConfig, "enable_prefix_caching", "reuse the KV blocks of shared prompt prefixes"
    )
    max_num_seqs: int = _from_config(
        SchedulerConfig, "max_num_seqs", "most requests running in one step"
    )
    max_num_batched_tokens: int = _from_config(
        SchedulerConfig, "max_num_batched_tokens", "most tokens computed in one step"
    )
    async_scheduling: bool = _from_config(
        SchedulerConfig, "async_scheduling", "schedule step N+1 while step N runs"
    )
    max_queued_requests: int | None = _from_config(
        SchedulerConfig,
        "max_queued_requests",
        "waiting requests beyond which new ones are refused (default: no limit)",
    )
    speculative_config: str | dict | SpeculativeConfig | None = field(
        default=None, metadata={"help": _SPECULATIVE_HELP}
    )
    worker_mode: str | None = _arg(
        None,
        "process: the model runs in a spawned worker process; thread: in this one "
        "(default: $LANESERVE_WORKER_MODE if set, else process)",
        choices=WORKER_MODES,
    )
    restart_worker: bool = _from_config(
        WorkerConfig, "restart_on_failure", "start a new worker process when one dies"
    )
    profile_dir: str | None = _from_config(
        WorkerConfig,
        "profile_dir",
        "write Chrome trace-event JSON per run here (default: no tracing)",
    )
    num_threads: int | None = _from_config(
        WorkerConfig, "num_threads", "torch threads in the worker (default: torch's choice)"
    )
    use_kernels: bool = _from_config(
        ModelConfig, "use_kernels", "CPU C++ kernels (built on first use)", flag="--kernels"
    )
    enforce_eager: bool = _from_config(
        ModelConfig,
        "enforce_eager",
        "CUDA: run every step eagerly, without capturing decode steps as CUDA graphs",
    )
    trust_remote_code: bool = _arg(
        False, "accepted for vLLM compatibility; no remote code ever runs here"
    )
    tensor_parallel_size: int = _arg(
        1, "ranks (devices) per model: tensor parallelism, Llama family (docs/distributed.md)"
    )
    data_parallel_size: int = _from_config(
        ParallelConfig,
        "data_parallel_size",
        "engine cores (scheduler, KV cache, worker) in this engine; each request is routed "
        "to one (docs/distributed.md)",
    )
    enable_expert_parallel: bool = _from_config(
        ParallelConfig,
        "enable_expert_parallel",
        "divide the routed experts of a mixture-of-experts model over the data-parallel "
        "ranks, which then step in lock step (docs/distributed.md)",
    )
    distributed_executor_backend: str = _arg(
        "mp", "how the ranks start: 'mp' (processes spawned by the worker)", choices=("mp",)
    )
    nnodes: int = _from_config(
        ParallelConfig,
        "nnodes",
        "machines the tensor-parallel ranks (or, with --enable-expert-parallel, the "
        "data-parallel ranks) are spread over",
    )
    node_rank: int = _from_config(
        ParallelConfig, "node_rank", "this machine's index (0: the engine's; others: --headless)"
    )
    master_addr: str = _from_config(
        ParallelConfig, "master_addr", "node 0's address, where the ranks of every node meet"
    )
    master_port: int = _from_config(
        ParallelConfig,
        "master_port",
        "node 0's rendezvous port (with --nnodes > 1): the tensor-parallel group's, or the "
        "engine's store that remote data-parallel ranks join",
    )
    # vLLM's multi-node data-parallel flags (engine_compat.py: two are other names of ours)
    data_parallel_address: str | None = _arg(
        None, "vLLM's name of --master-addr for data-parallel ranks over --nnodes"
    )
    data_parallel_rpc_port: int | None = _arg(
        None, "vLLM's name of --master-port for data-parallel ranks over --nnodes"
    )
    data_parallel_size_local: int | None = _arg(
        None, "not accepted: use --nnodes (each node runs data-parallel-size / nnodes ranks)"
    )
    data_parallel_start_rank: int | None = _arg(
        None, "not accepted: use --node-rank (node k runs ranks k*L .. k*L+L-1)"
    )
    # vLLM's flags with a narrower meaning here (engine_compat.py)
    kv_cache_dtype: str = _arg("auto", "KV cache dtype; only auto (the model's dtype)")
    quantization: str | None = _arg(
        None, "the checkpoint's own quantization (fp8, gguf); laneserve does not quantize"
    )
    load_format: str = _arg("auto", "auto or safetensors (gguf for a GGUF file)")
    enable_chunked_prefill: bool | None = _arg(
        None, "long prompts are always prefilled in chunks; turning it off is refused"
    )
    max_logprobs: int = _from_config(
        ModelConfig, "max_logprobs", "most logprobs / prompt_logprobs a request may ask for"
    )
    swap_space: float = _arg(
        4.0, "accepted with no effect: preemption recomputes, no KV block swaps to CPU"
    )
    disable_log_stats: bool = _arg(
        False, "accepted with no effect: laneserve logs no periodic stats line (see /metrics)"
    )

    def _check_compat(self) -> None:
        """vLLM's arguments that laneserve accepts with a narrower meaning."""
        check_vllm_flags(
            self.model,
            kv_cache_dtype=self.kv_cache_dtype,
            quantization=self.quantization,
            load_format=self.load_format,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_logprobs=self.max_logprobs,
        )
        if self.trust_remote_code:
            log.info("trust_remote_code: accepted; laneserve never runs a model's remote code")
        if self.gpu_memory_utilization is not None:
            from laneserve.model.loader import resolve_device

            if resolve_device(self.device).type != "cuda":
                raise ValueError(
                    "gpu_memory_utilization applies to CUDA devices only; on CPU set the "
                    "KV cache budget with --kv-cache-memory (GiB)"
                )

    def create_config(self) -> EngineConfig:
        self._check_compat()
        master_addr, master_port = data_parallel_rendezvous(
            self.master_addr,
            self.master_port,
            address=self.data_parallel_address,
            rpc_port=self.data_parallel_rpc_port,
            size_local=self.data_parallel_size_local,
            start_rank=self.data_parallel_start_rank,
            over_nodes=self.nnodes > 1 and self.data_parallel_size > 1,
        )
        from laneserve.model.limits import check_max_model_len

        # NOTE: before anything loads: a too long context is refused in a second
        check_max_model_len(self.model, self.max_model_len)
        cfg = EngineConfig(
            model=ModelConfig(
                model=self.model or "",
                tokenizer=self.tokenizer,
                chat_template=self.chat_template,
                tokenizer_mode=self.tokenizer_mode,
                skip_tokenizer_init=self.skip_tokenizer_init,
                generation_config=self.generation_config,
                dtype=self.dtype,
                device=self.device,
                max_model_len=self.max_model_len,
                seed=self.seed,
                use_kernels=self.use_kernels,
                gguf_weights=self.gguf_weights,
                quantized_weights=self.quantized_weights,
                enforce_eager=self.enforce_eager,
                max_logprobs=self.max_logprobs,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_gib=self.kv_cache_memory,
                num_kv_blocks=self.num_kv_blocks,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                async_scheduling=self.async_scheduling,
                max_queued_requests=self.max_queued_requests,
            ),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                nnodes=self.nnodes,
                node_rank=self.node_rank,
                master_addr=master_addr,
                master_port=master_port,
                data_parallel_size=self.data_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
            ),
            worker=WorkerConfig(
                mode=self.worker_mode or default_worker_mode(),
                restart_on_failure=self.restart_worker,
                profile_dir=self.profile_dir,
                num_threads=self.num_threads,
            ),
        )
        cfg.validate()
        return cfg

    @staticmethod
    def from_kwargs(kwargs: dict[str, Any]) -> EngineArgs:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(known)}")
        return EngineArgs(**kwargs)

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser, default_worker_mode: str | None = None
    ) -> None:
        """One flag per field; `default_worker_mode` overrides that one default (a server
        runs the model in a worker process)."""
        g = parser.add_argument_group("engine")
        hints = typing.get_type_hints(EngineArgs)
        for f in fields(EngineArgs):
            default, kind = f.default, _kind(hints[f.name], f)
            if f.name == "worker_mode" and default_worker_mode is not None:
                default = default_worker_mode  # NOTE: fixed here, whatever the environment
                kind["help"] = kind["help"].split(" (default:")[0]
            g.add_argument(cli_flag(f), dest=f.name, default=default, **kind)

    @staticmethod
    def from_cli(ns: argparse.Namespace) -> EngineArgs:
        return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})


def cli_flag(f: Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _kind(hint: Any, f: Field[Any]) -> dict[str, Any]:
    """argparse keywords (action or type, choices, help) for a field of type `hint`."""
    assert f.default is not MISSING, f"engine argument {f.name} needs a default"
    kw: dict[str, Any] = {"help": f.metadata["help"]}
    if f.metadata.get("choices"):
        kw["choices"] = f.metadata["choices"]
    options = typing.get_args(hint) or (hint,)
    if bool in options:
        kw["action"] = argparse.BooleanOptionalAction
        return kw
    # the first scalar of the union parses the flag (a JSON string for dict-or-str fields)
    kw["type"] = next(t for t in options if t in (int, float, str))
    return kw
