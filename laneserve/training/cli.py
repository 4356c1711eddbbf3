"""`laneserve train-mtp` flags. Kept apart from the trainer so that building the
parser (and `--help`) does not import torch."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-mtp", help="train an MTP draft head for a model (self-distillation)")
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded model)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--num-prompts", type=int, default=500, help="training prompts to generate on")
    p.add_argument(
        "--max-new-tokens", type=int, default=160, help="greedy tokens generated per prompt"
    )
    p.add_argument("--gen-batch", type=int, default=32, help="prompts generated together")
    p.add_argument("--epochs", type=float, default=3.0, help="passes over the training data")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="tokens the head drafts from, most frequent first (0: the full vocabulary)",
    )
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument(
        "--distill",
        choices=("soft", "hard"),
        default="soft",
        help="soft: match the target's whole distribution of t[i+2]; hard: its argmax only",
    )
    p.add_argument(
        "--holdout",
        type=int,
        default=None,
        help="sequences from unseen prompts to measure top-1 on (None: num-prompts / 8, 1 to 32)",
    )
    p.add_argument(
        "--train-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="bfloat16: mixed precision (autocast; fp32 weights and optimizer), ~40%% faster "
        "steps on CPUs with bf16 dot products (AVX512-BF16)",
    )
    p.add_argument(
        "--lookup-weight",
        type=float,
        default=1.0,
        help="loss weight of positions a prompt lookup (n = 2..4) covers, where ngram_first "
        "drafts from the lookup (0: skip them)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation and shuffling")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the data and checkpoint saved beside --out",
    )
    p.add_argument("--dtype", default="auto", help="dtype of the base model while generating")
    p.set_defaults(func=_run)


def _run(ns: argparse.Namespace) -> int:
    from laneserve.training import train_mtp

    return train_mtp.run(ns)
