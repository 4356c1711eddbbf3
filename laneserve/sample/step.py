"""One step's sampling and verification: the step's logits in, its tokens out.

`sample_step` is the only entry the model runner calls. It picks one of four paths
from what the step holds (decided on the host, no device value is read):

```
 no drafts, all greedy, unprocessed  kernels.top_tokens (the argmax, one op)
 no drafts                          plain sampling: min_tokens -> logit_bias -> penalties -> sample
 drafts, all greedy, dense          kernels.verify_greedy (one fused argmax + compare)
 drafts otherwise                   rejection sampling (rejection_sampler.verify)
 + alternatives (token tree)        all-greedy dense rows without logprobs: the fused op
                                    decides the tree too; else verify_alternatives after
                                    the draft path above
```
Every path gives each sampling row accepted + 1 tokens (see rejection_sampler.py for
the vocabulary). Logprobs are of the raw logits, taken before any processing.

Structured output plugs in at the top of `sample_step`: a grammar's token bitmask
masks every main logits row (each of a speculative row's 1 + k) before any path
runs, so the fused greedy paths stay valid (they only take argmaxes of the logits
they are given). Rows under a grammar never carry alternatives (no token tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from laneserve.sample import rejection_sampler, sampler
from laneserve.sample.sampler import SamplingBatch
from laneserve.structured.bitmask import apply_bitmask


class VerifyKernels(Protocol):
    def verify_greedy(
        self,
        logits: torch.Tensor,  # [R * (K + 1) + R * W, V]
        drafts: torch.Tensor,  # [R, K]
        num_valid: torch.Tensor,  # [R]
        alternatives: torch.Tensor,  # [R, W] (W may be 0)
    ) -> tuple[torch.Tensor, ...]: ...  # tokens [R, K + 1], accepted, hit, choice [R]

    def top_tokens(
        self,
        logits: torch.Tensor,  # [N, V]
        n: int,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor: ...  # [N, n] int64, best first (n = 1: torch.argmax's choice)


@dataclass
class SampleRows:
    """A step's sampling rows and their logits rows: 1 + k consecutive logits rows per
    sampling row (position 0, then one per draft it verifies)."""

    index: torch.Tensor  # [Rs] int64 the sampling rows among the step's rows
    slot: torch.Tensor  # [Rs] int64 their state slots (history rows)
    first: torch.Tensor  # [Rs] int64 first logits row of each sampling row
    token_idx: torch.Tensor  # [N] int64 forward token row of each logits row
    row: torch.Tensor  # [N] int64 its sampling row
    row_host: list[int]  # the same, on the host
    offset: torch.Tensor  # [N] int64 0..k within its sampling row


@dataclass
class Drafts:
    """The drafts a step verifies."""

    tokens: torch.Tensor  # [Rs, K] draft tokens of each sampling row
    num_valid: torch.Tensor  # [Rs] real drafts to verify per row
    dense: bool  # every sampling row is a decode verifying K drafts


@dataclass
class TreeRows:
    """Alternatives to some rows' first draft (a token tree's other root children);
    their logits rows follow the N main rows, W per row."""

    rows: torch.Tensor  # [Ra] sampling rows that carry alternatives
    rows_host: list[int]  # the same, on the host
    every_row: bool  # every sampling row carries alternatives
    tokens: torch.Tensor  # [Ra, W]
    position: torch.Tensor  # [Ra] position of the first draft (and the alternatives)


@dataclass
class SampledStep:
    tokens: torch.Tensor  # [Rs, 1 + K] emitted tokens (the first accepted + 1 are real)
    num_accepted: torch.Tensor  # [Rs]
    logprobs: tuple[torch.Tensor, ...] | None  # chosen, rank, top ids, top lps per logits row
    tree_hit: torch.Tensor | None = None  # [Ra] an alternative was accepted
    tree_choice: torch.Tensor | None = None  # [Ra] which one


def sample_step(
    kernels: VerifyKernels,
    logits: torch.Tensor,  # [N + Ra * W, V]: the main logits rows, then alternatives' rows
    batch: SamplingBatch,  # one entry per sampling row
    rows: SampleRows,
    positions: torch.Tensor,  # [T] the forward's positions (min_tokens, penalties)
    history: torch.Tensor,  # [S, L] token history per state slot (penalties)
    drafts: Drafts | None = None,
    tree: TreeRows | None = None,
    bitmask: torch.Tensor | None = None,  # [N, ceil(V / 32)] int32 grammar masks
) -> SampledStep:
    """Sample, or verify drafts (and alternatives), for every sampling row of a step.
    NOTE: the main logits rows are processed in place."""
    if tree is not None and bitmask is None:
        assert drafts is not None, "alternatives come only with drafts"
        if _fused_tree(batch, drafts, tree):
            return _verify_tree_greedy(kernels, logits, drafts, tree)
    n = rows.token_idx.shape[0]
    main, alt_logits = logits[:n], logits[n:]
    raw = main.clone() if batch.max_logprobs >= 0 else main
    if bitmask is not None:  # NOTE: grammar rows carry no alternatives (step_inputs.py)
        apply_bitmask(main, bitmask)
    if drafts is None and _greedy_unprocessed(batch):
        tokens = kernels.top_tokens(main, 1)  # argmax in one op (torch's: ~30 µs a row)
        accepted = torch.zeros_like(tokens[:, 0])
    elif drafts is None:
        tokens, accepted = _sample_plain(main, batch, rows, positions, history)
    elif _greedy_dense(batch, drafts):
        tokens, accepted, _, _ = kernels.verify_greedy(
            main, drafts.tokens, drafts.num_valid, drafts.tokens[:, :0]
        )
    else:
        tokens, accepted = _verify(main, batch, rows, positions, history, drafts)
    # NOTE: before the alternatives rewrite tokens: rows with alternatives ask for none,
    # the others' chosen tokens are final here.
    logprobs = _logprobs(raw, tokens, batch, rows)
    if tree is None:
        return SampledStep(tokens, accepted, logprobs)
    assert drafts is not None, "a token tree verifies drafts"
    hit, choice = _verify_tree(main, alt_logits, batch, rows, drafts, tree, tokens, accepted)
    return SampledStep(tokens, accepted, logprobs, hit, choice)


def _greedy_unprocessed(batch: SamplingBatch) -> bool:
    """Every row greedy with no logits processing: the token is the plain argmax."""
    return (
        batch.all_greedy
        and batch.min_tokens is None
        and batch.logit_bias is None
        and batch.penalties is None
    )


def _greedy_dense(batch: SamplingBatch, drafts: Drafts) -> bool:
    """Every sampling row verifies K drafts, greedily, with no logits processing."""
    return (
        drafts.dense and batch.all_greedy and batch.min_tokens is None and batch.logit_bias is None
    )


def _fused_tree(batch: SamplingBatch, drafts: Drafts, tree: TreeRows) -> bool:
    """A greedy dense step in which every row also carries alternatives and none asks
    for logprobs: the token-tree step of greedy decoding."""
    return tree.every_row and batch.max_logprobs < 0 and _greedy_dense(batch, drafts)


def _verify_tree_greedy(
    kernels: VerifyKernels, logits: torch.Tensor, drafts: Drafts, tree: TreeRows
) -> SampledStep:
    """One fused op decides what the draft path + `_verify_tree` would."""
    tokens, accepted, hit, choice = kernels.verify_greedy(
        logits, drafts.tokens, drafts.num_valid, tree.tokens
    )
    return SampledStep(tokens, accepted, None, hit, choice)


def _num_known(rows: SampleRows, positions: torch.Tensor) -> torch.Tensor:  # [N]
    """Tokens known before each logits row's sample (its position + 1)."""
    return positions.index_select(0, rows.token_idx) + 1


def _sample_plain(
    logits: torch.Tensor,  # [Rs, V] one logits row per sampling row
    batch: SamplingBatch,
    rows: SampleRows,
    positions: torch.Tensor,
    history: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if batch.min_tokens is not None:
        num_output = _num_known(rows, positions) - batch.prompt_len
        sampler.apply_min_tokens(logits, batch, num_output)
    sampler.apply_logit_bias(logits, batch)
    if batch.penalties is not None:
        hist = history.index_select(0, rows.slot)
        sampler.apply_penalties(logits, batch, hist, _num_known(rows, positions))
    tokens = sampler.sample(logits, batch)[:, None]
    return tokens, torch.zeros_like(tokens[:, 0])


def _verify(
    logits: torch.Tensor,  # [N, V] one row per (sampling row, offset)
    batch: SamplingBatch,
    rows: SampleRows,
    positions: torch.Tensor,
    history: torch.Tensor,
    drafts: Drafts,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling (any mix of greedy, sampled, processed rows)."""
    flat = batch.expand(rows.row_host, rows.row)
    if batch.min_tokens is not None:
        num_output = _num_known(rows, positions) - flat.prompt_len
        sampler.apply_min_tokens(logits, flat, num_output)
    # NOTE: requests with a bias never speculate: one logits row, their first
    sampler.apply_logit_bias(logits, batch, rows.first)
    if batch.penalties is not None:
        _penalize_plain_rows(logits, batch, rows, history, _num_known(rows, positions))
    return rejection_sampler.verify(
        logits, flat, rows.row, rows.offset, drafts.tokens, drafts.num_valid
    )


def _penalize_plain_rows(
    logits: torch.Tensor,  # [N, V] one row per (sampling row, offset)
    batch: SamplingBatch,
    rows: SampleRows,
    history: torch.Tensor,
    num_known: torch.Tensor,  # [N]
) -> None:
    """Penalties in a step that also verifies drafts: requests with penalties never
    speculate, so each has one logits row, at its sampling row's first."""
    first = rows.first
    sel = logits.index_select(0, first)  # [Rs, V]
    hist = history.index_select(0, rows.slot)
    sampler.apply_penalties(sel, batch, hist, num_known.index_select(0, first))
    logits.index_copy_(0, first, sel)


def _verify_tree(
    logits: torch.Tensor,  # [N, V] processed main logits
    alt_logits: torch.Tensor,  # [Ra * W, V] the alternatives' rows
    batch: SamplingBatch,
    rows: SampleRows,
    drafts: Drafts,
    tree: TreeRows,
    tokens: torch.Tensor,  # [Rs, 1 + K] updated in place
    accepted: torch.Tensor,  # [Rs] updated in place
) -> tuple[torch.Tensor, torch.Tensor]:
    w, host = tree.tokens.shape[1], tree.rows_host
    row_batch = alt_batch = batch  # the all-greedy path reads no per-row sampling state
    if not batch.all_greedy or batch.min_tokens is not None:
        each = tree.rows.repeat_interleave(w)
        alt_batch = batch.expand([i for i in host for _ in range(w)], each)
        row_batch = batch.expand(host, tree.rows)
        if batch.min_tokens is not None:
            num_known = (tree.position + 1).repeat_interleave(w)  # the alternative's output
            sampler.apply_min_tokens(alt_logits, alt_batch, num_known - alt_batch.prompt_len)
    alt = rejection_sampler.Alternatives(tree.rows, tree.tokens, alt_logits, row_batch, alt_batch)
    return rejection_sampler.verify_alternatives(
        logits, rows.first, drafts.tokens, drafts.num_valid, tokens, accepted, alt
    )


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch, rows: SampleRows
) -> tuple[torch.Tensor, ...] | None:
    if batch.max_logprobs < 0:
        return None
    chosen = tokens[rows.row, rows.offset]
    return sampler.compute_logprobs(raw, chosen, batch.max_logprobs)
