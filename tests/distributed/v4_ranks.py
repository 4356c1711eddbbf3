"""What one rank of the DeepSeek V4 tensor-parallel tests runs (module-level functions:
spawned processes import them by name): a prompt prefilled in blocks through every
cache group, then decode tokens one by one, and the MTP layer on the prompt's streams."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import get_kernels
from laneserve.model.deepseek_v4.model import DeepseekV4Model, cache_groups
from laneserve.model.deepseek_v4.mtp import DeepseekV4MtpHead, load_deepseek_v4_mtp
from laneserve.model.interface import single_group_tables
from laneserve.model.layers.attention import TokenTableMetadata
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import open_weights
from laneserve.worker.kv_cache import KvCache

BLOCK, BLOCKS = 4, 64  # tokens per block (compressed groups: entries), blocks per group
DECODE = 3  # tokens decoded one by one after the prompt


def _tables(kv: KvCache, n: int, length: int) -> tuple[torch.Tensor, ...]:
    """Each group's table for one request of `length` positions, one row per token (the
    last column is the group's scratch block)."""
    out = []
    for g, blocks in zip(kv.groups, kv.num_blocks, strict=True):
        cols = -(-length // g.block_size)
        assert cols < blocks, "the test's request outgrows the cache"
        row = torch.arange(cols + 1, dtype=torch.int64)
        row[-1] = blocks
        out.append(row[None].expand(n, -1))
    return tuple(out)


def v4_logits(model_dir: Path, prompt_len: int, tp: TensorParallel = SINGLE) -> dict[str, object]:
    """Logits [prompt_len + DECODE, V] of the prompt (prefill blocks) and the decode
    tokens, the MTP layer's logits on the prompt (when the checkpoint has one), the
    tensor bytes the rank read and the cache groups' entry shapes."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(model_dir), "float32", cpu)
    store = open_weights(ckpt, cpu, torch.float32)
    kernels = get_kernels(cpu)
    length = prompt_len + DECODE
    model = DeepseekV4Model(ckpt.arch, kernels, store, cpu, torch.float32, length + 8, tp=tp)
    mtp = store.has("mtp.0.e_proj.weight")
    head = load_deepseek_v4_mtp(store, model, kernels, None, None) if mtp else None
    groups = cache_groups(ckpt.arch, BLOCK, 4, int(mtp), tp.size)
    kv = KvCache.allocate(groups, [BLOCKS] * len(groups), 0, cpu, torch.float32)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, ckpt.arch.vocab_size, (length,), generator=gen)
    tables = _tables(kv, length, length)
    p = prompt_len
    meta = TokenTableMetadata(tuple(t[:p] for t in tables), p + 1, ((0, p, 0),))
    hidden, streams = model.forward(ids[:p], torch.arange(p), meta, kv.layers)
    logits = [model.compute_logits(hidden)]
    for i in range(p, length):  # decode: each token read through its own tables
        meta = TokenTableMetadata(tuple(t[i : i + 1] for t in tables), i + 1)
        hidden, _ = model.forward(ids[i : i + 1], torch.tensor([i]), meta, kv.layers)
        logits.append(model.compute_logits(hidden))
    out: dict[str, object] = {"logits": torch.cat(logits), "bytes": store.bytes_read}
    if head is not None:
        meta = single_group_tables(tables[-1][: p - 1], p)
        draft = head.forward(
            ids[1:p], streams[: p - 1], torch.arange(p - 1), meta, kv.layers[-1][0]
        )
        out["mtp"] = head.logits(draft)
    out["groups"] = [(g.name, g.entry_shape) for g in groups]
    out["shapes"] = _shapes(model, head)
    return out


def _shapes(model: DeepseekV4Model, head: DeepseekV4MtpHead | None) -> dict[str, tuple[int, ...]]:
    """What this rank holds of the sharded weights (and of a replicated one, wkv)."""
    attn, ffn = model.layers[1].attn, model.layers[1].ffn
    out = {
        "wq_b": (attn.wq_b.out_features,),
        "wo_a": tuple(attn.wo_a.shape),
        "sinks": tuple(attn.sinks.shape),
        "wkv": (attn.wkv.out_features,),
        "expert w1|w3": (ffn.experts[0].w13.out_features,),
        "shared w1|w3": (ffn.shared.w13.out_features,),
        "embedding": tuple(model.embed_tokens.shape),
    }
    if head is not None:
        out["mtp wq_b"] = (head.layer.attn.wq_b.out_features,)
    return out


def run_v4_rank(
    rank: int, size: int, port: int, model_dir: str, prompt_len: int, out_dir: str
) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        tp = TensorParallel(rank, size, dist.group.WORLD)
        out = v4_logits(Path(model_dir), prompt_len, tp)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
