"""What a model declares about its cache, shared by the model, the worker and the core.

A model declares its *cache groups* here; the worker allocates them
(`worker/kv_cache.py`) and the engine core accounts their blocks
(`core/kv_cache_manager.py`, one manager per kind from `core/cache_group_kinds.py`).
This module imports nothing of laneserve's, so every side can read it.

```
 kind             what a block holds                         freed
 full_attention   block_size positions, every one kept       with the request
 sliding_window   block_size positions                       once wholly behind the window
 compressed       block_size entries, one per m positions    with the request
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
COMPRESSED = "compressed"
KINDS = (FULL_ATTENTION, SLIDING_WINDOW, COMPRESSED)


@dataclass(frozen=True)
class CacheGroupSpec:
    """A group's block layout.

    An *entry* is what the group stores for `tokens_per_entry` token positions in one
    layer: `tensors_per_entry` tensors (K and V: 2; one MLA latent: 1) of `entry_shape`
    values each. A block holds `block_size` token positions of every layer of the group.

    ```
     full attention   2 x [num_kv_heads, head_dim]            per token, per layer
     MLA latent       1 x [1, kv_lora_rank + qk_rope_head_dim] per token, per layer
    ```
    """

    name: str
    kind: str  # one of KINDS
    block_size: int  # token positions per block (compressed: block entries x tokens_per_entry)
    num_layers: int
    tensors_per_entry: int
    entry_shape: tuple[int, ...]
    dtype_bytes: int
    tokens_per_entry: int = 1
    window: int = 0  # sliding_window: positions a query reads behind itself (incl. itself)

    @property
    def values_per_entry(self) -> int:
        return math.prod(self.entry_shape)

    @property
    def entries_per_block(self) -> int:
        return -(-self.block_size // self.tokens_per_entry)

    @property
    def bytes_per_block(self) -> int:
        # every tensor of every layer of the group
        per_entry = self.tensors_per_entry * self.values_per_entry * self.dtype_bytes
        return self.num_layers * self.entries_per_block * per_entry

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown cache group kind {self.kind!r}; known: {list(KINDS)}")
