"""What one rank of the tensor-parallel tests runs (a module-level function: spawned
processes import it by name), and the driver that runs two and compares them."""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import get_kernels
from laneserve.model.layers.attention import AttentionMetadata, PrefillSpan
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import family_for, open_weights

NUM_TOKENS = 24


def _prefill(n: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_seq_lens=None,
        decode_query_start_loc=None,
        prefills=(PrefillSpan(0, n, 0, torch.tensor([0, 1])),),
    )


def forward_logits(
    model_dir: Path, tp: TensorParallel = SINGLE, mtp: bool = False
) -> dict[str, object]:
    """A prompt's logits at every position ([T, V], prefill through the paged cache) and
    the tensor bytes the rank read from the checkpoint; with `mtp`, also the checkpoint's
    MTP head's draft logits for positions 0..T-2 (its own cache)."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(model_dir), "float32", cpu)
    store = open_weights(ckpt, cpu, torch.float32)
    a, family = ckpt.arch, family_for(ckpt.arch)
    kernels = get_kernels(cpu)
    model = family.model_class(a, kernels, store, cpu, torch.float32, 512, tp=tp)
    n = NUM_TOKENS
    ids = torch.randint(3, a.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    (group,) = family.cache_groups(a, 16, 4, 0, tp.size)  # a rank's own entry shape
    entry = (2, 16, *group.entry_shape)
    caches = [
        tuple(torch.zeros(entry) for _ in range(group.tensors_per_entry))
        for _ in range(a.num_layers + 1)  # the last: the MTP head's
    ]
    hidden, _ = model.forward(ids, torch.arange(n), _prefill(n), caches[:-1])
    out: dict[str, object] = {"logits": model.compute_logits(hidden)}
    if mtp:
        head = family.load_mtp(store, model, kernels, None, None, None)
        normed = head.forward(
            ids[1:], hidden[:-1], torch.arange(n - 1), _prefill(n - 1), caches[-1]
        )
        out["draft_logits"] = head.head(normed).float()
    out["bytes"] = store.bytes_read
    return out


def run_rank(
    rank: int, size: int, port: int, model_dir: str, out_dir: str, mtp: bool = False
) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        out = forward_logits(Path(model_dir), TensorParallel(rank, size, dist.group.WORLD), mtp)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(
    target: Callable[..., None], args: tuple, out: Path, size: int = 2, limit_s: float = 600
) -> list[dict]:
    """`target(rank, size, port, *args)` on `size` spawned processes (one gloo group over
    127.0.0.1); each saves its results to `out / rank{r}.pt`, returned in rank order."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, size, port, *args)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(limit_s)
    assert [p.exitcode for p in procs] == [0] * size
    return [torch.load(out / f"rank{r}.pt") for r in range(size)]


def run_ranks(model_dir: Path, out: Path, size: int = 2, mtp: bool = False) -> list[dict]:
    """`forward_logits` on `size` gloo ranks over 127.0.0.1 (spawned processes)."""
    return spawn_ranks(run_rank, (str(model_dir), str(out), mtp), out, size, limit_s=300)


def check_two_ranks(model_dir: Path, out: Path, mtp: bool = False) -> None:
    """Two ranks' logits (and, with `mtp`, their MTP head's draft logits): bit-identical
    to each other, one device's within 1e-4 with its greedy token at every position, each
    rank reading about half the bytes."""
    one = forward_logits(model_dir, mtp=mtp)
    ranks = run_ranks(model_dir, out, mtp=mtp)
    for key in ("logits", "draft_logits") if mtp else ("logits",):
        # every rank holds all the logits (all-gathered), bit for bit the same on each
        assert torch.equal(ranks[0][key], ranks[1][key]), key
        got, want = ranks[0][key], one[key]
        assert got.shape == want.shape
        # the sums are split differently (two partial matmuls + an all-reduce): close,
        # and the same greedy token at every position
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (key, (got - want).abs().max())
        assert torch.equal(got.argmax(-1), want.argmax(-1)), key
    # each rank reads its slices only: about half the bytes (norms are replicated)
    assert ranks[0]["bytes"] == ranks[1]["bytes"]
    assert ranks[0]["bytes"] < 0.55 * one["bytes"], (ranks[0]["bytes"], one["bytes"])
