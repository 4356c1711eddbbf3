"""The worker: loads the model, owns the KV cache and the per-request state, and
runs steps as four stages that the lanes (`worker/lanes.py`) put on threads:

```
 command(item) -> decode, register new requests                 (command lane)
 prepare(cmd)  -> apply deltas, build StepInputs in a free slot  (prepare lane)
 device_step   -> forward+sample, release earlier-finished slots (device lane)
 reclaim(out)  -> device->host copy, StepResult                  (output lane)
```
A stage that fails hands a `StepFailure` to the next one instead of its product;
it travels the same path, so its releases still happen on the device stage in
step order and its error result keeps its place. `run_step` chains the four
stages in the caller's thread (the synchronous path).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from laneserve import protocol
from laneserve.config import EngineConfig
from laneserve.core.engine_core import read_lookahead
from laneserve.distributed.expert_parallel import NO_EXPERTS, ExpertParallel, join_experts
from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import CpuKernels, get_kernels
from laneserve.kv_cache_interface import CacheGroupSpec
from laneserve.model.interface import PAGED, TOKEN_TABLES, CausalLM, DraftHead
from laneserve.model.loader import (
    Checkpoint,
    WeightStore,
    resolve_checkpoint,
    resolve_device,
    resolve_gguf_weights,
)
from laneserve.model.registry import dtype_bytes, family_for, open_weights
from laneserve.obs.lane_times import LaneClock
from laneserve.obs.profiling import TP_ROLE, Tracer
from laneserve.protocol import (
    CacheGroupInfo,
    StepCommand,
    StepResult,
    WorkerReady,
)
from laneserve.spec_decode.proposers import MtpProposer, NgramProposer
from laneserve.structured.matchers import GrammarBook
from laneserve.worker.cuda_graphs import DecodeGraphs
from laneserve.worker.cuda_graphs_tables import TokenTableDecodeGraphs
from laneserve.worker.expert_steps import ExpertSteps
from laneserve.worker.failures import (
    Rejections,
    StepFailure,
    failed_result,
    handles_of,
    lenient_decode,
    salvage,
    with_errors,
)
from laneserve.worker.input_batch import InputSlot, RequestTable
from laneserve.worker.kv_cache import KvCache, StepBounds, num_blocks_for
from laneserve.worker.model_runner import ModelRunner
from laneserve.worker.rank_steps import RankStep, decode_step, encode_step, end_rank
from laneserve.worker.ranks import RankGroup, check_supported, rank_device
from laneserve.worker.step_inputs import InputLayout, StepInputs, build_inputs
from laneserve.worker.step_outputs import DeviceOutputs

log = logging.getLogger(__name__)


@dataclass
class PendingStep:
    """A decoded command on its way to the prepare lane."""

    cmd: StepCommand
    new_prompts: list[tuple[int, torch.Tensor]]
    releases: list[tuple[int, int]] = field(default_factory=list)  # (slot, gen)


def _tracer(config: EngineConfig, tp: TensorParallel) -> Tracer:
    """A rank's worker traces under its rank: data-parallel workers as "worker rank K",
    tensor-parallel ones as "worker-tp rank K" (their steps are shared: trace_analysis)."""
    if tp.size > 1:
        return Tracer(config.worker.profile_dir, role=TP_ROLE, rank=tp.rank)
    dp = config.parallel
    rank = dp.data_parallel_rank if dp.data_parallel_size > 1 else None
    return Tracer(config.worker.profile_dir, role="worker", rank=rank)


class Worker:
    group: RankGroup | None = None  # tensor parallel: this rank's group (worker/ranks.py)
    tp: TensorParallel = SINGLE  # this rank's view of the group (one rank without one)
    ep: ExpertParallel = NO_EXPERTS  # expert parallel: the data-parallel ranks' group
    expert_steps: ExpertSteps | None = None  # ... and the exchanges every step makes

    def __init__(self, config: EngineConfig, group: RankGroup | None = None) -> None:
        start = time.perf_counter()
        self.config = config
        self.group = group
        self.tp = group.tp if group is not None else SINGLE
        self.tracer = _tracer(config, self.tp)
        self.lane_clock = LaneClock(config.worker.lane_times)
        threads = config.worker.num_threads or _host_share(config)
        if threads:
            torch.set_num_threads(threads)
        # NOTE: a data-parallel rank (never combined with tensor parallelism) has its own
        # device, numbered on its node
        p = config.parallel
        index = p.data_parallel_rank % p.dp_ranks_per_node + self.tp.rank
        self.device = rank_device(resolve_device(config.model.device), index)
        self.ep = self._join_experts()
        m = config.model
        # the checkpoint before the kernels: a bad --model fails before any kernel build
        self.ckpt: Checkpoint = self._checkpoint(m.gguf_weights)
        self.kernels = get_kernels(self.device, enable=m.use_kernels)
        vnni = isinstance(self.kernels, CpuKernels) and self.kernels.vnni
        self.gguf_weights = resolve_gguf_weights(m.gguf_weights, m.dtype, vnni)
        if self.gguf_weights != "quantized" and m.gguf_weights == "auto":  # read as quantized
            self.ckpt = self._checkpoint(self.gguf_weights)
        arch = self.ckpt.arch
        self.act_dtype = torch.float32 if self.device.type == "cpu" else self.ckpt.weight_dtype
        self.max_model_len = _max_model_len(config, self.ckpt)
        spec = config.speculative
        self.max_spec = spec.depth if spec else 0
        # positions a row can reach (drafts past max_model_len included), and the block-table
        # columns every step's tables carry past a row's blocks for them
        self.max_positions = self.max_model_len + self.max_spec + 2
        self.pad_cols = self.max_spec + 1
        self.side_width = spec.num_candidates - 1 if spec else 0  # token tree alternatives
        store = open_weights(self.ckpt, self.device, self.act_dtype)
        self.family = family_for(arch)
        if self.tp.size > 1:
            quantized = store.quantized is not None
            check_supported(self.family, arch, self.tp.size, quantized, config.speculative)
        if self.ep.size > 1 and not self.family.expert_parallel:
            raise ValueError(
                f"enable_expert_parallel: the {self.family.name} family has no expert-parallel "
                "model (supported: DeepSeek V2 / V3, V3.2 and V4)"
            )
        self.model, self.mtp = self._load_model(store)
        self.expert_steps = self._expert_steps()
        self.block_size = config.cache.block_size
        self.groups = self._cache_groups()
        self.num_blocks = self._num_blocks()
        self.kv = self._allocate_cache()
        self.side_base = self.kv.side_base  # first side-row scratch slot (main group)
        self.table = RequestTable(
            len(self.groups), self.block_size, self.device, self.max_model_len
        )
        self.grammars = GrammarBook(
            Path(config.model.tokenizer or self.ckpt.directory) / "tokenizer.json",
            arch.vocab_size,
            list(arch.eos_token_ids),
        )
        self.rejections = Rejections()  # requests failed alone, per step
        self.runner = self._build_runner()
        self.input_slots, self.input_layout = self._inputs()
        self.load_s = time.perf_counter() - start
        self._log_ready()

    # -- set-up ------------------------------------------------------------
    def _load_model(self, store: WeightStore) -> tuple[CausalLM, DraftHead | None]:
        """The family's model and, for MTP speculation, its draft head."""
        arch, spec = self.ckpt.arch, self.config.speculative
        model = self.family.model_class(
            arch,
            self.kernels,
            store,
            self.device,
            self.act_dtype,
            self.max_positions,
            **({"tp": self.tp} if self.tp.size > 1 else {}),
            **({"ep": self.ep} if self.ep.size > 1 else {}),
        )
        if spec is None or spec.method != "mtp":
            return model, None
        mtp = self.family.load_mtp(
            store, model, self.kernels, spec.draft_weights, self.ckpt.known_name, spec.quantization
        )
        return model, mtp

    def _join_experts(self) -> ExpertParallel:
        """Expert parallelism: join the data-parallel ranks' group (before the model loads)."""
        p = self.config.parallel
        if p.expert_parallel_size == 1:
            return NO_EXPERTS
        port = p.data_parallel_master_port
        addr = p.experts_addr
        return join_experts(p.data_parallel_rank, p.data_parallel_size, addr, port, self.device)

    def _expert_steps(self) -> ExpertSteps | None:
        if self.ep.size == 1:
            return None
        model: Any = self.model  # NOTE: an expert-parallel family has `moe_layers`
        draft = self.mtp.moe_layers if self.mtp is not None else []  # type: ignore[attr-defined]
        k = self.max_spec if self.mtp is not None else 0
        return ExpertSteps(self.ep, model.moe_layers, draft, k, self.act_dtype, self.device)

    def _build_runner(self) -> ModelRunner:
        vocab = self.ckpt.arch.vocab_size
        return ModelRunner(
            self.model,
            self.kv,
            self.block_size,
            self.table.slots,
            self.device,
            self.max_model_len,
            self.max_spec,
            vocab,
            proposer=self._proposer(),
            side_width=self.side_width,
            grammars=self.grammars,
            graphs=self._decode_graphs(),
        )

    def _decode_graphs(self) -> DecodeGraphs | TokenTableDecodeGraphs | None:
        """CUDA graphs of decode steps (on CUDA, unless enforce_eager)."""
        eager = self.config.model.enforce_eager or self.tp.size > 1 or self.ep.size > 1
        if self.device.type != "cuda" or eager:
            return None  # NOTE: no collectives inside a graph yet
        return self.decode_graphs()

    def decode_graphs(self, capture: bool = True) -> DecodeGraphs | TokenTableDecodeGraphs | None:
        """The target's decode-step buckets (None: a model they do not cover);
        `capture=False` runs each bucket's padded forward eagerly (the CPU tests)."""
        max_rows = self.config.scheduler.max_num_seqs
        columns = tuple(-(-self.max_positions // g.block_size) + self.pad_cols for g in self.groups)
        kind = self.model.decode_graph_kind
        if kind == TOKEN_TABLES:  # it reads every cache group
            return TokenTableDecodeGraphs(
                self.model,
                self.kv.layers,
                self.block_size,
                tuple(self.num_blocks),  # per group: the scratch block
                max_rows,
                columns,
                self.max_positions,
                capture,
            )
        if kind != PAGED:
            return None
        return DecodeGraphs(
            self.model,
            self.kv.layers[0],
            self.block_size,
            self.num_blocks[0],  # the main group's scratch block
            max_rows,
            columns[0],
            capture,
        )

    def _inputs(self) -> tuple[list[InputSlot], InputLayout]:
        """The two ping-pong input slots and the constant layout of every step's inputs."""
        sched = self.config.scheduler
        slots = [InputSlot(i, sched.max_num_batched_tokens, sched.max_num_seqs) for i in range(2)]
        self.shared_generator = torch.Generator(device=self.device)
        self.shared_generator.manual_seed(self.config.model.seed)
        layout = InputLayout(
            self.device,
            self.ckpt.arch.vocab_size,
            tuple(self.num_blocks),  # per group: the scratch block id
            self.pad_cols,
            self.side_width,
            self.side_base,
            self.shared_generator,
        )
        return slots, layout

    def _log_ready(self) -> None:
        log.info(
            "worker ready: %s %s on %s, %s KV blocks of %d tokens, kernels=%s%s, %.1f s",
            self.ckpt.arch.architecture,
            str(self.ckpt.weight_dtype).removeprefix("torch."),
            self.device,
            self.num_blocks,
            self.block_size,
            type(self.kernels).__name__,
            f", GGUF weights {self.gguf_weights}" if self.ckpt.gguf_quantized else "",
            self.load_s,
        )
        local = self._local_experts()
        if local:
            log.info(
                "expert parallel rank %d of %d: routed experts %d..%d of each MoE layer",
                self.ep.rank,
                self.ep.size,
                local[0],
                local[-1],
            )

    def _cache_groups(self) -> list[CacheGroupSpec]:
        """The family's cache groups: its layers, plus the MTP layer's own cache."""
        size = dtype_bytes(self.ckpt.weight_dtype)
        mtp_layers = 1 if self.mtp is not None else 0
        if self.tp.size > 1:  # a rank caches its share of the kv heads
            return self.family.cache_groups(
                self.ckpt.arch, self.block_size, size, mtp_layers, self.tp.size
            )
        return self.family.cache_groups(self.ckpt.arch, self.block_size, size, mtp_layers)

    def _proposer(self) -> NgramProposer | MtpProposer | None:
        spec = self.config.speculative
        if spec is None:
            return None
        lookup = NgramProposer(
            self.kernels, spec.depth, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
        if spec.method == "ngram":
            return lookup
        assert self.mtp is not None
        groups = self.kv.group_indices(self.mtp.cache_groups)
        return MtpProposer(
            self.mtp,
            spec.depth,
            [self.kv.layers[g][0] for g in groups],  # each group's one layer
            self.block_size,
            self.side_width,
            lookup if spec.ngram_first else None,
        )

    def _num_blocks(self) -> list[int]:
        cache = self.config.cache
        gib = cache.kv_cache_memory_gib
        budget = int(gib * 2**30) if gib else None
        if cache.gpu_memory_utilization is not None:
            budget = kv_budget_from_utilization(self.device, cache.gpu_memory_utilization)
        sched = self.config.scheduler
        bounds = StepBounds(
            read_lookahead(self.config.speculative),
            sched.max_num_batched_tokens,
            sched.max_num_seqs,
            self.max_model_len + self.max_spec + 1,
        )
        blocks = num_blocks_for(
            self.groups, budget, cache.num_kv_blocks, self.block_size, self.max_model_len, bounds
        )
        if self.group is not None:  # the smallest budget over the ranks
            blocks = self.group.min_over_ranks(blocks, self.device)
        return blocks

    def _allocate_cache(self) -> KvCache:
        if self.side_width and not self.family.supports_side_rows:
            raise ValueError(
                f"{self.ckpt.arch.architecture} does not support token trees "
                "(num_candidates > 1) in speculative decoding"
            )
        side_slots = self.side_width * self.config.scheduler.max_num_seqs
        dtype = self.ckpt.weight_dtype
        return KvCache.allocate(self.groups, self.num_blocks, side_slots, self.device, dtype)

    def ready(self) -> WorkerReady:
        return WorkerReady(
            cache_groups=[
                CacheGroupInfo(g.name, g.kind, n, g.block_size, g.window)
                for g, n in zip(self.groups, self.num_blocks, strict=True)
            ],
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.ckpt.arch.vocab_size,
            eos_token_ids=list(self.ckpt.arch.eos_token_ids),
            model_dir=str(self.ckpt.directory),
            device=str(self.device),
            weight_dtype=str(self.ckpt.weight_dtype).removeprefix("torch."),
            kernels=type(self.kernels).__name__,
            load_s=self.load_s,
            local_experts=self._local_experts(),
        )

    def _local_experts(self) -> list[int]:
        if self.expert_steps is None or not self.expert_steps.sequence:
            return []
        return list(self.expert_steps.sequence[0].local)

    @property
    def supports_async_prepare(self) -> bool:
        """Whether step N+1 may be prepared while step N runs (a model capability)."""
        return self.model.supports_async_prepare

    # -- stages --------------------------------------------------------------
    # NOTE: a stage never raises (a raise would end its lane's thread): it returns
    # its product or a StepFailure, which the later stages pass on unchanged, except
    # that `device_step` still performs the step's releases and `reclaim` turns it into
    # the step's error result. `run_step` and the lanes take this same path.
    def command(self, item: StepCommand | bytes) -> PendingStep | StepFailure:
        """Decode the command and register its new requests (rank 0 of several: then
        send the command, with the requests that failed alone, to the other ranks)."""
        pending = self._command(item)
        if self.group is not None and self.group.leader:
            self._send_to_followers(item, pending)
        return pending

    def _checkpoint(self, gguf_weights: str) -> Checkpoint:
        m = self.config.model
        return resolve_checkpoint(
            m.model,
            m.dtype,
            self.device,
            gguf_weights,
            # NOTE: shards are cut from dequantized values (config refuses "resident" there)
            m.quantized_weights if self.tp.size == 1 else "dequantized",
            # the CPU kernels multiply fp8 / fp4 as stored; the torch path would dequantize
            # row blocks on every call (the slow path)
            native_scaled=self.device.type == "cpu" and m.use_kernels,
        )

    def follow(self, data: bytes) -> None:
        """A follower rank's step: the command less the requests rank 0 failed alone,
        then the same stages; a failure rank 0 did not have ends this rank."""
        step = decode_step(data)
        if step.skip:
            return
        pending = self._command(step.command, set(step.rejected))
        if isinstance(pending, StepFailure):
            end_rank(self.tp.rank, f"step {pending.step_id}: {pending.message}")
        mine = self.rejections.of(pending.cmd.step_id)
        if set(mine) != set(step.rejected):
            end_rank(self.tp.rank, f"step {pending.cmd.step_id}: rejected {mine} on this rank")
        self.reclaim(self.device_step(self.prepare(pending, self.input_slots[0])))

    def _send_to_followers(
        self, item: StepCommand | bytes, pending: PendingStep | StepFailure
    ) -> None:
        assert self.group is not None
        data = item if isinstance(item, bytes) else protocol.encode(item)
        if isinstance(pending, StepFailure):
            step = RankStep(data, [], skip=True)
        else:
            step = RankStep(data, sorted(self.rejections.of(pending.cmd.step_id)))
        try:
            self.group.send(encode_step(step))
        except OSError as e:  # a follower is gone (its watcher ends this rank too)
            end_rank(self.tp.rank, f"sending step to the other ranks failed: {e}")

    def _ranked_failure(self, what: str) -> None:
        """With several ranks, a failure in a later stage ends this rank (rank_steps.py);
        with expert parallelism too (the other ranks wait for its exchanges)."""
        if self.tp.size > 1:
            end_rank(self.tp.rank, what)
        if self.ep.size > 1:
            end_rank(self.ep.rank, what)

    def _command(
        self, item: StepCommand | bytes, skip: set[int] | None = None
    ) -> PendingStep | StepFailure:
        try:
            cmd = item if isinstance(item, StepCommand) else protocol.decode_command(item)
        except Exception as e:
            assert isinstance(item, bytes), "only an encoded command fails to decode"
            try:  # NOTE: one request that does not decode fails alone
                cmd, bad = lenient_decode(item)
            except Exception:
                step_id, handles = salvage(item)
                log.warning("malformed step command %s: %s", step_id, e)
                return StepFailure(step_id, handles, f"malformed step command: {e}")
            for handle, message in bad.items():
                log.warning("step %d: request %d rejected: %s", cmd.step_id, handle, message)
                self.rejections.add(cmd.step_id, handle, message)
        try:
            return self._register(cmd, skip or set())
        except Exception as e:
            log.warning("malformed step command %s: %s", cmd.step_id, e)
            return StepFailure(cmd.step_id, handles_of(cmd), f"malformed step command: {e}")

    def _register(self, cmd: StepCommand, skip: set[int]) -> PendingStep:
        with self.tracer.span("command", step=cmd.step_id):
            prompts = []
            for new in cmd.new_requests:
                if new.handle in skip:  # rank 0 failed it alone
                    self.rejections.add(cmd.step_id, new.handle, "request rejected on rank 0")
                    continue
                try:
                    prompts.append(self._register_one(new))
                except Exception as e:  # NOTE: this request fails alone (see failures.py)
                    log.warning("step %d: request %d rejected: %s", cmd.step_id, new.handle, e)
                    self.rejections.add(cmd.step_id, new.handle, f"request rejected: {e}")
            return PendingStep(cmd, prompts)

    def _register_one(self, new: protocol.NewRequest) -> tuple[int, torch.Tensor]:
        """Its grammar first: a request whose grammar fails is never registered."""
        if new.sampling_params.structured_outputs is not None:
            self.grammars.add(new.handle, new.sampling_params.structured_outputs)
        try:
            req = self.table.register(new)
        except Exception:
            self.grammars.drop([new.handle])
            raise
        ids = torch.tensor(new.prompt_token_ids, dtype=torch.int64).to(self.device)
        return req.slot, ids

    def prepare(self, pending: PendingStep, slot: InputSlot) -> StepInputs | StepFailure:
        """Apply the command's deltas and build the step's inputs in `slot`."""
        try:
            return self._build_inputs(pending, slot)
        except Exception as e:
            step_id = pending.cmd.step_id
            log.exception("prepare failed for step %d", step_id)
            self._ranked_failure(f"prepare failed for step {step_id}: {e}")
            # the requests popped before the failure are still released (device stage)
            message = f"prepare failed: {e}"
            return StepFailure(step_id, handles_of(pending.cmd), message, pending.releases)

    def _build_inputs(self, pending: PendingStep, slot: InputSlot) -> StepInputs:
        cmd = pending.cmd
        with self.lane_clock.span(self.tracer, "prepare", "prepare", cmd.step_id):
            # NOTE: first, so a failure below still releases them (device lane).
            pending.releases = self.table.pop_finished(cmd.finished)
            self.grammars.drop(cmd.finished)
            for handle in cmd.preempted:
                self.table.preempt(handle)
            cmd = pending.cmd = self._without_rejected(cmd)
            for s in cmd.scheduled:
                self.table.apply_blocks(s)
            return build_inputs(
                cmd, self.table, slot, self.input_layout, pending.new_prompts, pending.releases
            )

    def _without_rejected(self, cmd: StepCommand) -> StepCommand:
        """The command less the requests that fail alone: those rejected in this
        step, and those the worker does not know (rejected in an earlier one)."""
        rejected = self.rejections.of(cmd.step_id)
        keep = []
        for s in cmd.scheduled:
            if s.handle not in rejected and s.handle not in self.table.requests:
                message = f"request {s.handle} is not known to the worker (it failed earlier)"
                self.rejections.add(cmd.step_id, s.handle, message)
                rejected[s.handle] = message
            if s.handle not in rejected:
                keep.append(s)
        if len(keep) == len(cmd.scheduled):
            return cmd
        return msgspec.structs.replace(cmd, scheduled=keep)

    def device_step(self, staged: StepInputs | StepFailure) -> DeviceOutputs | StepFailure:
        """Forward + sample; then release the requests that finished before this
        step, whether or not this step (or an earlier stage of it) failed.

        NOTE: steps reach this stage in order (one device lane), so every earlier
        step that could still read the released state has run by then."""
        out = staged if isinstance(staged, StepFailure) else self._execute(staged)
        try:
            with self.tracer.span("release", "device", step=staged.step_id):
                self.runner.release(staged.releases)
        except Exception as e:
            log.exception("release failed for step %d", staged.step_id)
            self._ranked_failure(f"release failed for step {staged.step_id}: {e}")
            return StepFailure(staged.step_id, handles_of(staged), f"release failed: {e}")
        finally:
            self.grammars.fence.handed_on()  # NOTE: every step, so that reclaim pairs up
        return out

    def _execute(self, inp: StepInputs) -> DeviceOutputs | StepFailure:
        start = time.perf_counter_ns()
        steps = self.expert_steps
        try:
            if steps is not None:
                steps.begin()
            out = self.runner.execute(inp) if inp.rows else None
            if steps is not None:  # the exchanges this step did not make, with no tokens
                steps.finish()
            return out or DeviceOutputs(inp, None, None, None, None, [])
        except Exception as e:
            log.exception("device step %d failed", inp.step_id)
            self._ranked_failure(f"device step {inp.step_id} failed: {e}")
            return StepFailure(inp.step_id, handles_of(inp), f"step failed: {e}")
        finally:
            end = time.perf_counter_ns()
            args: dict[str, Any] = {"step": inp.step_id, "decode": not inp.prefills}
            if steps is not None:
                args.update(steps.trace_args())
            self.tracer.add("device", "device", start, end, args)
            self.lane_clock.mark(inp.step_id, "device", start, end)

    def reclaim(self, staged: DeviceOutputs | StepFailure) -> StepResult:
        """The step's result: its tokens (device->host copy), or its errors; a
        request that failed alone has its error in place of its tokens."""
        try:
            result = self._reclaim(staged)
            errors = self.rejections.take(result.step_id)
            handles = [o.handle for o in result.outputs]
            errors.update(self.grammars.take_failures(handles))
            result = with_errors(result, errors)
        finally:
            self.grammars.fence.reclaimed()
        if self.lane_clock.enabled:
            result.lane_times = self.lane_clock.take(result.step_id)
        return result

    def _reclaim(self, staged: DeviceOutputs | StepFailure) -> StepResult:
        if isinstance(staged, StepFailure):
            return failed_result(staged)
        step_id = staged.inputs.step_id
        try:
            with self.lane_clock.span(self.tracer, "reclaim", "output", step_id):
                result = self.runner.reclaim(staged)
                self.grammars.commit(result.outputs)  # NOTE: before the fence opens
                return result
        except Exception as e:
            log.exception("reclaim failed for step %d", step_id)
            self._ranked_failure(f"reclaim failed for step {step_id}: {e}")
            return failed_result(
                StepFailure(step_id, handles_of(staged.inputs), f"reclaim failed: {e}")
            )

    def shutdown(self) -> None:
        self.tracer.flush()
        if self.group is not None:
            self.group.close()

    def run_step(self, item: StepCommand | bytes) -> StepResult:
        """All four stages in this thread (the synchronous path)."""
        pending = self.command(item)
        staged = (
            pending
            if isinstance(pending, StepFailure)
            else self.prepare(pending, self.input_slots[0])
        )
        return self.reclaim(self.device_step(staged))


def _host_share(config: EngineConfig) -> int | None:
    """CPU ranks on one machine split its cores (each rank's torch threads would otherwise
    take them all and the ranks, waiting on each other's collectives, would be descheduled);
    None: one rank, or a GPU per rank (torch's choice)."""
    p = config.parallel
    ranks = p.dp_ranks_per_node * p.ranks_per_node
    if ranks == 1 or resolve_device(config.model.device).type != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // ranks)


def _max_model_len(config: EngineConfig, ckpt: Checkpoint) -> int:
    arch = ckpt.arch
    limit = arch.max_position_embeddings
    if arch.sliding_window is not None and arch.sliding_window < limit:
        # Within the window, sliding-window attention is plain causal attention.
        log.warning("capping max_model_len to the sliding window (%d)", arch.sliding_window)
        limit = arch.sliding_window
    want = config.model.max_model_len
    if want is None:
        return limit
    if want > limit:
        raise ValueError(f"max_model_len={want} exceeds the model's limit of {limit} tokens")
    return want


def kv_budget_from_utilization(device: torch.device, fraction: float) -> int:
    """Bytes for the KV cache when weights + KV may take `fraction` of the device's
    memory (vLLM's --gpu-memory-utilization; called after the weights are loaded).
    NOTE: activations are not profiled: they use what the fraction leaves free."""
    if device.type != "cuda":
        raise ValueError(
            "gpu_memory_utilization applies to CUDA devices only; on CPU set the KV "
            "cache budget with --kv-cache-memory (GiB)"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    used = torch.cuda.memory_allocated(device)
    budget = int(total * fraction) - used
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {fraction}: the weights already use {used / 2**30:.2f} "
            f"of the {total * fraction / 2**30:.2f} GiB it allows; raise it"
        )
    return budget
