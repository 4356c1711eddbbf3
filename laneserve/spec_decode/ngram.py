"""Prompt-lookup (n-gram) drafts, computed on the device from the true history.

For each row: take the last n tokens (n from prompt_lookup_max down to
prompt_lookup_min), find their latest earlier occurrence in prompt + output,
and propose the (up to) k tokens that followed it. Weightless, no host sync:
one kernel call (`kernels.ngram_lookup`: a scan in C++ on CPU, tensor ops
elsewhere) over the rows' history, bounded by a host-known length limit.
"""

from __future__ import annotations

import torch

from laneserve.kernels import Kernels
from laneserve.spec_decode.base import DraftSlots, StepView


class NgramProposer:
    def __init__(self, kernels: Kernels, k: int, n_min: int, n_max: int) -> None:
        self.kernels, self.k, self.n_min, self.n_max = kernels, k, n_min, n_max

    def propose(self, state: DraftSlots, view: StepView, next_tokens: torch.Tensor) -> None:
        del next_tokens
        drafts, num = self.lookup(state, view)
        state.drafts[view.slots, : self.k] = drafts
        state.num_drafts.index_copy_(0, view.slots, num)

    def lookup(self, state: DraftSlots, view: StepView) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [Rs, k], number found [Rs]; 0 = no match) from the rows' histories."""
        width = min(view.max_len, state.width)
        return self.kernels.ngram_lookup(
            state.history, state.committed, view.slots, width, self.k, self.n_min, self.n_max
        )
