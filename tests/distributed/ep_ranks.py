"""What one rank of the expert-parallel layer tests runs (a module-level function:
spawned processes import it by name): every MoE layer of a tiny model, expert parallel
over the group and on this rank alone, on this rank's own tokens."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from laneserve.distributed.expert_parallel import ExpertParallel, OutOfStepError
from laneserve.kernels import get_kernels
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import family_for, open_weights

TOKENS = {0: 11, 1: 6}  # this rank's tokens in the busy case


def _models(model_dir: Path, ep: ExpertParallel) -> tuple[object, object]:
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(model_dir), "float32", cpu)
    family = family_for(ckpt.arch)
    kernels = get_kernels(cpu)

    def build(**kw: object) -> object:
        store = open_weights(ckpt, cpu, torch.float32)
        return family.model_class(ckpt.arch, kernels, store, cpu, torch.float32, 512, **kw)

    return build(), build(ep=ep)


def _call(moe: object, x: torch.Tensor, ids: torch.Tensor, first: int | None) -> torch.Tensor:
    if type(moe).__name__ == "V4MoE":  # hash routing reads the token ids
        return moe(x, ids, first)  # type: ignore[operator]
    return moe(x)  # type: ignore[operator]


def run_rank(rank: int, size: int, port: int, model_dir: str, out_dir: str, idle: int) -> None:
    """Rank `idle` has no tokens (-1: none idle); prompt rows from the middle on."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        ep = ExpertParallel(rank, size, dist.group.WORLD)
        one, spread = _models(Path(model_dir), ep)
        gen = torch.Generator().manual_seed(10 + rank)
        out: dict[str, object] = {"local": [], "same": [], "calls": 0}
        for i, (a, b) in enumerate(zip(one.moe_layers, spread.moe_layers, strict=True)):  # type: ignore[attr-defined]
            h = a.gate.shape[1]
            n = 0 if rank == idle else TOKENS[rank]
            x = torch.randn((n, h), generator=gen) * 3
            ids = torch.randint(3, 300, (n,), generator=gen)
            first = n // 2 if i % 2 else None
            want = _call(a, x, ids, first) if n else None
            if n:
                got = _call(b, x, ids, first)
                out["same"].append(torch.equal(got, want))  # type: ignore[union-attr]
            else:
                b.idle(torch.float32, torch.device("cpu"))
            out["local"].append(list(b.local))  # type: ignore[union-attr]
            out["experts_held"] = len(b.experts) if isinstance(b.experts, list) else len(b.w13)
        out["calls"] = ep.calls
        ep.calls = rank  # ranks that disagree on the exchange they are at
        try:
            ep.counts([0] * size)
            out["out_of_step"] = False
        except OutOfStepError as e:
            out["out_of_step"] = str(e)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # NOTE: neither rank tears the group down while the other uses it
    finally:
        dist.destroy_process_group()
