"""Sampling: `prepare()` on the host builds a `SamplingBatch`, `sample()` runs on
the device with no host synchronisation.

Order of logit processing (vLLM's): min_tokens mask -> logit_bias -> penalties -> temperature
-> min_p / top_k / top_p -> draw. Greedy rows take the argmax of the processed
logits (penalties still apply, temperature does not). Random draws use the
exponential race (argmax of p / E, E ~ Exp(1)), which samples exactly from p;
a seeded request draws its E from its own generator, so its tokens do not
depend on its batch companions. Logprobs are of the raw model distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laneserve.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class RowSampling:
    """Host-side view of one sampling request in a step."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_len: int
    eos_token_ids: list[int]


@dataclass
class PenaltyBatch:
    rows: torch.Tensor  # [P] request rows that use penalties
    repetition: torch.Tensor  # [P] f32
    presence: torch.Tensor  # [P] f32
    frequency: torch.Tensor  # [P] f32


@dataclass
class BiasBatch:
    """logit_bias of a step as (row, token, value) triples."""

    rows: torch.Tensor  # [B] int64 request rows
    token_ids: torch.Tensor  # [B] int64
    values: torch.Tensor  # [B] f32


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [R] f32 (1.0 for greedy rows)
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None  # [R] int64, V = disabled
    top_p: torch.Tensor | None  # [R] f32
    min_p: torch.Tensor | None  # [R] f32
    generators: list[torch.Generator | None]  # [R]
    shared_generator: torch.Generator
    penalties: PenaltyBatch | None
    logit_bias: BiasBatch | None
    prompt_len: torch.Tensor  # [R] int64
    min_tokens: torch.Tensor | None  # [R] int64
    banned_until_min: torch.Tensor | None  # [R, M] int64 token ids (-1 pad)
    max_logprobs: int  # -1: nobody asked
    seeded: bool

    def expand(self, rows: list[int], index: torch.Tensor) -> SamplingBatch:
        """One entry per logits row (speculative rows have 1 + k of them)."""

        def sel(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, index)

        def rows_of(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, index)

        return SamplingBatch(
            temperature=rows_of(self.temperature),
            greedy=rows_of(self.greedy),
            all_greedy=self.all_greedy,
            any_greedy=self.any_greedy,
            top_k=sel(self.top_k),
            top_p=sel(self.top_p),
            min_p=sel(self.min_p),
            generators=[self.generators[i] for i in rows],
            shared_generator=self.shared_generator,
            penalties=None,  # NOTE: requests with penalties are never speculative
            logit_bias=None,  # nor those with a logit_bias
            prompt_len=rows_of(self.prompt_len),
            min_tokens=sel(self.min_tokens),
            banned_until_min=sel(self.banned_until_min),
            max_logprobs=self.max_logprobs,
            seeded=self.seeded,
        )


def prepare(
    rows: list[RowSampling], vocab_size: int, device: torch.device, shared: torch.Generator
) -> SamplingBatch:
    ps = [r.params for r in rows]
    greedy = [p.temperature == 0.0 for p in ps]
    temp = [1.0 if g else p.temperature for p, g in zip(ps, greedy, strict=True)]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    random_rows = [p for p, g in zip(ps, greedy, strict=True) if not g]
    top_k = top_p = min_p = None
    if any(p.top_k for p in random_rows):
        top_k = tensor([p.top_k if p.top_k else vocab_size for p in ps], torch.int64)
    if any(p.top_p < 1.0 for p in random_rows):
        top_p = tensor([p.top_p for p in ps], torch.float32)
    if any(p.min_p > 0.0 for p in random_rows):
        min_p = tensor([p.min_p for p in ps], torch.float32)
    pen_rows = [i for i, p in enumerate(ps) if p.uses_penalties]
    penalties = None
    if pen_rows:
        penalties = PenaltyBatch(
            rows=tensor(pen_rows, torch.int64),
            repetition=tensor([ps[i].repetition_penalty for i in pen_rows], torch.float32),
            presence=tensor([ps[i].presence_penalty for i in pen_rows], torch.float32),
            frequency=tensor([ps[i].frequency_penalty for i in pen_rows], torch.float32),
        )
    min_tokens = banned = None
    if any(p.min_tokens for p in ps):
        ban = [
            (r.eos_token_ids if not r.params.ignore_eos else [])
            + list(r.params.stop_token_ids or [])
            for r in rows
        ]
        width = max(1, max(len(b) for b in ban))
        banned = tensor([b + [-1] * (width - len(b)) for b in ban], torch.int64)
        min_tokens = tensor([p.min_tokens for p in ps], torch.int64)
    logprobs = [p.logprobs for p in ps if p.logprobs is not None]
    return SamplingBatch(
        temperature=tensor(temp, torch.float32),
        greedy=tensor(greedy, torch.bool),
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generators=[r.generator for r in rows],
        shared_generator=shared,
        penalties=penalties,
        logit_bias=_bias_batch(ps, tensor),
        prompt_len=tensor([r.prompt_len for r in rows], torch.int64),
        min_tokens=min_tokens,
        banned_until_min=banned,
        max_logprobs=max(logprobs) if logprobs else -1,
        seeded=any(r.generator is not None for r in rows),
    )


def _bias_batch(ps: list[SamplingParams], tensor) -> BiasBatch | None:
    triples = [(i, t, b) for i, p in enumerate(ps) for t, b in (p.logit_bias or {}).items()]
    if not triples:
        return None
    rows, ids, values = zip(*triples, strict=True)
    return BiasBatch(
        tensor(list(rows), torch.int64),
        tensor(list(ids), torch.int64),
        tensor(list(values), torch.float32),
    )


def apply_logit_bias(
    logits: torch.Tensor,  # [R, V], modified in place
    batch: SamplingBatch,
    logits_row: torch.Tensor | None = None,  # [R] the logits row of each request row
) -> None:
    bias = batch.logit_bias
    if bias is None:
        return
    rows = bias.rows if logits_row is None else logits_row.index_select(0, bias.rows)
    logits.index_put_((rows, bias.token_ids), bias.values.to(logits.dtype), accumulate=True)


def apply_penalties(
    logits: torch.Tensor,  # [R, V], modified in place
    batch: SamplingBatch,
    history: torch.Tensor,  # [R, L] token ids of each row's sequence
    num_known: torch.Tensor,  # [R] tokens of each row known before this position
) -> None:
    pen = batch.penalties
    if pen is None:
        return
    v = logits.shape[1]
    hist = history.index_select(0, pen.rows)  # [P, L]
    known = num_known.index_select(0, pen.rows)
    prompt_len = batch.prompt_len.index_select(0, pen.rows)
    pos = torch.arange(hist.shape[1], device=hist.device)[None, :]
    valid = pos < known[:, None]
    is_out = valid & (pos >= prompt_len[:, None])
    safe = torch.where(valid, hist, torch.zeros_like(hist))
    out_counts = torch.zeros(hist.shape[0], v, device=logits.device, dtype=logits.dtype)
    out_counts.scatter_add_(1, safe, is_out.to(logits.dtype))
    seen = torch.zeros(hist.shape[0], v, device=logits.device, dtype=torch.bool)
    seen.scatter_(1, safe, valid)  # prompt and output tokens (repetition penalty)
    rows = logits.index_select(0, pen.rows)
    rep = pen.repetition[:, None]
    rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
    rows = rows - pen.frequency[:, None] * out_counts - pen.presence[:, None] * (out_counts > 0)
    logits.index_copy_(0, pen.rows, rows)


def apply_min_tokens(
    logits: torch.Tensor,  # [R, V]
    batch: SamplingBatch,
    num_output: torch.Tensor,  # [R] outputs already generated before this position
) -> None:
    if batch.min_tokens is None:
        return
    active = (num_output < batch.min_tokens)[:, None]  # [R, 1]
    ban = batch.banned_until_min
    assert ban is not None, "min_tokens rows always carry their banned ids"
    mask = torch.zeros_like(logits, dtype=torch.bool)
    mask.scatter_(1, ban.clamp(min=0), active & (ban >= 0))
    logits.masked_fill_(mask, _NEG_INF)


def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # [R, V]
    """The target distribution after temperature and the support filters."""
    logits = logits / batch.temperature[:, None]
    if batch.top_k is not None:
        logits = _top_k(logits, batch.top_k)
    if batch.top_p is not None:
        logits = _top_p(logits, batch.top_p)
    probs = torch.softmax(logits, dim=-1)
    if batch.min_p is not None:
        keep = probs >= batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def exponential_noise(
    batch: SamplingBatch, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """E ~ Exp(1) per row; seeded rows draw from their own generator."""
    q = torch.empty(shape, device=device)
    if not batch.seeded:
        return q.exponential_(generator=batch.shared_generator)
    for i, gen in enumerate(batch.generators):
        q[i].exponential_(generator=gen if gen is not None else batch.shared_generator)
    return q


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # [R] int64
    """One token per row from already penalised / masked logits."""
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    probs = probabilities(logits, batch)
    q = exponential_noise(batch, tuple(probs.shape), probs.device)
    random_tokens = (probs / q).argmax(dim=-1)
    if not batch.any_greedy:
        return random_tokens
    return torch.where(batch.greedy, greedy_tokens, random_tokens)


def compute_logprobs(
    raw_logits: torch.Tensor,  # [N, V] before any processing
    tokens: torch.Tensor,  # [N] chosen tokens
    num_top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen logprob [N], chosen rank [N], top ids [N, n], top logprobs [N, n])."""
    logp = torch.log_softmax(raw_logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    rank = (logp > chosen[:, None]).sum(dim=-1) + 1
    top_lp, top_ids = (
        logp.topk(max(num_top, 0), dim=-1) if num_top > 0 else (logp[:, :0], tokens[:, None][:, :0])
    )
    return chosen, rank, top_ids, top_lp


def _top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    v = logits.shape[1]
    k = k.clamp(1, v)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    threshold = sorted_desc.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < threshold, _NEG_INF)


def _top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # NOTE: drop the low tail whose mass is <= 1 - p; the top token always stays.
    drop = cum <= (1 - p)[:, None]
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)
