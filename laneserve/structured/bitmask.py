"""Applying a packed token bitmask to logits rows (on the logits' device).

Bit j of word w in a row allows token 32 * w + j (llguidance's layout); a
disallowed token's logit becomes -inf, so every sampling path (greedy argmax,
top-k/p, rejection sampling) only ever picks allowed tokens.
"""

from __future__ import annotations

import torch


def apply_bitmask(
    logits: torch.Tensor,  # [N, V] modified in place
    mask: torch.Tensor,  # [N, ceil(V / 32)] int32, on the logits' device
) -> None:
    n, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    allowed = ((mask[:, :, None] >> shifts) & 1).reshape(n, -1)[:, :vocab]  # [N, V]
    logits.masked_fill_(allowed == 0, float("-inf"))


def words_for(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
