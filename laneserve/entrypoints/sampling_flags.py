"""The sampling flags that `generate` and `chat` share, and the `SamplingParams` they make."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from laneserve.sampling_params import SamplingParams


def add_sampling_flags(
    p: argparse.ArgumentParser, *, max_tokens: int, temperature: float, top_p: float
) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=temperature, help="0: greedy")
    p.add_argument("--top-p", type=float, default=top_p, help="nucleus sampling mass (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k best tokens (0: off)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    """The flags as `SamplingParams`; `--seed` seeds sampling (greedy needs none)."""
    from laneserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        ignore_eos=ns.ignore_eos,
        seed=ns.seed if ns.temperature > 0 else None,
    )
