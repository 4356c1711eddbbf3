"""CUDA graphs for decode steps: the target's forward captured per bucket, then replayed.

A step qualifies when all its rows are decode-like (no prompt chunk), it has no side
rows, and every row has the same query length q (1, or 1 + k in a verify of k drafts;
at most 8). Its bucket is (rows rounded up to a capture size, q, block-table columns
rounded up to a power of two). A bucket owns fixed input tensors: a step copies its
values into their first rows, and padding fills the rest:

```
 pad row     token 0 at positions 0..q-1, KV written to and read from the scratch block
 pad column  the scratch block, past the row's length: never read unmasked
```
The bucket's outputs (the hidden states) are overwritten by the bucket's next replay;
the device lane reads them within the step, before the next replay. `GraphBuckets`
holds what every model's buckets share; `DecodeGraphs` is the one-cache-group models'
(step kind `paged`: Llama family, DeepSeek V2 / V3), `cuda_graphs_tables.py` those of
the models that read every group through per-token tables (`token_tables`: DeepSeek V4).

A bucket is captured the first time a step uses it: one warm-up run (cuBLAS picks and
allocates its workspaces outside the capture), then the capture, in one memory pool
shared by every bucket. Should a capture fail, the error is logged and every later
step runs eagerly (graphs are a speed-up, never a reason to fail a request). With
`capture=False` the same padded, fixed-tensor forward runs eagerly: that is how the CPU
tests check the padding and the buffers.

The forward must not read device values on the host (tests/host_reads.py checks every
graphed family's forward with TorchKernels on CPU): a captured read would be frozen in
the graph.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from laneserve.kernels.torch_attention import GATHERED_MAX_QUERIES_PER_SEQ
from laneserve.model.interface import CausalLM
from laneserve.model.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


def capture_sizes(max_rows: int) -> list[int]:
    """Row counts captured: 1, 2, 4, then every multiple of 8 up to max_rows, and max_rows."""
    sizes = [s for s in (1, 2, 4) if s < max_rows] + list(range(8, max_rows, 8))
    return [*sizes, max_rows]


def _round_up_pow2(n: int, cap: int) -> int:
    return min(1 << max(n - 1, 0).bit_length(), cap)


@dataclass(frozen=True)
class Bucket:
    rows: int
    qlen: int
    columns: tuple[int, ...]  # block-table columns, per cache group the forward reads
    max_len: int = 0  # a host bound the forward sizes tensors by (0: none)


@dataclass
class Captured:
    """One bucket's fixed tensors: inputs (with their padding values) and outputs."""

    inputs: dict[str, torch.Tensor]
    pad: dict[str, torch.Tensor]  # per input: its padding value (tables: the scratch block)
    meta: Any  # the forward's metadata, built on `inputs`
    outputs: tuple[torch.Tensor, ...] = ()
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    replays: int = field(default=0)


class GraphBuckets:
    """Buckets of one model's decode steps: built on first use, captured or not, and
    replayed; subclasses say what a bucket's inputs are and how the forward reads them."""

    def __init__(
        self,
        device: torch.device,
        block_size: int,
        max_rows: int,
        max_columns: tuple[int, ...],  # per group: columns of the longest request's table
        capture: bool,
        max_len_cap: int = 0,  # the forward's length bound, rounded up to at most this
    ) -> None:
        self.device = device
        self.sizes = capture_sizes(max_rows)
        # padding rows keep their q tokens in one block; longer rows would leave the
        # attention's host-read-free path
        self.max_qlen = min(block_size, GATHERED_MAX_QUERIES_PER_SEQ)
        self.max_columns = max_columns
        self.max_len_cap = max_len_cap
        self.capture = capture
        self._buckets: dict[Bucket, Captured] = {}
        self._pool: Any = None
        self.failure: str | None = None  # why graphs went off (a capture failed)

    @property
    def replays(self) -> int:
        return sum(c.replays for c in self._buckets.values())

    @property
    def buckets(self) -> list[Bucket]:
        return list(self._buckets)

    def bucket(
        self, rows: int, qlen: int, columns: tuple[int, ...], max_len: int = 0
    ) -> Bucket | None:
        """The bucket of a qualifying step's shape (None: larger than any captured)."""
        too_wide = any(c > m for c, m in zip(columns, self.max_columns, strict=True))
        too_long = self.max_len_cap and max_len > self.max_len_cap
        if rows > self.sizes[-1] or too_wide or too_long or qlen > self.max_qlen:
            return None
        size = next(s for s in self.sizes if s >= rows)
        cols = tuple(_round_up_pow2(c, m) for c, m in zip(columns, self.max_columns, strict=True))
        bound = _round_up_pow2(max_len, self.max_len_cap) if self.max_len_cap else 0
        return Bucket(size, qlen, cols, bound)

    def _replay(
        self, key: Bucket, step: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, ...] | None:
        """The step's values into the bucket's inputs, then its graph (or eager forward)."""
        cap = self._buckets.get(key) or self._new_bucket(key)
        if cap is None:
            return None
        _fill(cap, step)
        if cap.graph is not None:
            cap.graph.replay()
        else:
            for dst, out in zip(cap.outputs, self._forward(cap), strict=True):
                dst.copy_(out)
        cap.replays += 1
        return cap.outputs

    # -- what a model's buckets hold -------------------------------------------
    def _padded(self, key: Bucket) -> Captured:
        raise NotImplementedError

    def _forward(self, cap: Captured) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    # -- buckets -------------------------------------------------------------
    def _new_bucket(self, key: Bucket) -> Captured | None:
        """A bucket's tensors and graph; None (and graphs off) if the capture fails."""
        if self.failure is not None:
            return None
        start = time.perf_counter()
        cap = self._padded(key)
        try:
            if self.capture:
                cap.graph, cap.outputs = self._capture(cap)
            else:
                cap.outputs = tuple(t.clone() for t in self._forward(cap))
        except Exception as e:  # the step runs eagerly: the same forward, unrecorded
            self.failure = f"{type(e).__name__}: {e}"
            log.warning("decode graphs off (every step runs eagerly): %s", self.failure)
            return None
        self._buckets[key] = cap
        log.info(
            "decode graph for %d rows x %d tokens, %s block columns: %s in %.0f ms",
            key.rows,
            key.qlen,
            "/".join(map(str, key.columns)),
            "captured" if self.capture else "built (eager)",
            1e3 * (time.perf_counter() - start),
        )
        return cap

    def _capture(self, cap: Captured) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """Warm-up on a side stream, then capture (padding rows only: scratch writes)."""
        cuda = torch.cuda
        if self._pool is None:
            self._pool = cuda.graph_pool_handle()
        cuda.synchronize(self.device)
        side = cuda.Stream(self.device)
        side.wait_stream(cuda.current_stream(self.device))
        with cuda.stream(side):
            self._forward(cap)
        cuda.current_stream(self.device).wait_stream(side)
        graph = cuda.CUDAGraph()
        # NOTE: thread_local: the prepare lane keeps uploading inputs from its thread.
        with cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = self._forward(cap)
        return graph, outputs


def _fill(cap: Captured, step: dict[str, torch.Tensor]) -> None:
    """The step's values into the first rows (and columns), padding into the rest."""
    for name, real in step.items():
        dst, pad = cap.inputs[name], cap.pad[name]
        if real.dim() == 2:  # a block table: every column past the step's is padding
            dst.fill_(pad)
            dst[: real.shape[0], : real.shape[1]].copy_(real)
            continue
        n = real.shape[0]
        dst[n:].copy_(pad[n:])
        dst[:n].copy_(real)


def padding_tokens(key: Bucket, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token 0 at positions 0 .. q-1 in every row: the padding rows' ids and positions."""
    n = key.rows * key.qlen
    offset = torch.arange(key.qlen, device=device).repeat(key.rows)
    return torch.zeros(n, dtype=torch.int64, device=device), offset


class DecodeGraphs(GraphBuckets):
    """A `paged` model's (Llama family, DeepSeek V2 / V3) decode steps: one cache group."""

    def __init__(
        self,
        model: CausalLM,  # of step kind paged
        caches: list[tuple[torch.Tensor, ...]],  # the target's layers (group 0)
        block_size: int,
        scratch_block: int,  # the main group's padding block
        max_rows: int,
        max_columns: int,  # block-table columns of the longest request (padding included)
        capture: bool = True,  # False: run the padded forward eagerly (CPU tests)
    ) -> None:
        device = caches[0][0].device  # the model's, as every cache tensor
        super().__init__(device, block_size, max_rows, (max_columns,), capture)
        self.model = model
        self.caches = caches
        self.block_size = block_size
        self.scratch_block = scratch_block

    def run(
        self,
        ids: torch.Tensor,  # [T] the step's tokens (T = rows * qlen)
        positions: torch.Tensor,
        meta: AttentionMetadata,  # decode-like rows only, no side rows
        qlen: int,
    ) -> torch.Tensor | None:  # [T, H] hidden states; None: the step runs eagerly
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        if tables is None or lens is None or meta.prefills or meta.decode_last_slot is not None:
            return None
        rows, columns = tables.shape
        key = self.bucket(rows, qlen, (columns,))
        if key is None or rows * qlen != ids.shape[0]:
            return None
        step = {
            "ids": ids,
            "positions": positions,
            "slots": meta.slot_mapping,
            "tables": tables,
            "seq_lens": lens,
        }
        out = self._replay(key, step)
        return None if out is None else out[0][: ids.shape[0]]

    def _padded(self, key: Bucket) -> Captured:
        """A bucket's tensors, every row padding (the values a capture runs on)."""
        dev = self.device
        ids, positions = padding_tokens(key, dev)
        pad = {
            "ids": ids,
            "positions": positions,
            "slots": self.scratch_block * self.block_size + positions,
            "tables": torch.tensor(self.scratch_block, dtype=torch.int32, device=dev),
            "seq_lens": torch.full((key.rows,), key.qlen, dtype=torch.int32, device=dev),
        }
        live = {name: t.clone() for name, t in pad.items()}
        live["tables"] = pad["tables"].expand(key.rows, key.columns[0]).clone()
        starts = torch.arange(key.rows + 1, dtype=torch.int32, device=dev) * key.qlen
        meta = AttentionMetadata(
            slot_mapping=live["slots"],
            num_decode_tokens=key.rows * key.qlen,
            decode_block_tables=live["tables"],
            decode_seq_lens=live["seq_lens"],
            decode_query_start_loc=starts,
            prefills=(),
        )
        return Captured(live, pad, meta)

    def _forward(self, cap: Captured) -> tuple[torch.Tensor, ...]:
        i = cap.inputs
        hidden, _ = self.model.forward(i["ids"], i["positions"], cap.meta, self.caches)
        return (hidden,)
