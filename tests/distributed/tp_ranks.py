"""What one rank of the tensor-parallel tests runs (a module-level function: spawned
processes import it by name)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from laneserve.distributed.parallel_state import SINGLE, TensorParallel
from laneserve.kernels import get_kernels
from laneserve.model.layers.attention import AttentionMetadata, PrefillSpan
from laneserve.model.llama.model import LlamaModel
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import open_weights

NUM_TOKENS = 24


def forward_logits(model_dir: Path, tp: TensorParallel = SINGLE) -> dict[str, object]:
    """A prompt's logits at every position ([T, V], prefill through the paged cache) and
    the tensor bytes the rank read from the checkpoint."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(model_dir), "float32", cpu)
    store = open_weights(ckpt, cpu, torch.float32)
    a = ckpt.arch
    model = LlamaModel(a, get_kernels(cpu), store, cpu, torch.float32, 512, tp=tp)
    n = NUM_TOKENS
    ids = torch.randint(3, a.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    kv = (2, 16, a.num_kv_heads // tp.size, a.head_dim)
    caches = [(torch.zeros(kv), torch.zeros(kv)) for _ in range(a.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_seq_lens=None,
        decode_query_start_loc=None,
        prefills=(PrefillSpan(0, n, 0, torch.tensor([0, 1])),),
    )
    hidden, _ = model.forward(ids, torch.arange(n), meta, caches)
    return {"logits": model.compute_logits(hidden), "bytes": store.bytes_read}


def run_rank(rank: int, size: int, port: int, model_dir: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        out = forward_logits(Path(model_dir), TensorParallel(rank, size, dist.group.WORLD))
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
