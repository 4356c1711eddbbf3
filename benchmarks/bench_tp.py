"""What tensor parallelism's collectives cost per decode step, on CPU ranks (gloo).

A random Llama-shaped checkpoint is built once; each rank (spawned processes joined
over 127.0.0.1, like the engine's ranks) runs decode steps of the model's forward on its
shard (batch B, every row at the same context length, paged cache) and times every
collective: how many per step, how long the rank spent in them, and the rest of the
step (its own compute). The ranks run in lock step, so the critical rank is the one with
the most compute; a faster rank's collective time is mostly waiting for it. TP = 1 runs
the same steps on one process for the ratio. Then the engine runs the same checkpoint at
TP = 2 with `--profile-dir` and `laneserve profile analyze` reports each rank's steps and
the critical rank's host gap. Not a timed test: on a 2-core machine two ranks share the
cores, so this is the correctness path's cost, not a speed-up.

    .venv/bin/python benchmarks/bench_tp.py                   # TP 1 vs 2, batch 1 and 8
    .venv/bin/python benchmarks/bench_tp.py --batches 1,8,32 --steps 64 --hidden 1024

Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import get_kernels
from laneserve.model.layers.attention import AttentionMetadata
from laneserve.model.llama.model import LlamaModel
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import open_weights

BLOCK = 16


@dataclass(frozen=True)
class TimedTensorParallel(TensorParallel):
    """A rank's group whose collectives are counted and timed."""

    calls: list[float] = field(default_factory=list)  # seconds per collective

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        start = time.perf_counter()
        parts = super()._gather(x)
        self.calls.append(time.perf_counter() - start)
        return parts


def build_checkpoint(out: Path, hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden // 64
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(2, heads // 4),
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    return out


def decode_steps(model_dir: str, tp: TensorParallel, batch: int, context: int, steps: int) -> dict:
    """Per-step seconds (after 3 warm-up steps) of `steps` decode steps at `batch`."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(model_dir, "float32", cpu)
    a = ckpt.arch
    model = LlamaModel(a, get_kernels(cpu), open_weights(ckpt, cpu, torch.float32), cpu,
                       torch.float32, context + steps + 8, tp=tp)  # fmt: skip
    per_seq = (context + steps + 8 + BLOCK - 1) // BLOCK
    kv = (batch * per_seq + 1, BLOCK, a.num_kv_heads // tp.size, a.head_dim)
    caches = [(torch.randn(kv), torch.randn(kv)) for _ in range(a.num_layers)]
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    ids = torch.randint(3, a.vocab_size, (batch,), generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(steps + 3):
        pos = torch.full((batch,), context + i, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_mapping=tables[:, (context + i) // BLOCK].long() * BLOCK + (context + i) % BLOCK,
            num_decode_tokens=batch,
            decode_block_tables=tables,
            decode_seq_lens=pos.to(torch.int32) + 1,
            decode_query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            prefills=(),
        )
        if i == 3 and isinstance(tp, TimedTensorParallel):
            tp.calls.clear()
        start = time.perf_counter()
        hidden, _ = model.forward(ids, pos, meta, caches)
        ids = model.compute_logits(hidden).argmax(-1)
        if i >= 3:
            times.append(time.perf_counter() - start)
    calls = tp.calls if isinstance(tp, TimedTensorParallel) else []
    return {"step_s": sum(times) / steps, "calls": len(calls) / steps,
            "collective_s": sum(calls) / steps}  # fmt: skip


def rank_main(rank: int, port: int, model_dir: str, cases: list, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        tp = TimedTensorParallel(rank, 2, dist.group.WORLD)
        got = [decode_steps(model_dir, tp, b, c, s) for b, c, s in cases]
        Path(out).write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def two_ranks(model_dir: str, cases: list, tmp: Path) -> list[list[dict]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=rank_main, args=(r, port, model_dir, cases, str(tmp / f"r{r}.json")))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0, f"a rank failed (exit {p.exitcode})"
    return [json.loads((tmp / f"r{r}.json").read_text()) for r in range(2)]


def engine_trace(model_dir: str, batch: int, tokens: int, out: Path) -> str:
    """The engine at TP = 2 with --profile-dir: each rank's decode steps and the critical
    rank's host gap, as `laneserve profile analyze` reports them."""
    from laneserve import LLM, SamplingParams
    from laneserve.obs.trace_analysis import report

    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=2, worker_mode="process",
              num_threads=1, profile_dir=str(out), skip_tokenizer_init=True)  # fmt: skip
    prompts = [{"prompt_token_ids": [3 + i, 4, 5, 6]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    lines = report([out]).splitlines()
    return "\n".join(x for x in lines if x.startswith(("summary", "critical", "== ")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--trace-batch", type=int, default=8, help="requests of the traced run")
    args = ap.parse_args()
    cases = [(int(b), args.context, args.steps) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as d:
        model = str(build_checkpoint(Path(d) / "ckpt", args.hidden, args.layers))
        single = [decode_steps(model, SINGLE, b, c, s) for b, c, s in cases]
        ranks = two_ranks(model, cases, Path(d))
        traced = engine_trace(model, args.trace_batch, args.steps, Path(d) / "trace")
    print(f"hidden {args.hidden}, {args.layers} layers, context {args.context}, fp32, gloo")
    print("batch | TP1 step ms | TP2 step ms (ratio) | collectives/step | per rank: "
          "collective ms / compute ms | critical rank")  # fmt: skip
    for i, (b, _, _) in enumerate(cases):
        r = [ranks[k][i] for k in range(2)]
        compute = [x["step_s"] - x["collective_s"] for x in r]
        crit = max(range(2), key=lambda k: compute[k])
        step = max(x["step_s"] for x in r)
        per_rank = "  ".join(
            f"r{k} {r[k]['collective_s'] * 1e3:.2f} / {compute[k] * 1e3:.2f}" for k in range(2)
        )
        print(f"{b:5d} | {single[i]['step_s'] * 1e3:11.2f} | {step * 1e3:11.2f} "
              f"({single[i]['step_s'] / step:.2f}x) | {r[0]['calls']:.0f} | {per_rank} | "
              f"r{crit} (exposed {r[crit]['collective_s'] * 1e3:.2f} ms)")  # fmt: skip

    print(f"engine, TP = 2, {args.trace_batch} requests x {args.steps} tokens, traced:")
    print(traced)


if __name__ == "__main__":
    main()
