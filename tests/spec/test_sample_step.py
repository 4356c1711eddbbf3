"""The step-level sampling entry (`sample_step`): each of its paths gives what the
composition of the sampler / rejection sampler it stands for gives, and the fused
greedy paths are taken exactly where they apply (and agree with the general ones)."""

from __future__ import annotations

import pytest
import torch

from laneserve.kernels import CpuKernels, TorchKernels, load_kernels
from laneserve.sample import rejection_sampler, sampler
from laneserve.sample.sampler import RowSampling, SamplingBatch
from laneserve.sample.step import Drafts, SampleRows, TreeRows, sample_step
from laneserve.sampling_params import SamplingParams

V = 12
PROMPT_LEN = 4
GREEDY = SamplingParams(temperature=0)


class Recording:
    """Kernels that record which fused verifications ran (W of each call)."""

    def __init__(self, inner: object) -> None:
        self.inner, self.calls = inner, []

    def verify_greedy(self, logits, drafts, num_valid, alternatives):
        self.calls.append(alternatives.shape[1])
        return self.inner.verify_greedy(logits, drafts, num_valid, alternatives)

    def top_tokens(self, logits, n, vocab=None):
        self.calls.append("top")
        return self.inner.top_tokens(logits, n, vocab)


def _kernel_sets() -> list[object]:
    lib = load_kernels()
    return [TorchKernels()] + ([CpuKernels(lib)] if lib is not None else [])


def make_batch(params: list[SamplingParams]) -> SamplingBatch:
    """A fresh batch (fresh generators: equal draws on every call)."""
    gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    rows = [RowSampling(p, g, PROMPT_LEN, [0]) for p, g in zip(params, gens, strict=True)]
    return sampler.prepare(rows, V, torch.device("cpu"), torch.Generator().manual_seed(0))


def make_rows(ks: list[int]) -> SampleRows:
    """Sampling row i has 1 + ks[i] logits rows; logits row n is the forward's token n."""
    row = [i for i, k in enumerate(ks) for _ in range(k + 1)]
    first = [sum(k + 1 for k in ks[:i]) for i in range(len(ks))]
    return SampleRows(
        index=torch.arange(len(ks)),
        slot=torch.arange(len(ks)) * 2 + 1,  # state slots differ from row indices
        first=torch.tensor(first),
        token_idx=torch.arange(len(row)),
        row=torch.tensor(row),
        row_host=row,
        offset=torch.tensor([j for k in ks for j in range(k + 1)]),
    )


def case(ks: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [N, V] with token 0 (EOS) often on top, positions [N], history [S, L])."""
    g = torch.Generator().manual_seed(seed)
    n = sum(k + 1 for k in ks)
    logits = torch.randn(n, V, generator=g)
    logits[:, 0] += 1.5
    positions = PROMPT_LEN - 1 + torch.randint(0, 4, (n,), generator=g)
    history = torch.randint(0, V, (2 * len(ks) + 1, 16), generator=g)
    return logits, positions, history


def test_plain_sampling_is_min_tokens_then_penalties_then_sample() -> None:
    ks = [0, 0, 0, 0]
    params = [
        GREEDY,
        SamplingParams(temperature=0, min_tokens=3, repetition_penalty=1.5, logprobs=2),
        SamplingParams(temperature=0.8, seed=3, frequency_penalty=0.7),
        SamplingParams(temperature=1.2, seed=4, min_tokens=2, top_k=5),
    ]
    for seed in range(20):
        logits, positions, history = case(ks, seed)
        b, rows = make_batch(params), make_rows(ks)
        ref = logits.clone()
        known = positions + 1
        sampler.apply_min_tokens(ref, b, known - b.prompt_len)
        sampler.apply_penalties(ref, b, history.index_select(0, rows.slot), known)
        want = sampler.sample(ref, b)
        kern = Recording(TorchKernels())
        got = sample_step(kern, logits.clone(), make_batch(params), rows, positions, history)
        assert torch.equal(got.tokens[:, 0], want) and got.tokens.shape == (4, 1)
        assert got.num_accepted.tolist() == [0, 0, 0, 0] and got.tree_hit is None
        lp = sampler.compute_logprobs(logits, want, 2)
        assert all(torch.equal(a, b) for a, b in zip(got.logprobs, lp, strict=True))
        assert kern.calls == []


@pytest.mark.parametrize("kernels", _kernel_sets(), ids=lambda k: k.name)
def test_all_greedy_plain_rows_take_one_argmax_op(kernels: object) -> None:
    """Greedy rows with no processing: one top_tokens call, torch.argmax's choice (first
    of tied maxima, NaN on top); any processing sends the step down the general path."""
    ks = [0, 0, 0]
    for seed in range(6):
        logits, positions, history = case(ks, seed)
        logits[1, 7] = logits[1].max()  # a tie: the lower column wins
        logits[2, 9] = float("nan")
        kern = Recording(kernels)
        b, rows = make_batch([GREEDY] * 3), make_rows(ks)
        got = sample_step(kern, logits.clone(), b, rows, positions, history)
        assert torch.equal(got.tokens[:, 0], logits.argmax(dim=-1)) and kern.calls == ["top"]
        assert got.tokens[2, 0] == 9 and got.num_accepted.tolist() == [0, 0, 0]
    kern = Recording(kernels)
    params = [GREEDY, SamplingParams(temperature=0, repetition_penalty=1.3), GREEDY]
    sample_step(kern, logits.clone(), make_batch(params), make_rows(ks), positions, history)
    assert kern.calls == []


def _verify_reference(
    logits: torch.Tensor,
    b: SamplingBatch,
    ks: list[int],
    positions: torch.Tensor,
    history: torch.Tensor,
    drafts: Drafts,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """min_tokens on every logits row, penalties on the rows' first, then verify; the
    processed logits are returned too (alternatives are verified against them)."""
    rows = make_rows(ks)
    flat = b.expand(rows.row_host, rows.row)
    ref = logits.clone()
    known = positions.index_select(0, rows.token_idx) + 1
    sampler.apply_min_tokens(ref, flat, known - flat.prompt_len)
    first = ref.index_select(0, rows.first)
    hist = history.index_select(0, rows.slot)
    sampler.apply_penalties(first, b, hist, known.index_select(0, rows.first))
    ref.index_copy_(0, rows.first, first)
    tokens, acc = rejection_sampler.verify(
        ref, flat, rows.row, rows.offset, drafts.tokens, drafts.num_valid
    )
    return tokens, acc, ref


def _drafts(logits: torch.Tensor, ks: list[int], seed: int, dense: bool) -> Drafts:
    """Drafts that match the target's argmax for a while, then may not."""
    g = torch.Generator().manual_seed(seed)
    k = max(ks)
    rows = make_rows(ks)
    top = torch.zeros(len(ks), k + 1, dtype=torch.int64)
    top[rows.row, rows.offset] = logits.argmax(dim=-1)
    noise = torch.randint(0, V, (len(ks), k), generator=g)
    keep = torch.rand(len(ks), k, generator=g) < 0.7
    return Drafts(torch.where(keep, top[:, :k], noise), torch.tensor(ks), dense)


@pytest.mark.parametrize("kernels", _kernel_sets(), ids=lambda k: k.name)
def test_dense_greedy_steps_take_the_fused_verify(kernels: object) -> None:
    ks = [2, 2, 2]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0, logprobs=1)]
    for seed in range(30):
        logits, positions, history = case(ks, seed)
        drafts = _drafts(logits, ks, seed, dense=True)
        want, acc, _ = _verify_reference(logits, make_batch(params), ks, positions, history, drafts)
        kern = Recording(kernels)
        got = sample_step(
            kern, logits.clone(), make_batch(params), make_rows(ks), positions, history, drafts
        )
        assert kern.calls == [0]
        assert torch.equal(got.tokens, want) and torch.equal(got.num_accepted, acc)
        rows = make_rows(ks)
        lp = sampler.compute_logprobs(logits, want[rows.row, rows.offset], 1)
        assert all(torch.equal(a, b) for a, b in zip(got.logprobs, lp, strict=True))


@pytest.mark.parametrize(
    ("ks", "params"),
    [
        ([2, 2], [GREEDY, SamplingParams(temperature=0, min_tokens=4)]),  # processed
        ([2, 1], [GREEDY, GREEDY]),  # not dense
        ([2, 0], [SamplingParams(temperature=0.9, seed=5), GREEDY]),  # sampled
        ([0, 3, 1], [SamplingParams(presence_penalty=1.0, seed=2), GREEDY, GREEDY]),
    ],
)
def test_other_draft_steps_take_rejection_sampling(ks: list[int], params: list) -> None:
    for seed in range(20):
        logits, positions, history = case(ks, seed)
        drafts = _drafts(logits, ks, seed, dense=len(set(ks)) == 1)
        want, acc, _ = _verify_reference(logits, make_batch(params), ks, positions, history, drafts)
        kern = Recording(TorchKernels())
        got = sample_step(
            kern, logits.clone(), make_batch(params), make_rows(ks), positions, history, drafts
        )
        assert kern.calls == [] and got.logprobs is None
        assert torch.equal(got.tokens, want) and torch.equal(got.num_accepted, acc)


def _tree(ks: list[int], rows: list[int], logits: torch.Tensor, seed: int) -> TreeRows:
    """Two alternatives per row, distinct from its first draft; one often the argmax."""
    g = torch.Generator().manual_seed(seed + 100)
    first = make_rows(ks).first
    alts = torch.stack([torch.randperm(V, generator=g)[:2] for _ in rows])
    best = logits.index_select(0, first[rows]).argmax(dim=-1)
    alts[:, 0] = torch.where(torch.rand(len(rows), generator=g) < 0.6, best, alts[:, 0])
    alts[:, 1] = torch.where(alts[:, 1] == alts[:, 0], (alts[:, 0] + 1) % V, alts[:, 1])
    return TreeRows(
        torch.tensor(rows), rows, len(rows) == len(ks), alts, torch.full((len(rows),), 5)
    )


def _tree_reference(
    params: list[SamplingParams],
    ks: list[int],
    logits: torch.Tensor,  # [N + Ra * W, V]
    positions: torch.Tensor,
    history: torch.Tensor,
    drafts: Drafts,
    tree: TreeRows,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = make_rows(ks).token_idx.shape[0]
    main, side = logits[:n], logits[n:].clone()
    b = make_batch(params)  # NOTE: one batch: the alternatives draw after the drafts
    tokens, acc, processed = _verify_reference(main, b, ks, positions, history, drafts)
    w, host = tree.tokens.shape[1], tree.rows_host
    alt_batch = b.expand([i for i in host for _ in range(w)], tree.rows.repeat_interleave(w))
    known = (tree.position + 1).repeat_interleave(w)
    sampler.apply_min_tokens(side, alt_batch, known - alt_batch.prompt_len)
    alt = rejection_sampler.Alternatives(
        tree.rows, tree.tokens, side, b.expand(host, tree.rows), alt_batch
    )
    first = make_rows(ks).first
    hit, _ = rejection_sampler.verify_alternatives(
        processed, first, drafts.tokens, drafts.num_valid, tokens, acc, alt
    )
    return tokens, acc, hit


@pytest.mark.parametrize("kernels", _kernel_sets(), ids=lambda k: k.name)
def test_greedy_token_tree_takes_one_fused_op_and_agrees_with_the_general_path(
    kernels: object,
) -> None:
    ks = [1, 1, 1]
    hits = 0
    for seed in range(40):
        logits, positions, history = case(ks, seed)
        drafts = _drafts(logits, ks, seed, dense=True)
        tree = _tree(ks, [0, 1, 2], logits, seed)
        side = torch.randn(6, V, generator=torch.Generator().manual_seed(seed))
        every = torch.cat([logits, side])
        want, acc, hit = _tree_reference([GREEDY] * 3, ks, every, positions, history, drafts, tree)
        kern = Recording(kernels)
        rows = make_rows(ks)
        got = sample_step(
            kern, every.clone(), make_batch([GREEDY] * 3), rows, positions, history, drafts, tree
        )
        assert kern.calls == [2] and got.logprobs is None
        assert torch.equal(got.tokens, want) and torch.equal(got.num_accepted, acc)
        assert torch.equal(got.tree_hit, hit)
        # asking for logprobs leaves the fused tree op: the draft path, then the
        # alternatives, decide the same tokens
        lp_params = [GREEDY, GREEDY, SamplingParams(temperature=0, logprobs=0)]
        kern = Recording(kernels)
        general = sample_step(
            kern, every.clone(), make_batch(lp_params), rows, positions, history, drafts, tree
        )
        assert kern.calls == [0] and general.logprobs is not None
        assert torch.equal(general.tokens, got.tokens) and torch.equal(general.tree_hit, hit)
        hits += int(hit.sum())
    assert hits > 0, "no alternative was ever accepted: the tree path was not exercised"


@pytest.mark.parametrize(
    ("ks", "tree_rows", "params"),
    [
        ([2, 1, 0], [0, 1], [GREEDY, SamplingParams(temperature=0.7, seed=1), GREEDY]),
        ([1, 1], [0, 1], [SamplingParams(temperature=0, min_tokens=9), GREEDY]),
        ([1, 1], [1], [SamplingParams(temperature=0, logprobs=1), GREEDY]),
    ],
)
def test_other_token_trees_verify_alternatives_after_the_drafts(
    ks: list[int], tree_rows: list[int], params: list
) -> None:
    for seed in range(20):
        logits, positions, history = case(ks, seed)
        drafts = _drafts(logits, ks, seed, dense=len(set(ks)) == 1)
        tree = _tree(ks, tree_rows, logits, seed)
        side = torch.randn(2 * len(tree_rows), V, generator=torch.Generator().manual_seed(seed))
        every = torch.cat([logits, side])
        want, acc, hit = _tree_reference(params, ks, every, positions, history, drafts, tree)
        got = sample_step(
            Recording(TorchKernels()),
            every.clone(),
            make_batch(params),
            make_rows(ks),
            positions,
            history,
            drafts,
            tree,
        )
        assert torch.equal(got.tokens, want) and torch.equal(got.num_accepted, acc)
        assert torch.equal(got.tree_hit, hit)
