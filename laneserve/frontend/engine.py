"""`LLMEngine`: worker client + engine core + tokenizer + output processing.

Shared by the offline `LLM` (drives `step()` in a loop) and the server's
`AsyncLLM` (drives it from a background thread).
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from laneserve.chat_formats import resolve_chat_format
from laneserve.config import EngineConfig
from laneserve.core.data_parallel import DataParallelCore
from laneserve.core.engine_core import EngineCore, WorkerClient
from laneserve.core.lockstep import LockstepCore, with_rank
from laneserve.core.request import Request
from laneserve.core.scheduler import SchedulerStats
from laneserve.distributed.ports import free_port
from laneserve.frontend.generation_config import generation_defaults
from laneserve.frontend.no_tokenizer import WHY, NoTokenizer
from laneserve.frontend.output_processor import Delta, OutputProcessor, RequestState
from laneserve.frontend.tokenizer import Tokenizer
from laneserve.obs.profiling import Tracer
from laneserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from torch.distributed import Store

log = logging.getLogger(__name__)


def make_client(
    config: EngineConfig, tracer: Tracer, cancel: threading.Event | None = None
) -> WorkerClient:
    """Process worker, or in-process lanes (async) / inline steps (sync)."""
    if config.worker.mode == "process":
        from laneserve.ipc import ProcessClient

        return ProcessClient(config, tracer, cancel)
    from laneserve.worker.clients import InlineClient, LaneClient

    return LaneClient(config) if config.scheduler.async_scheduling else InlineClient(config)


def make_clients(config: EngineConfig, tracer: Tracer) -> list[WorkerClient]:
    """One worker per data-parallel rank, started together (each loads the model); if
    one fails to start, the others are cancelled or shut down and its error is raised.
    Across machines, node 0's ranks are local worker processes and the others' workers
    meet this engine's store (`RemoteClient`)."""
    p = config.parallel
    size = p.data_parallel_size
    if size == 1:
        return [make_client(config, tracer)]
    port = free_port(p.experts_addr) if p.expert_parallel_size > 1 else 0
    configs = [with_rank(config, r, port) for r in range(size)]
    store = None
    if p.data_parallel_over_nodes:
        from laneserve.distributed.remote_rendezvous import host_store

        store = host_store(p.master_addr, p.master_port)
    cancel = threading.Event()
    failed: list[BaseException] = []  # in the order the starts failed: the first is the cause
    with ThreadPoolExecutor(size, thread_name_prefix="dp-start") as pool:
        futures = [pool.submit(_rank_client, c, tracer, cancel, store) for c in configs]
        for f in futures:
            f.add_done_callback(lambda f: _cancel_on_failure(f, cancel, failed))
        wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    if failed:
        for client in started:
            client.shutdown()
        raise failed[0]
    return started


def _cancel_on_failure(
    future: Future, cancel: threading.Event, failed: list[BaseException]
) -> None:
    """A rank's start failed: the others stop waiting for their workers."""
    error = future.exception()
    if error is not None:
        failed.append(error)
        cancel.set()


def _rank_client(
    config: EngineConfig, tracer: Tracer, cancel: threading.Event, store: Store | None
) -> WorkerClient:
    """A data-parallel rank's client: its worker on this machine, or on another one."""
    p = config.parallel
    if store is None or p.data_parallel_rank < p.dp_ranks_per_node:
        return make_client(config, tracer, cancel)
    from laneserve.remote_client import RemoteClient

    return RemoteClient(config, store, tracer, cancel)


def _architectures(model_dir: Path) -> list[str]:
    """config.json's `architectures` (empty where there is none)."""
    try:
        archs = json.loads((model_dir / "config.json").read_text()).get("architectures")
    except (OSError, ValueError):
        return []
    return [a for a in archs or [] if isinstance(a, str)]


class LLMEngine:
    def __init__(self, config: EngineConfig, client: WorkerClient | None = None) -> None:
        self.config = config
        self.tracer = Tracer(config.worker.profile_dir, role="engine")
        self.core: EngineCore | DataParallelCore
        if client is not None and config.parallel.data_parallel_size > 1:
            raise ValueError("one worker client given for data_parallel_size > 1")
        if client is None and config.parallel.data_parallel_size > 1:
            self.clients = make_clients(config, self.tracer)
            lockstep = config.parallel.expert_parallel_size > 1  # every rank runs every step
            core_class = LockstepCore if lockstep else DataParallelCore
            self.core = core_class(config, self.clients, self.tracer)
        else:
            self.clients = [client or make_client(config, self.tracer)]
            self.core = EngineCore(config, self.clients[0], self.tracer)
        self.client = self.clients[0]  # rank 0's (the only one without data parallelism)
        ready = self.client.ready
        self.model_dir = Path(ready.model_dir)
        self.tokenizer: Tokenizer | NoTokenizer = (
            NoTokenizer(ready.vocab_size)
            if config.model.skip_tokenizer_init
            else Tokenizer(
                config.model.tokenizer or ready.model_dir,
                config.model.chat_template,
                resolve_chat_format(config.model.tokenizer_mode, _architectures(self.model_dir)),
            )
        )
        self.processor = OutputProcessor(self.tokenizer)
        # defaults for unset sampling fields (--generation-config)
        self.sampling_defaults = generation_defaults(config.model.generation_config, self.model_dir)
        self.eos_token_ids = _eos_ids(self.model_dir, ready.eos_token_ids, self.tokenizer)
        self.groups: dict[str, list[RequestState]] = {}

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt), None
        raise ValueError(
            f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> list[RequestState]:
        """Add one request (n samples); raises ValueError before adding anything."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already running")
        self.check_request(prompt_ids, params)
        self.core.check_queue(params.n)
        states = []
        for i in range(params.n):
            child = params if params.n == 1 else _child_params(params, i)
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            req = self.core.add_request(rid, prompt_ids, child, self.eos_token_ids)
            states.append(self.processor.add(req, request_id, i, prompt))
        self.groups[request_id] = states
        return states

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The limits of this model (context, vocabulary); ValueError names the field."""
        self.core.check_prompt(prompt_ids)
        self.core.check_params(params)
        limit = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > limit:
                raise ValueError(f"{name}: {asked} is over the server's --max-logprobs ({limit})")
        vocab = self.core.ready.vocab_size
        bad = next((t for t in params.stop_token_ids or () if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
        if isinstance(self.tokenizer, NoTokenizer) and params.stop_strings:
            raise ValueError(f"stop: stop strings need the text; {WHY} (use stop_token_ids)")

    def abort(self, request_id: str) -> list[RequestState]:
        """Drop every sample of the request; returns those that had not finished."""
        dropped = []
        for state in self.groups.pop(request_id, []):
            if state.finish_reason is None and state.error is None:
                dropped.append(state)
            self.core.abort(state.request)
            self.processor.abort(state.request.handle)  # sets its finish_reason
        return dropped

    def step(self) -> list[Delta]:
        return self._process(self.core.step())

    def check_worker(self) -> list[Delta]:
        """Failures of every request if the worker process died (else nothing)."""
        return self._process(self.core.check_worker())

    def restart_worker(self) -> list[Delta]:
        """A new worker now; if it fails to start, the failures of the waiting requests."""
        return self._process(self.core.restart_worker())

    def _process(self, outputs: list) -> list[Delta]:
        with self.tracer.span("detokenize", "engine"):
            deltas, to_abort = self.processor.process(outputs)
        for req in to_abort:
            self.core.abort(req)
        for d in deltas:
            if d.finished:
                self._maybe_close_group(d.state)
        return deltas

    def _maybe_close_group(self, state: RequestState) -> None:
        group = self.groups.get(state.group_id)
        if group is not None and all(s.finish_reason is not None for s in group):
            del self.groups[state.group_id]

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished

    def shutdown(self) -> None:
        self.core.shutdown()
        self.tracer.flush()

    def stats(self) -> dict:
        """Counters summed over the data-parallel ranks (rank_stats: each rank's own)."""
        ranks = [rank_stats(r) for r in self.core.ranks]
        out: dict[str, Any] = {k: sum(r[k] for r in ranks) for k in ranks[0]}
        out["kv_cache_usage"] = max(r["kv_cache_usage"] for r in ranks)
        if isinstance(self.core, DataParallelCore):
            routed = self.core.router.routed
            for i, r in enumerate(ranks):  # requests the router sent to each rank
                r["num_routed"] = routed[i] if i < len(routed) else 0
            out["data_parallel_ranks"] = ranks
            out["num_routed_by_prefix"] = self.core.router.by_prefix
        s = merged_stats(self.core.ranks)
        if self.config.speculative is not None:
            out.update(
                {
                    "spec_num_drafts": s.num_drafts,
                    "spec_num_accepted": s.num_accepted,
                    "spec_acceptance_rate": s.num_accepted / s.num_drafts if s.num_drafts else 0.0,
                    "spec_acceptance_per_position": [
                        a / d if d else 0.0
                        for a, d in zip(s.accepted_per_position, s.drafts_per_position, strict=True)
                    ],
                    # raw counts, so that a caller can take the difference of two snapshots
                    "spec_num_drafts_per_position": list(s.drafts_per_position),
                    "spec_num_accepted_per_position": list(s.accepted_per_position),
                }
            )
        return out


def rank_stats(core: EngineCore) -> dict[str, Any]:
    s, kv = core.scheduler.stats, core.kv
    return {  # counters and the cache's state
        "num_steps": s.num_steps,
        "num_preemptions": s.num_preemptions,
        "num_prefill_chunks": s.num_prefill_chunks,
        "num_prompt_tokens": s.num_prompt_tokens,
        "num_generation_tokens": s.num_generation_tokens,
        "num_scheduled_tokens": s.num_scheduled_tokens,
        "prefix_cache_queries": kv.prefix_queries,
        "prefix_cache_hits": kv.prefix_hits,
        "kv_cache_usage": kv.usage,
        "num_free_blocks": kv.num_free_blocks,
    }


def merged_stats(cores: list[EngineCore]) -> SchedulerStats:
    """The speculation counters of every rank (one rank: its own stats object)."""
    if len(cores) == 1:
        return cores[0].scheduler.stats
    total = SchedulerStats()
    for core in cores:
        s = core.scheduler.stats
        total.num_drafts += s.num_drafts
        total.num_accepted += s.num_accepted
        total.drafts_per_position = _add(total.drafts_per_position, s.drafts_per_position)
        total.accepted_per_position = _add(total.accepted_per_position, s.accepted_per_position)
    return total


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    # NOTE: wrapped into int64 so that a child of a seed near the top stays valid
    seed = None if params.seed is None else (params.seed + index + 2**63) % 2**64 - 2**63
    return msgspec.structs.replace(params, n=1, seed=seed)


def _eos_ids(
    model_dir: Path, config_eos: list[int], tokenizer: Tokenizer | NoTokenizer
) -> tuple[int, ...]:
    ids = list(config_eos)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            value = None
        ids += value if isinstance(value, list) else ([value] if isinstance(value, int) else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


__all__ = ["LLMEngine", "Request"]
