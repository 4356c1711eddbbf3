"""Data-parallel routing: which rank serves a new request (docs/distributed.md).

```
 load(rank)   = pending tokens: the rest of each prompt + each request's remaining outputs
 cached(rank) = tokens of the new prompt's prefix that the rank's prefix cache holds now

 least  = the rank with the least load (lowest index on a tie)
 holder = the rank with the longest cached prefix (least load, then lowest index, on a tie)
 choose holder  if cached(holder) > cached(least) and load(holder) - load(least) <= bound
 else   least
```
A request stays on the chosen rank for its life: its scheduler preempts and resumes it
there, and a restarted rank keeps the requests that waited on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from laneserve.core.block_pool import BlockHash, hash_block
from laneserve.core.request import Request

# The extra load (pending tokens) a rank may carry over the least loaded one and still
# win a request by its cached prefix: the default step budget (max_num_batched_tokens).
# A rank at most one step's work behind catches up within about a step, while sending
# the request elsewhere recomputes its whole shared prefix there and keeps a second copy
# of its blocks; beyond one step's work the queueing delay outweighs the saved prefill.
AFFINITY_BOUND_TOKENS = 2048


def pending_tokens(req: Request) -> int:
    """Prompt tokens still to prefill plus the outputs it may still produce."""
    prefill = max(0, req.num_prompt_tokens - req.num_computed_tokens)
    return prefill + max(0, req.max_tokens - len(req.output_token_ids))


def prompt_hashes(prompt_ids: list[int], block_size: int) -> list[BlockHash]:
    """The block-hash chain a rank's prefix lookup would compute for this prompt: full
    blocks of its first len - 1 tokens (one token is always computed)."""
    hashes: list[BlockHash] = []
    for i in range((len(prompt_ids) - 1) // block_size):
        block = prompt_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(hashes[-1] if hashes else None, block))
    return hashes


@dataclass(frozen=True)
class RankView:
    """What the router sees of one rank that accepts requests."""

    index: int
    load: int  # pending tokens
    cached: int  # prefix tokens of this prompt in its cache


@dataclass
class Router:
    bound: int = AFFINITY_BOUND_TOKENS
    routed: list[int] = field(default_factory=list)  # requests sent to each rank
    by_prefix: int = 0  # of those, sent to a holder of their prefix over the least loaded

    def choose(self, views: list[RankView]) -> int:
        """The rank for a request, from the views of the ranks that accept one."""
        if not views:
            raise ValueError("no rank accepts requests")
        least = min(views, key=lambda v: (v.load, v.index))
        holder = min(views, key=lambda v: (-v.cached, v.load, v.index))
        chosen = least
        if holder.cached > least.cached and holder.load - least.load <= self.bound:
            chosen = holder
            self.by_prefix += 1
        while len(self.routed) <= chosen.index:
            self.routed.append(0)
        self.routed[chosen.index] += 1
        return chosen.index


__all__ = ["AFFINITY_BOUND_TOKENS", "RankView", "Router", "pending_tokens", "prompt_hashes"]
