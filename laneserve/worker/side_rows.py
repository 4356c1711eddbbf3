"""Side rows: the alternatives to a speculative row's first draft (the other root
children of a token tree), verified by the target in the same forward.

A speculative row [last, d1, .., dk] sits at positions p .. p+k. Each of its W
alternatives a_j gets a one-token decode row at position p+1 (a "side row"),
placed after the decode rows and before any prefill chunk. A side row must see
keys 0..p (the request's blocks, key p written by this very step) and its own
key at p+1, but the request's slot p+1 holds d1's key. So a_j's key goes to a
scratch slot of its own, and the attention kernel reads the side row's last key
from there (`decode_last_slot`) and every other key through the request's table:

```
 forward       a_j's key -> scratch slot;  side row attends table[0..p] + scratch
 after verify  if a_j was accepted: its key is copied from the scratch slot into
               the request's slot p+1 (every layer), and its hidden state replaces
               d1's row (the MTP head reads it next)
```
The side row computes exactly what a plain decode of a_j would (batch-invariant
kernels), so the output does not depend on which candidate was accepted. Nothing
here reads a device value back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laneserve.kernels import Kernels
from laneserve.model.layers.attention import AttentionMetadata, PrefillSpan
from laneserve.worker.step_inputs import SideInputs

KvStack = tuple[torch.Tensor, ...]  # K, V (or one MLA latent) of a group: [L, blocks, bs, Hk, D]


@dataclass
class SideStep:
    pos: torch.Tensor  # [Ra] position p + 1 of each row's first draft (and alternatives)
    tokens: torch.Tensor  # [Ra, W] the alternatives
    slots: torch.Tensor  # [Ra, W] their scratch slots
    real_slot: torch.Tensor  # [Ra] the request's slot of position p + 1
    num_decode_tokens: int  # the side tokens start here in the forward's token order

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


def plan(
    si: SideInputs,
    alternatives: torch.Tensor,  # [capacity, >= W] per-slot alternatives (device state)
    ids: torch.Tensor,  # [T] main token ids
    positions: torch.Tensor,  # [T]
    meta: AttentionMetadata,  # the main tokens' metadata for the target group
) -> tuple[SideStep, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The side step, and the forward's ids, positions and metadata with side rows."""
    # d1's token: its position is p + 1 and its cache slot is the request's slot there
    pos = positions.index_select(0, si.first_draft)
    side = SideStep(
        pos=pos,
        tokens=alternatives.index_select(0, si.state_slots)[:, : si.width],
        slots=si.slots,
        real_slot=meta.slot_mapping.index_select(0, si.first_draft),
        num_decode_tokens=meta.num_decode_tokens,
    )
    side_pos = pos.repeat_interleave(si.width)
    nd = side.num_decode_tokens
    return (
        side,
        _insert(ids, side.tokens.flatten(), nd),
        _insert(positions, side_pos, nd),
        _side_metadata(si, meta, side, side_pos),
    )


def _insert(main: torch.Tensor, extra: torch.Tensor, at: int) -> torch.Tensor:
    return torch.cat([main[:at], extra, main[at:]])


def _side_metadata(
    si: SideInputs, meta: AttentionMetadata, side: SideStep, side_pos: torch.Tensor
) -> AttentionMetadata:
    s = side.num_tokens
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    # NOTE: side rows follow speculative decode rows, so the main step has decode tables
    assert tables is not None and lens is not None
    return AttentionMetadata(
        slot_mapping=_insert(meta.slot_mapping, side.slots.flatten(), side.num_decode_tokens),
        num_decode_tokens=meta.num_decode_tokens + s,
        decode_block_tables=torch.cat([tables, si.tables]),
        decode_seq_lens=torch.cat([lens, (side_pos + 1).to(torch.int32)]),
        decode_query_start_loc=si.query_start_loc,
        prefills=tuple(
            PrefillSpan(p.token_start + s, p.num_tokens, p.context_len, p.block_ids)
            for p in meta.prefills
        ),
        decode_last_slot=si.last_slot,
    )


def split(hidden: torch.Tensor, side: SideStep) -> tuple[torch.Tensor, torch.Tensor]:
    """(main rows [T, H], side rows [Ra * W, H]) of the forward's output."""
    nd, s = side.num_decode_tokens, side.num_tokens
    if nd + s == hidden.shape[0]:  # no prefill chunk in this step: views
        return hidden[:nd], hidden[nd:]
    return torch.cat([hidden[:nd], hidden[nd + s :]]), hidden[nd : nd + s]


def commit(
    kernels: Kernels,
    stack: KvStack,
    side: SideStep,
    hit: torch.Tensor,  # [Ra] an alternative was accepted
    choice: torch.Tensor,  # [Ra] which one
    hidden: torch.Tensor,  # [T, H] main rows' hidden, patched in place
    side_hidden: torch.Tensor,  # [Ra * W, H]
    first_draft_token: torch.Tensor,  # [Ra] token row of each row's d1
) -> None:
    """Make an accepted alternative the request's token at p + 1: its key in the real
    slot (every layer) and its hidden state in d1's row (one fused kernel call)."""
    # NOTE: an MLA group has one latent tensor: it is passed as both K and V (the same
    # copy twice, idempotent)
    kernels.commit_side_rows(
        stack[0],
        stack[-1],
        side.slots,
        side.real_slot,
        hit,
        choice,
        hidden,
        side_hidden,
        first_draft_token,
    )
