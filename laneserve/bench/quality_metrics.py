"""The arithmetic of `laneserve bench quality`: context windows, perplexity and the KL
divergence of a mode's next-token distributions to the reference's.

It follows llama.cpp's `llama-perplexity`: the token stream is cut into consecutive windows
of `n_ctx` tokens (a tail shorter than a window is dropped); each window is evaluated on
its own, from an empty cache; only the second half is scored: the logits at positions
`first = n_ctx // 2 .. n_ctx - 2` predict the tokens at `first + 1 .. n_ctx - 1`, so every
scored token sees at least `n_ctx // 2` tokens of context. Where the model's tokenizer
puts a BOS token at the start of a text, each window's first token is replaced by it, as
llama.cpp does. Perplexity is `exp(mean NLL)` over every scored token of every window.
The KL divergence per scored token is `sum_v p_ref(v) (log p_ref(v) - log p_mode(v))` over
the whole vocabulary (llama.cpp's `--kl-divergence`), averaged over the scored tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def windows(tokens: list[int], n_ctx: int, bos: int | None, limit: int | None) -> list[list[int]]:
    """Consecutive windows of `n_ctx` tokens (at most `limit`), each starting with `bos`
    when given (llama-perplexity's habit for models that add a BOS token)."""
    if n_ctx < 4:
        raise ValueError(f"--ctx-size must be at least 4 tokens, got {n_ctx}")
    count = len(tokens) // n_ctx
    if count == 0:
        raise ValueError(
            f"the input has {len(tokens)} tokens, fewer than one window of --ctx-size {n_ctx}"
        )
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--chunks must be at least 1, got {limit}")
        count = min(count, limit)
    out = [tokens[i * n_ctx : (i + 1) * n_ctx] for i in range(count)]
    if bos is not None:
        out = [[bos, *w[1:]] for w in out]
    return out


def first_scored(n_ctx: int) -> int:
    """The first position whose logits are scored (it predicts the token after it)."""
    return n_ctx // 2


@dataclass
class Scores:
    """Running sums of one mode over the scored tokens of every window."""

    count: int = 0
    nll: float = 0.0  # sum of -log p(target)
    nll_sq: float = 0.0  # sum of squares (the perplexity's uncertainty)
    kl: float = 0.0  # sum of KL(reference || mode)
    kl_max: float = 0.0
    same_top: int = 0  # positions whose argmax equals the reference's
    kl_values: list[float] = field(default_factory=list)

    def add(self, logprobs: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor) -> None:
        """One window: `logprobs` and `ref` [P, V] log-softmax rows (fp32) of the mode and
        the reference at the scored positions, `targets` [P] the tokens they predict."""
        lp = logprobs.double()
        nll = -lp.gather(1, targets.view(-1, 1)).squeeze(1)
        ref64 = ref.double()
        # NOTE: p_ref = 0 contributes 0 (torch.xlogy-style); -inf - -inf would be NaN
        diff = torch.where(ref64.isneginf(), torch.zeros_like(ref64), ref64 - lp)
        kl = (ref64.exp() * diff).sum(dim=1)
        self.count += int(nll.numel())
        self.nll += float(nll.sum())
        self.nll_sq += float((nll * nll).sum())
        self.kl += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.same_top += int((lp.argmax(dim=1) == ref64.argmax(dim=1)).sum())
        self.kl_values.extend(kl.tolist())

    @property
    def mean_nll(self) -> float:
        return self.nll / self.count

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def perplexity_error(self) -> float:
        """llama-perplexity's "±": perplexity times the standard error of the mean NLL."""
        if self.count < 2:
            return 0.0
        var = max(self.nll_sq / self.count - self.mean_nll**2, 0.0)
        return self.perplexity * math.sqrt(var / (self.count - 1))

    @property
    def mean_kl(self) -> float:
        return self.kl / self.count

    @property
    def kl_p99(self) -> float:
        ordered = sorted(self.kl_values)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    @property
    def same_top_pct(self) -> float:
        return 100.0 * self.same_top / self.count

    def row(self, reference_ppl: float) -> dict[str, float | int]:
        return {
            "tokens": self.count,
            "perplexity": self.perplexity,
            "perplexity_error": self.perplexity_error,
            "delta_ppl_pct": 100.0 * (self.perplexity / reference_ppl - 1.0),
            "mean_nll": self.mean_nll,
            "mean_kl": self.mean_kl,
            "p99_kl": self.kl_p99,
            "max_kl": self.kl_max,
            "same_top_pct": self.same_top_pct,
        }
