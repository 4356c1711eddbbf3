"""Engine arguments with vLLM's names, shared by `LLM(...)` and every CLI command."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from laneserve.config import (
    DEVICES,
    DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
)


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    async_scheduling: bool = True
    max_queued_requests: int | None = None
    speculative_config: str | dict | SpeculativeConfig | None = None
    worker_mode: str = "thread"
    restart_worker: bool = True
    profile_dir: str | None = None
    num_threads: int | None = None
    use_kernels: bool = True

    def create_config(self) -> EngineConfig:
        cfg = EngineConfig(
            model=ModelConfig(
                model=self.model or "",
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                device=self.device,
                max_model_len=self.max_model_len,
                seed=self.seed,
                use_kernels=self.use_kernels,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_gib=self.kv_cache_memory,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                async_scheduling=self.async_scheduling,
                max_queued_requests=self.max_queued_requests,
            ),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            worker=WorkerConfig(
                mode=self.worker_mode,
                restart_on_failure=self.restart_worker,
                profile_dir=self.profile_dir,
                num_threads=self.num_threads,
            ),
        )
        cfg.validate()
        return cfg

    @staticmethod
    def from_kwargs(kwargs: dict) -> EngineArgs:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(known)}")
        return EngineArgs(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, default_worker_mode: str = "thread") -> None:
        g = parser.add_argument_group("engine")
        g.add_argument(
            "--model",
            default=None,
            help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
        )
        g.add_argument("--tokenizer", default=None)
        g.add_argument("--dtype", default="auto", choices=DTYPES)
        g.add_argument("--device", default="auto", choices=DEVICES)
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument(
            "--kv-cache-memory", type=float, default=None, help="KV cache budget in GiB (default 2)"
        )
        g.add_argument("--num-kv-blocks", type=int, default=None, help="explicit KV block count")
        g.add_argument(
            "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
        )
        g.add_argument("--max-num-seqs", type=int, default=64)
        g.add_argument("--max-num-batched-tokens", type=int, default=2048)
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--max-queued-requests", type=int, default=None)
        g.add_argument(
            "--speculative-config",
            default=None,
            help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 1}\'',
        )
        g.add_argument("--worker-mode", default=default_worker_mode, choices=("thread", "process"))
        g.add_argument("--restart-worker", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument(
            "--profile-dir", default=None, help="write Chrome trace-event JSON per run here"
        )
        g.add_argument("--num-threads", type=int, default=None, help="torch threads in the worker")
        g.add_argument(
            "--kernels",
            dest="use_kernels",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="CPU C++ kernels",
        )

    @staticmethod
    def from_cli(ns: argparse.Namespace) -> EngineArgs:
        return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})
