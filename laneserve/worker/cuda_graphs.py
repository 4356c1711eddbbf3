"""CUDA graphs for decode steps: the target's forward captured per bucket, then replayed.

A step qualifies when all its rows are decode-like (no prompt chunk), it has no side
rows, and every row has the same query length q (1, or 1 + k in a verify of k drafts;
at most 8). Its bucket is (rows rounded up to a capture size, q, block-table columns
rounded up to a power of two). A bucket owns fixed input tensors: a step copies its
values into their first rows, and padding fills the rest:

```
 pad row     token 0 at positions 0..q-1, KV written to and read from the scratch block
 pad column  whatever an earlier step left there: past the row's length, never read
```
The bucket's output (the hidden states) is overwritten by the bucket's next replay;
the device lane reads it within the step, before the next replay.

A bucket is captured the first time a step uses it: one warm-up run (cuBLAS picks and
allocates its workspaces outside the capture), then the capture, in one memory pool
shared by every bucket. Should a capture fail, the error is logged and every later
step runs eagerly (graphs are a speed-up, never a reason to fail a request). With
`capture=False` the same padded, fixed-tensor forward runs eagerly: that is how the CPU
tests check the padding and the buffers.

The forward must not read device values on the host (tests/host_reads.py checks the
decoder stack with TorchKernels on CPU): a captured read would be frozen in the graph.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from laneserve.kernels.torch_attention import GATHERED_MAX_QUERIES_PER_SEQ
from laneserve.model.attention import AttentionMetadata
from laneserve.model.layers import DecoderStack

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
    columns: int


@dataclass
class _Captured:
    """One bucket's fixed tensors: inputs (with their padding) and output."""

    ids: torch.Tensor  # [rows * q] int64
    positions: torch.Tensor  # [rows * q] int64
    slots: torch.Tensor  # [rows * q] int64 KV slot of each token
    tables: torch.Tensor  # [rows, columns] int32
    seq_lens: torch.Tensor  # [rows] int32
    pad: dict[str, torch.Tensor]  # the padding value of each input above
    meta: AttentionMetadata
    hidden: torch.Tensor | None = None  # [rows * q, H] the forward's output
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    replays: int = field(default=0)


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderStack,  # Llama family, DeepSeek V2 / V3
        caches: list[tuple[torch.Tensor, ...]],  # the target's layers (group 0)
        block_size: int,
        scratch_block: int,  # the main group's padding block
        max_rows: int,
        max_columns: int,  # block-table columns of the longest request (padding included)
        capture: bool = True,  # False: run the padded forward eagerly (CPU tests)
    ) -> None:
        self.model = model
        self.caches = caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sizes = capture_sizes(max_rows)
        # padding rows keep their q tokens in one block; longer rows would leave the
        # attention's host-read-free path
        self.max_qlen = min(block_size, GATHERED_MAX_QUERIES_PER_SEQ)
        self.max_columns = max_columns
        self.capture = capture
        self.device = model.embed_tokens.device
        self._buckets: dict[Bucket, _Captured] = {}
        self._pool: Any = None
        self.failure: str | None = None  # why graphs went off (a capture failed)

    @property
    def replays(self) -> int:
        return sum(c.replays for c in self._buckets.values())

    @property
    def buckets(self) -> list[Bucket]:
        return list(self._buckets)

    def bucket(self, rows: int, qlen: int, columns: int) -> Bucket | None:
        """The bucket of a qualifying step's shape (None: larger than any captured)."""
        if rows > self.sizes[-1] or columns > self.max_columns or qlen > self.max_qlen:
            return None
        size = next(s for s in self.sizes if s >= rows)
        return Bucket(size, qlen, _round_up_pow2(columns, self.max_columns))

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
        key = self.bucket(rows, qlen, columns)
        if key is None or rows * qlen != ids.shape[0]:
            return None
        cap = self._buckets.get(key) or self._new_bucket(key)
        if cap is None:
            return None
        self._fill(cap, ids, positions, meta.slot_mapping, tables, lens)
        if cap.graph is not None:
            cap.graph.replay()
        else:
            assert cap.hidden is not None
            cap.hidden.copy_(self._forward(cap))
        cap.replays += 1
        assert cap.hidden is not None
        return cap.hidden[: ids.shape[0]]

    # -- buckets -------------------------------------------------------------
    def _new_bucket(self, key: Bucket) -> _Captured | None:
        """A bucket's tensors and graph; None (and graphs off) if the capture fails."""
        if self.failure is not None:
            return None
        start = time.perf_counter()
        cap = self._padded(key)
        try:
            if self.capture:
                cap.graph, cap.hidden = self._capture(cap)
            else:
                cap.hidden = self._forward(cap).clone()
        except Exception as e:  # the step runs eagerly: the same forward, unrecorded
            self.failure = f"{type(e).__name__}: {e}"
            log.warning("decode graphs off (every step runs eagerly): %s", self.failure)
            return None
        self._buckets[key] = cap
        log.info(
            "decode graph for %d rows x %d tokens, %d block columns: %s in %.0f ms",
            key.rows,
            key.qlen,
            key.columns,
            "captured" if self.capture else "built (eager)",
            1e3 * (time.perf_counter() - start),
        )
        return cap

    def _padded(self, key: Bucket) -> _Captured:
        """A bucket's tensors, every row padding (the values a capture runs on)."""
        n, dev = key.rows * key.qlen, self.device
        offset = torch.arange(key.qlen, device=dev).repeat(key.rows)
        pad = {
            "ids": torch.zeros(n, dtype=torch.int64, device=dev),
            "positions": offset.clone(),
            "slots": self.scratch_block * self.block_size + offset,
            "tables": torch.full(
                (key.rows, key.columns), self.scratch_block, dtype=torch.int32, device=dev
            ),
            "seq_lens": torch.full((key.rows,), key.qlen, dtype=torch.int32, device=dev),
        }
        live = {name: t.clone() for name, t in pad.items()}
        starts = torch.arange(key.rows + 1, dtype=torch.int32, device=dev) * key.qlen
        meta = AttentionMetadata(
            slot_mapping=live["slots"],
            num_decode_tokens=n,
            decode_block_tables=live["tables"],
            decode_seq_lens=live["seq_lens"],
            decode_query_start_loc=starts,
            prefills=(),
        )
        return _Captured(
            live["ids"],
            live["positions"],
            live["slots"],
            live["tables"],
            live["seq_lens"],
            pad,
            meta,
        )

    def _fill(
        self,
        cap: _Captured,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> None:
        """The step's values into the first rows, padding into the rest."""
        per_token = (("ids", ids), ("positions", positions), ("slots", slots))
        for name, real in (*per_token, ("seq_lens", lens)):
            dst, n = getattr(cap, name), real.shape[0]
            dst[n:].copy_(cap.pad[name][n:])
            dst[:n].copy_(real)
        rows, columns = tables.shape
        cap.tables[rows:].fill_(self.scratch_block)
        cap.tables[:rows, :columns].copy_(tables)

    def _forward(self, cap: _Captured) -> torch.Tensor:
        hidden, _ = self.model.forward(cap.ids, cap.positions, cap.meta, self.caches)
        return hidden

    def _capture(self, cap: _Captured) -> tuple[Any, torch.Tensor]:
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
            hidden = self._forward(cap)
        return graph, hidden
