"""CUDA graphs for the decode steps of a `token_tables` model (`model/interface.py`;
DeepSeek V4), the buckets of worker/cuda_graphs.py.

Such a forward reads every cache group (V4: sliding window, compressor states, compressed
entries; `model/deepseek_v4/`) through each token's row's table, so a bucket holds
one per-token table per group, each with its own column count rounded up to a power of
two, and the step's length bound `max_len` (it sizes the compressed keys a token
gathers) rounded up the same way:

```
 bucket   rows, q, (columns of group 0, group 1, ...), max_len
 pad row  token 0 at positions 0..q-1; every group's table is its scratch block
 pad col  the group's scratch block (a table's last column must be one: the
          compressor writes a token that closes no window there)
```
Entries past a row's length are masked wherever they are read, so a larger `max_len`
adds only masked keys. The outputs are the forward's two: the normed hidden states and
(V4) the last layer's residual streams (the MTP layer drafts from them).
"""

from __future__ import annotations

import torch

from laneserve.model.interface import CausalLM
from laneserve.model.layers.attention import TokenTableMetadata
from laneserve.worker.cuda_graphs import Bucket, Captured, GraphBuckets, padding_tokens


class TokenTableDecodeGraphs(GraphBuckets):
    def __init__(
        self,
        model: CausalLM,  # of step kind token_tables
        caches: list[list[tuple[torch.Tensor, ...]]],  # per group, per layer in it
        block_size: int,
        scratch_blocks: tuple[int, ...],  # per group: its padding block
        max_rows: int,
        max_columns: tuple[int, ...],  # per group: columns of the longest request's table
        max_positions: int,  # positions a row can reach: the bound on max_len
        capture: bool = True,  # False: run the padded forward eagerly (CPU tests)
    ) -> None:
        device = caches[0][0][0].device  # the model's, as every cache tensor
        super().__init__(device, block_size, max_rows, max_columns, capture, max_positions + 1)
        self.model = model
        self.caches = caches
        self.scratch_blocks = scratch_blocks

    def run(
        self,
        ids: torch.Tensor,  # [T] the step's tokens (T = rows * qlen)
        positions: torch.Tensor,
        meta: TokenTableMetadata,  # per group: [T, C_g] each token's row's table; no spans
        qlen: int,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # hidden [T, H], streams [T, N * H]
        n = ids.shape[0]
        if meta.spans or n % qlen:
            return None
        key = self.bucket(n // qlen, qlen, tuple(t.shape[1] for t in meta.tables), meta.max_len)
        if key is None:
            return None
        step = {"ids": ids, "positions": positions}
        step.update((f"table{g}", t) for g, t in enumerate(meta.tables))
        out = self._replay(key, step)
        return None if out is None else (out[0][:n], out[1][:n])

    def _padded(self, key: Bucket) -> Captured:
        """A bucket's tensors, every row padding (the values a capture runs on)."""
        ids, positions = padding_tokens(key, self.device)
        pad = {"ids": ids, "positions": positions}
        for g, block in enumerate(self.scratch_blocks):
            pad[f"table{g}"] = torch.tensor(block, dtype=torch.int64, device=self.device)
        live = {"ids": ids.clone(), "positions": positions.clone()}
        for g, cols in enumerate(key.columns):
            live[f"table{g}"] = pad[f"table{g}"].expand(ids.shape[0], cols).clone()
        tables = tuple(live[f"table{g}"] for g in range(len(key.columns)))
        return Captured(live, pad, TokenTableMetadata(tables, key.max_len))

    def _forward(self, cap: Captured) -> tuple[torch.Tensor, ...]:
        i = cap.inputs
        return self.model.forward(i["ids"], i["positions"], cap.meta, self.caches)
