"""Shared inputs and float64 references of the kernel tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

WEIGHT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)) * scale


@dataclass
class AttnCase:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    k_seqs: list[torch.Tensor]  # per sequence [seq_len, Hk, D] (cache dtype values, fp32)
    v_seqs: list[torch.Tensor]

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_attn_case(
    seq_lens: list[int],
    q_lens: list[int],
    hq: int,
    hk: int,
    block_size: int,
    dtype: torch.dtype,
    d: int = 64,
    seed: int = 0,
) -> AttnCase:
    g = gen(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)  # shuffled, non-contiguous blocks
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    k_seqs, v_seqs, used = [], [], 0
    for s, nb in enumerate(blocks_per_seq):
        ids = perm[used : used + nb]
        used += nb
        block_tables[s, :nb] = ids.to(torch.int32)
        k_seqs.append(k_cache[ids].reshape(-1, hk, d)[: seq_lens[s]].float())
        v_seqs.append(v_cache[ids].reshape(-1, hk, d)[: seq_lens[s]].float())
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    return AttnCase(
        q,
        k_cache,
        v_cache,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        qsl,
        1.0 / math.sqrt(d),
        k_seqs,
        v_seqs,
    )


def attention_f64(case: AttnCase) -> torch.Tensor:
    out = torch.empty(case.q.shape, dtype=torch.float64)
    hq, hk = case.q.shape[1], case.k_cache.shape[2]
    for s, seq_len in enumerate(case.seq_lens.tolist()):
        q0, q1 = case.query_start_loc[s].item(), case.query_start_loc[s + 1].item()
        k = case.k_seqs[s].double().repeat_interleave(hq // hk, dim=1)  # [L, Hq, D]
        v = case.v_seqs[s].double().repeat_interleave(hq // hk, dim=1)
        for i in range(q1 - q0):
            pos = seq_len - (q1 - q0) + i
            scores = torch.einsum("hd,lhd->hl", case.q[q0 + i].double(), k[: pos + 1])
            p = torch.softmax(scores * case.scale, dim=-1)
            out[q0 + i] = torch.einsum("hl,lhd->hd", p, v[: pos + 1])
    return out
