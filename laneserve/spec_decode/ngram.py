"""Prompt-lookup (n-gram) drafts, computed on the device from the true history.

For each row: take the last n tokens (n from prompt_lookup_max down to
prompt_lookup_min), find their latest earlier occurrence in prompt + output,
and propose the (up to) k tokens that followed it. Weightless, no host sync:
tensor ops over the rows' history, bounded by a host-known length limit.
"""

from __future__ import annotations

import torch


def propose_ngram(
    history: torch.Tensor,  # [R, W] token ids (W >= every row's length)
    lengths: torch.Tensor,  # [R] known tokens per row
    k: int,
    n_min: int,
    n_max: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # drafts [R, k], num_drafts [R]
    r, w = history.shape
    device = history.device
    best = torch.full((r,), -1, dtype=torch.int64, device=device)  # index after the match
    for n in range(n_max, n_min - 1, -1):
        if w < n + 1:
            continue
        idx = (lengths[:, None] - n + torch.arange(n, device=device)[None, :]).clamp(min=0)
        suffix = history.gather(1, idx)  # [R, n]
        windows = history.unfold(1, n, 1)  # [R, W - n + 1, n]
        match = (windows == suffix[:, None, :]).all(dim=-1)
        starts = torch.arange(windows.shape[1], device=device)[None, :]
        # NOTE: an *earlier* occurrence: it must end before the suffix starts
        # over itself, i.e. at least one known token follows it.
        ok = match & (starts + n < lengths[:, None]) & (lengths[:, None] >= n + 1)
        latest = torch.where(ok, starts, torch.full_like(starts, -1)).amax(dim=1)
        found = (latest >= 0) & (best < 0)
        best = torch.where(found, latest + n, best)
    cols = best[:, None].clamp(min=0) + torch.arange(k, device=device)[None, :]
    drafts = history.gather(1, cols.clamp(max=w - 1))
    num = torch.where(best >= 0, (lengths - best).clamp(0, k), torch.zeros_like(best))
    return drafts, num
