"""Rejection sampler: greedy acceptance, seeded determinism, and a statistical
check that the output follows the target distribution, not the draft's."""

from __future__ import annotations

import pytest
import torch

from laneserve.kernels import CpuKernels, TorchKernels, load_kernels
from laneserve.sample import sampler
from laneserve.sample.rejection_sampler import Alternatives, verify, verify_alternatives
from laneserve.sample.sampler import RowSampling
from laneserve.sampling_params import SamplingParams


def flat_batch(
    params: list[SamplingParams], rows: list[int], seeds: list[int | None]
) -> sampler.SamplingBatch:
    gens = []
    for s in seeds:
        g = None
        if s is not None:
            g = torch.Generator()
            g.manual_seed(s)
        gens.append(g)
    shared = torch.Generator()
    shared.manual_seed(0)
    b = sampler.prepare(
        [RowSampling(p, g, 1, [0]) for p, g in zip(params, gens, strict=True)],
        8,
        torch.device("cpu"),
        shared,
    )
    return b.expand(rows, torch.tensor(rows))


def test_greedy_accepts_while_drafts_match() -> None:
    # one row, k = 3: target argmax at offsets 0..3 is [5, 6, 1, 4]
    logits = torch.full((4, 8), -5.0)
    for j, t in enumerate([5, 6, 1, 4]):
        logits[j, t] = 5.0
    b = flat_batch([SamplingParams(temperature=0)], [0, 0, 0, 0], [None])
    off = torch.arange(4)
    row = torch.zeros(4, dtype=torch.int64)
    cases = [
        ([5, 6, 1], 3, [5, 6, 1, 4]),
        ([5, 6, 2], 2, [5, 6, 1]),
        ([7, 6, 1], 0, [5]),
        ([5, 6, 1], 1, [5, 6]),
    ]
    for drafts, valid, expect_prefix in cases[:3]:
        tokens, acc = verify(logits, b, row, off, torch.tensor([drafts]), torch.tensor([3]))
        assert acc.tolist() == [valid] and tokens[0, : valid + 1].tolist() == expect_prefix
    # only 1 real draft in 3 slots: the rest are never accepted (the bonus comes at offset 1)
    tokens, acc = verify(logits, b, row, off, torch.tensor([[5, 6, 1]]), torch.tensor([1]))
    assert acc.tolist() == [1] and tokens[0, :2].tolist() == [5, 6]


def _first_token_distribution(draft: int, probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    logits = probs.log().expand(2, -1).clone()  # offsets 0 (draft slot) and 1 (bonus)
    params = [SamplingParams(temperature=1.0, seed=seed + i) for i in range(n)]
    rows = [i for i in range(n) for _ in range(2)]
    b = flat_batch(params, rows, [seed + i for i in range(n)])
    flat_logits = logits.repeat(n, 1)
    flat_row = torch.tensor(rows)
    flat_off = torch.tensor([0, 1] * n)
    tokens, acc = verify(
        flat_logits,
        b,
        flat_row,
        flat_off,
        torch.full((n, 1), draft),
        torch.ones(n, dtype=torch.int64),
    )
    return torch.bincount(tokens[:, 0], minlength=probs.shape[0]).float() / n, acc


def test_output_distribution_is_the_target_not_the_draft() -> None:
    target = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.05, 0.1, 0.05, 0.05])
    n = 6000
    freq, acc = _first_token_distribution(draft=3, probs=target, n=n, seed=100)
    # the draft is always token 3 (q is one-hot), yet token 3 appears with p = 0.2
    assert torch.allclose(freq, target, atol=0.02), freq
    assert abs(acc.float().mean().item() - 0.2) < 0.02  # acceptance = p(draft)


def test_seeded_verification_is_deterministic() -> None:
    target = torch.softmax(torch.randn(8, generator=torch.Generator().manual_seed(3)), -1)
    a, _ = _first_token_distribution(draft=1, probs=target, n=200, seed=7)
    b, _ = _first_token_distribution(draft=1, probs=target, n=200, seed=7)
    c, _ = _first_token_distribution(draft=1, probs=target, n=200, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)


def _with_alternatives(
    p0: torch.Tensor, bonus: dict[int, torch.Tensor], draft: int, alts: list[int], n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n rows of k=1 with alternatives `alts`; (tokens [n, 2], accepted [n], hit [n])."""
    logits = torch.stack([p0.log(), bonus[draft].log()]).repeat(n, 1)  # offsets 0, 1
    rows = [i for i in range(n) for _ in range(2)]
    seeds = [seed + i for i in range(n)]
    params = [SamplingParams(temperature=1.0, seed=s) for s in seeds]
    b = flat_batch(params, rows, seeds)
    flat_row, flat_off = torch.tensor(rows), torch.tensor([0, 1] * n)
    drafts, valid = torch.full((n, 1), draft), torch.ones(n, dtype=torch.int64)
    tokens, acc = verify(logits, b, flat_row, flat_off, drafts, valid)
    w = len(alts)
    own = [2 * i for i in range(n)]  # each row's offset-0 entry of the flat batch
    alt_rows = [r for r in own for _ in range(w)]
    alt = Alternatives(
        rows=torch.arange(n),
        tokens=torch.tensor([alts] * n),
        logits=torch.stack([bonus[a].log() for a in alts]).repeat(n, 1),
        batch=b.expand(own, torch.tensor(own)),
        alt_batch=b.expand(alt_rows, torch.tensor(alt_rows)),
    )
    first = torch.arange(n) * 2
    hit, choice = verify_alternatives(logits, first, drafts, valid, tokens, acc, alt)
    assert torch.equal(choice[hit], torch.tensor([alts.index(t) for t in tokens[hit, 0].tolist()]))
    return tokens, acc, hit


def test_alternatives_keep_the_target_distribution() -> None:
    g = torch.Generator().manual_seed(5)
    p0 = torch.tensor([0.05, 0.25, 0.1, 0.2, 0.05, 0.15, 0.1, 0.1])
    bonus = {t: torch.softmax(2 * torch.randn(8, generator=g), -1) for t in (1, 3, 5)}
    n = 8000
    tokens, acc, hit = _with_alternatives(p0, bonus, draft=3, alts=[1, 5], n=n, seed=1000)
    freq = torch.bincount(tokens[:, 0], minlength=8).float() / n
    assert torch.allclose(freq, p0, atol=0.02), freq  # the target's, whatever was drafted
    # the first draft or one of its alternatives is accepted with p(3) + p(1) + p(5)
    assert abs(acc.float().mean().item() - 0.6) < 0.02
    assert abs(hit.float().mean().item() - 0.4) < 0.02  # p(1) + p(5): via an alternative
    for alt_token in (1, 5):  # after an accepted alternative: its own row's distribution
        second = tokens[hit & (tokens[:, 0] == alt_token), 1]
        got = torch.bincount(second, minlength=8).float() / second.numel()
        assert torch.allclose(got, bonus[alt_token], atol=0.04), (alt_token, got)


def test_alternatives_greedy_and_seeded() -> None:
    p0 = torch.tensor([0.05, 0.1, 0.1, 0.2, 0.05, 0.4, 0.05, 0.05])
    bonus = {t: torch.softmax(torch.arange(8.0) * (t + 1) % 5, -1) for t in (1, 3, 5)}
    # greedy: argmax_0 = 5 is the second alternative; its row's argmax follows
    logits = torch.stack([p0.log(), bonus[3].log()])
    b = flat_batch([SamplingParams(temperature=0)], [0, 0], [None])
    drafts, valid = torch.tensor([[3]]), torch.tensor([1])
    tokens, acc = verify(logits, b, torch.tensor([0, 0]), torch.tensor([0, 1]), drafts, valid)
    alt = Alternatives(
        torch.tensor([0]),
        torch.tensor([[1, 5]]),
        torch.stack([bonus[1].log(), bonus[5].log()]),
        b.expand([0], torch.tensor([0])),
        b.expand([0, 0], torch.tensor([0, 0])),
    )
    hit, choice = verify_alternatives(logits, torch.tensor([0]), drafts, valid, tokens, acc, alt)
    assert hit.tolist() == [True] and choice.tolist() == [1] and acc.tolist() == [1]
    assert tokens[0].tolist() == [5, int(bonus[5].argmax())]
    a = _with_alternatives(p0, bonus, 3, [1, 5], 300, seed=7)[0]
    b2 = _with_alternatives(p0, bonus, 3, [1, 5], 300, seed=7)[0]
    c = _with_alternatives(p0, bonus, 3, [1, 5], 300, seed=8)[0]
    assert torch.equal(a, b2) and not torch.equal(a, c)


def _kernel_sets() -> list[object]:
    lib = load_kernels()
    return [TorchKernels()] + ([CpuKernels(lib)] if lib is not None else [])


@pytest.mark.parametrize("kernels", _kernel_sets(), ids=lambda k: k.name)
def test_fused_greedy_verify_equals_the_general_path(kernels: object) -> None:
    """kernels.verify_greedy (all rows dense, greedy; with or without alternatives) decides
    exactly what verify + verify_alternatives decide, over random cases that cover draft
    hits, alternative hits, misses and rows with fewer valid drafts."""
    g = torch.Generator().manual_seed(3)
    v = 6
    seen = set()
    for case in range(400):
        r, k, w = int(torch.randint(1, 4, (1,), generator=g)), 1 + case % 2, case % 3
        main = torch.randn(r * (k + 1), v, generator=g)
        side = torch.randn(r * w, v, generator=g)
        drafts = torch.randint(0, 3, (r, k), generator=g)
        num_valid = torch.randint(0, k + 1, (r,), generator=g)
        alts = torch.stack([torch.randperm(v, generator=g)[:w] for _ in range(r)])
        # alternatives are distinct from the row's first draft, as the proposer makes them
        alts = torch.where(alts == drafts[:, :1], (alts + w) % v, alts)
        rows = [i for i in range(r) for _ in range(k + 1)]
        b = flat_batch([SamplingParams(temperature=0)] * r, rows, [None] * r)
        flat_off = torch.arange(k + 1).repeat(r)
        tokens, acc = verify(main, b, torch.tensor(rows), flat_off, drafts, num_valid)
        hit = torch.zeros(r, dtype=torch.bool)
        if w:
            own = [i * (k + 1) for i in range(r)]
            alt = Alternatives(torch.arange(r), alts, side, b.expand(own, torch.tensor(own)), b)
            hit, choice = verify_alternatives(
                main, torch.tensor(own), drafts, num_valid, tokens, acc, alt
            )
        f_tokens, f_acc, f_hit, f_choice = kernels.verify_greedy(
            torch.cat([main, side]), drafts, num_valid, alts
        )
        assert torch.equal(f_tokens[:, : k + 1], tokens) and torch.equal(f_acc, acc)
        assert torch.equal(f_hit, hit)
        if w:
            assert torch.equal(f_choice[hit], choice[hit])
        seen.update((int(a), bool(h)) for a, h in zip(acc, hit, strict=True))
    assert {(0, False), (1, True), (1, False)} <= seen  # misses, alternative and draft hits


@pytest.mark.skipif(load_kernels() is None, reason="CPU kernels unavailable")
def test_fused_greedy_verify_argmax_follows_torch() -> None:
    """Ties pick the first maximum, a NaN counts as the maximum, odd widths have tails."""
    ck = CpuKernels(load_kernels())
    g = torch.Generator().manual_seed(1)
    for v in (1, 7, 8, 49152, 50257):
        x = torch.randn(6, v, generator=g)
        x[1] = 0.5  # all equal
        x[2, v // 2 :] = x[2].max() + 1  # a tie at the first of many maxima
        x[3, (3 * v) // 4] = float("nan")
        x[4] = float("-inf")
        x[5, -1] = float("inf")
        drafts = torch.zeros((3, 1), dtype=torch.int64)
        tokens, _, _, _ = ck.verify_greedy(
            x, drafts, torch.ones(3, dtype=torch.int64), drafts[:, :0]
        )
        assert torch.equal(tokens.flatten(), x.argmax(dim=-1)), v
    with pytest.raises(RuntimeError, match="expected R"):
        ck.verify_greedy(torch.zeros(5, 4), drafts, torch.ones(3, dtype=torch.int64), drafts[:, :0])
