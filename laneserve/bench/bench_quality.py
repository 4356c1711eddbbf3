"""`laneserve bench quality`: perplexity and KL divergence to the exact fp32 path, per
numeric mode, in one run (llama.cpp `llama-perplexity` conventions: quality_metrics.py).

The reference is laneserve's own exact mode (`--dtype float32 --gguf-weights quantized`):
fp32 arithmetic on the checkpoint's own weights, which the tests hold equal to
transformers' fp32 greedy output on the same (dequantized) weights; unlike a transformers
run it needs no second runtime, and it sees the very windows and positions the modes see.
It is computed by an engine of its own, so the `exact` mode's row (KL 0) is a check that
the reference is reproducible, not a copy of it.

Each mode is an engine (worker in this process) with some fields set over the command
line's engine flags: `exact` (dtype float32, GGUF weights kept quantized), `bf16` (dtype
bfloat16, weights kept quantized), `q8-dot` and `dequantized` (`--gguf-weights`, GGUF only;
dtype from `--dtype`), `default` (nothing set: what the engine picks on this CPU). Each
window is a prompt of its first n_ctx - 1 tokens with one greedy token to generate; a tap
on the model runner keeps the normed hidden state of every prompt position, and the
model's own `compute_logits` turns the scored ones into logits (the LM head the engine
samples from). The table goes to stderr, one JSON line to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from laneserve.engine_args import EngineArgs
    from laneserve.frontend.llm import LLM
    from laneserve.worker.worker import Worker

REFERENCE = "exact"
# mode -> the engine fields it sets (the others come from the command line)
MODES: dict[str, dict[str, str]] = {
    "exact": {"dtype": "float32", "gguf_weights": "quantized"},
    "bf16": {"dtype": "bfloat16", "gguf_weights": "quantized"},
    "q8-dot": {"gguf_weights": "q8-dot"},
    "dequantized": {"gguf_weights": "dequantized"},
    "default": {},
}
GGUF_ONLY = ("q8-dot", "dequantized")
DEFAULT_MODES = {True: "exact,default,q8-dot", False: "exact,default,bf16"}  # by: a GGUF?
LOGIT_ROWS = 32  # scored rows per compute_logits call (bounds the q8 reference's memory)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from laneserve.engine_args import EngineArgs

    p = sub.add_parser(
        "quality",
        help="perplexity and KL divergence to the exact fp32 path, per numeric mode",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", default=None, help="a UTF-8 text file to score")
    src.add_argument(
        "--token-ids",
        default=None,
        help="a file of token ids (a JSON list, or whitespace-separated)",
    )
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma list of modes to score against the exact reference, of {', '.join(MODES)}"
        f"; unset: {DEFAULT_MODES[True]} for a GGUF file, else {DEFAULT_MODES[False]}",
    )
    p.add_argument("--ctx-size", type=int, default=512, help="tokens per window (n_ctx)")
    p.add_argument(
        "--chunks", type=int, default=None, help="score at most this many windows (default: all)"
    )
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def parse_modes(text: str | None, model: str | None) -> list[str]:
    gguf = model is None or Path(model).suffix == ".gguf"  # None: the embedded GGUF
    if text is None:
        text = DEFAULT_MODES[gguf]
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise ValueError("--modes is empty")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"--modes names a mode twice: {modes}")
    wrong = [m for m in modes if m in GGUF_ONLY and not gguf]
    if wrong:
        raise ValueError(f"modes {wrong} apply to GGUF files only; {model!r} is not one")
    return modes


def read_input(text: str | None, token_ids: str | None) -> str | list[int]:
    """The text, or the token ids, of the input file (checked before any model loads)."""
    path = Path(text or token_ids or "")
    if not path.is_file():
        raise ValueError(f"input file {str(path)!r} does not exist")
    content = path.read_text(encoding="utf-8")
    if not content.strip():
        raise ValueError(f"input file {str(path)!r} is empty")
    if text is not None:
        return content
    try:
        ids = json.loads(content) if content.lstrip().startswith("[") else content.split()
        return [int(i) for i in ids]
    except (ValueError, TypeError):
        raise ValueError(
            f"{str(path)!r} is not a list of token ids (a JSON list or whitespace-separated "
            "integers)"
        ) from None


def run(ns: argparse.Namespace) -> int:
    from laneserve.engine_args import EngineArgs

    args = EngineArgs.from_cli(ns)
    modes = parse_modes(ns.modes, args.model)
    data = read_input(ns.text, ns.token_ids)
    result = measure(args, modes, data, ns.ctx_size, ns.chunks)
    print_table(result)
    print(json.dumps({"bench": "quality", **result}))
    return 0


def measure(
    args: EngineArgs, modes: list[str], data: str | list[int], n_ctx: int, chunks: int | None
) -> dict:
    """Loads the reference and every mode's engine, scores each window with all of them
    and returns {"ctx_size", "windows", "scored_tokens", "reference", "rows"}."""
    from tqdm import tqdm

    from laneserve.bench.quality_metrics import Scores, first_scored, windows

    engines: dict[str, LLM] = {}
    try:
        engines[REFERENCE + " (reference)"] = _engine(args, MODES[REFERENCE], n_ctx)
        ref_llm = next(iter(engines.values()))
        tokens, bos = _tokens(ref_llm, data)
        wins = windows(tokens, n_ctx, bos, chunks)
        for mode in modes:
            engines[mode] = _engine(args, MODES[mode], n_ctx)
        scores = {name: Scores() for name in engines}
        numerics = {name: describe(_worker(llm)) for name, llm in engines.items()}
        first = first_scored(n_ctx)
        for win in tqdm(wins, desc="windows", file=sys.stderr):
            targets = _as_tensor(win[first + 1 :])
            ref = None
            for name, llm in engines.items():
                lp = window_logprobs(llm, win, first)
                ref = lp if ref is None else ref
                scores[name].add(lp, targets, ref)
    finally:
        for llm in engines.values():
            llm.shutdown()
    reference = next(iter(scores.values()))
    return {
        "ctx_size": n_ctx,
        "windows": len(wins),
        "scored_tokens": reference.count,
        "rows": {
            name: {"numerics": numerics[name], **s.row(reference.perplexity)}
            for name, s in scores.items()
        },
    }


def _engine(args: EngineArgs, overrides: dict[str, str], n_ctx: int) -> LLM:
    from laneserve import LLM

    if args.max_model_len is not None and args.max_model_len < n_ctx:
        raise ValueError(f"--ctx-size {n_ctx} is larger than --max-model-len {args.max_model_len}")
    fields = dict(
        overrides,
        worker_mode="thread",  # the tap and the LM head are read in this process
        enable_prefix_caching=False,  # every position of every window is computed
        max_num_seqs=1,
        max_model_len=args.max_model_len or n_ctx,
        # one window at a time: its blocks, unless the command line sized the cache
        num_kv_blocks=args.num_kv_blocks or -(-(args.max_model_len or n_ctx) // args.block_size),
    )
    try:
        return LLM(**vars(dataclasses.replace(args, **fields)))  # type: ignore[arg-type]
    except ValueError as e:
        if "exceeds the model's limit" in str(e):
            raise ValueError(
                f"--ctx-size {n_ctx} is larger than the model's context: {e}"
            ) from None
        raise


def _tokens(llm: LLM, data: str | list[int]) -> tuple[list[int], int | None]:
    """The token stream and the BOS id each window starts with (None: the tokenizer adds
    none; a file of token ids is taken as given)."""
    vocab = _worker(llm).ckpt.arch.vocab_size
    if isinstance(data, list):
        bad = [t for t in data if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return data, None
    tok = llm.get_tokenizer()
    with_special = tok("a")["input_ids"]
    plain = tok("a", add_special_tokens=False)["input_ids"]
    bos = tok.bos_token_id
    adds_bos = bos is not None and len(with_special) > len(plain) and with_special[0] == bos
    ids = tok(data, add_special_tokens=False, verbose=False)["input_ids"]
    return list(ids), bos if adds_bos else None


def window_logprobs(llm: LLM, window: list[int], first: int) -> torch.Tensor:
    """[n_ctx - 1 - first, V] fp32 log-softmax rows of the positions first .. n_ctx - 2."""
    import torch

    from laneserve import SamplingParams

    runner = _worker(llm).runner
    hidden: dict[int, torch.Tensor] = {}

    def tap(inp: object, ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
        pos = positions.tolist()
        for t, p in enumerate(pos):
            if first <= p < len(window) - 1:
                hidden[p] = out[t].detach().clone()

    runner.capture = tap
    try:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": window[:-1]}], params, use_tqdm=False)
    finally:
        runner.capture = None
    missing = [p for p in range(first, len(window) - 1) if p not in hidden]
    if missing:
        raise RuntimeError(f"the model runner computed no hidden state at positions {missing[:5]}")
    rows = torch.stack([hidden[p] for p in range(first, len(window) - 1)])
    model = _worker(llm).model
    with torch.inference_mode():
        logits = [
            model.compute_logits(rows[i : i + LOGIT_ROWS]) for i in range(0, len(rows), LOGIT_ROWS)
        ]
    return torch.log_softmax(torch.cat(logits).float(), dim=-1)


def describe(worker: Worker) -> str:
    """What a mode resolved to: the weight dtype and, for a GGUF file kept quantized,
    its activations ("bfloat16, GGUF q8 activations")."""
    ckpt = worker.ckpt
    text = str(ckpt.weight_dtype).removeprefix("torch.")
    if ckpt.gguf_quantized is not None:
        text += f", GGUF weights quantized, {ckpt.gguf_activations} activations"
    return text


def _worker(llm: LLM) -> Worker:
    """The engine's worker: in this process (`worker_mode="thread"`, set by `_engine`)."""
    from laneserve.worker.worker import Worker

    worker = getattr(llm.engine.client, "worker", None)
    if not isinstance(worker, Worker):
        raise RuntimeError("bench quality needs the worker in this process (worker_mode thread)")
    return worker


def _as_tensor(ids: list[int]) -> torch.Tensor:
    import torch

    return torch.tensor(ids, dtype=torch.int64)


def print_table(result: dict) -> None:
    out = sys.stderr
    print(
        f"{result['windows']} windows of {result['ctx_size']} tokens, "
        f"{result['scored_tokens']} scored tokens (the second half of each window)",
        file=out,
    )
    print(
        "| mode | numerics | perplexity | Δ ppl | mean KL | p99 KL | max KL | same top-1 |",
        file=out,
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|", file=out)
    for name, r in result["rows"].items():
        ppl = f"{r['perplexity']:.4f} ± {r['perplexity_error']:.4f}"
        head = f"| {name} | {r['numerics']} | {ppl}"
        if name.endswith("(reference)"):
            print(f"{head} | – | – | – | – | – |", file=out)
            continue
        print(
            f"{head} | {r['delta_ppl_pct']:+.3f} % | {r['mean_kl']:.6f} | "
            f"{r['p99_kl']:.6f} | {r['max_kl']:.6f} | {r['same_top_pct']:.2f} % |",
            file=out,
        )
    if not all(math.isfinite(r["perplexity"]) for r in result["rows"].values()):
        print("warning: a mode's perplexity is not finite", file=out)
