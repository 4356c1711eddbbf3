"""DeepSeek V3 / V4 layouts: laneserve vs transformers `generate`, and exact MTP vs no
speculation.

A random mid-size checkpoint (V3: MLA, routed MoE, yarn rope; V4: sliding / CSA / HCA
attention, hyper-connections, hash and scored MoE) is built once in a temporary
directory; greedy generation of a fixed number of tokens (EOS ignored) at each batch
size runs in laneserve and in transformers, loaded side by side in one process, and the
ratios are printed. A second checkpoint of the same depth whose MTP layer predicts the target
exactly measures MTP (k = 1) against no speculation at batch 1: its first layer decides
the next token, the others are inert (zeroed output projections, full cost), so the
draft costs one layer of the target's eight, as DeepSeek V3's one MTP layer costs one
of its 61 layers (`--mtp-inert-layers 0`: a 1-layer target, draft as costly as it).

    .venv/bin/python benchmarks/bench_deepseek.py                 # V3, bf16, batch 1 / 8 / 32
    .venv/bin/python benchmarks/bench_deepseek.py --family v4 --max-tokens 32
    .venv/bin/python benchmarks/bench_deepseek.py --family v4 --batches 1 --profile-dir /tmp/v4
    .venv/bin/python benchmarks/bench_deepseek.py --quick         # tiny fp32 smoke run
    .venv/bin/python benchmarks/bench_deepseek.py --batches 8,32 --max-tokens 32 --repeats 3
    .venv/bin/python benchmarks/bench_deepseek.py --resident      # V4 fp4 experts + fp8

`--resident`: the V4 checkpoint in DeepSeek's release format (FP8 attention and shared
experts with ue8m0 block scales, MXFP4 routed experts) run with its quantized weights
resident as stored, against the same checkpoint dequantized to bf16 at load and against
transformers (bf16) on the exact dequantized values; it also prints the bytes each
laneserve model holds against the checkpoint's tensor bytes.

Built for a shared machine (benchmarks/side_by_side.py): every peer of a comparison is
loaded at once, warmed up once per batch size, then timed `--repeats` times in turn
(A, B, C, A, B, C, ...); each JSON line gives every peer's median tok/s, the first
peer's ratios to the others and each run's seconds.

Run from the repository root (the checkpoint builders live in tests/tiny_models.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.side_by_side import (
    RunFn,
    interleaved,
    laneserve_peer,
    load_transformers,
    open_peers,
    tok_s,
    transformers_peer,
)
from laneserve import LLM, SamplingParams
from laneserve.kernels import get_kernels
from laneserve.model.footprint import checkpoint_bytes, resident_bytes
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import family_for, open_weights
from laneserve.obs.trace_analysis import report
from tests.models.tiny_deepseek_v4 import (
    V4_LAYER_TYPES,
    build_exact_deepseek_v4_mtp,
    build_tiny_deepseek_v4,
    quantized_release,
)
from tests.tiny_models import build_exact_deepseek_mtp, build_tiny_deepseek

MID = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
    num_hidden_layers=8, first_k_dense_replace=1, num_attention_heads=16,
    num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
    qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, num_experts_per_tok=4,
    n_group=4, topk_group=2, n_shared_experts=1, max_position_embeddings=4096,
    initializer_range=0.02,
)  # fmt: skip
QUICK = dict(vocab_size=2048)  # the tiny test config, a larger vocabulary
MID_V4 = dict(
    vocab_size=32000, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=8,
    num_attention_heads=16, head_dim=128, q_lora_rank=384, n_routed_experts=32,
    num_experts_per_tok=4, layer_types=V4_LAYER_TYPES * 2,
    mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6, hc_mult=4, sliding_window=128,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
    o_groups=4, o_lora_rank=256, index_n_heads=16, index_head_dim=64, index_topk=32,
    max_position_embeddings=4096, initializer_range=0.02,
)  # fmt: skip


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def laneserve_tok_s(
    model: Path, dtype: str, batch: list[list[int]], tokens: int, repeats: int = 1, **kw: object
) -> tuple[float, dict]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(str(model), dtype=dtype, enable_prefix_caching=False, **kw) as llm:
        reqs = [{"prompt_token_ids": p} for p in batch]
        llm.generate(reqs[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        elapsed = float("inf")
        for _ in range(repeats):  # the best of `repeats`: load spikes on a shared machine
            start = time.perf_counter()
            llm.generate(reqs, params, use_tqdm=False)
            elapsed = min(elapsed, time.perf_counter() - start)
        stats = llm.get_stats()
    return len(batch) * tokens / elapsed, stats


def transformers_tok_s(
    model: Path, dtype: str, batch: list[list[int]], tokens: int, repeats: int = 1
) -> float:
    hf, cfg, device = load_transformers(model, dtype, tokens)
    ids = torch.tensor(batch, device=device)  # equal lengths: no padding
    with torch.no_grad():
        hf.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=4)
        elapsed = float("inf")
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            if device == "cuda":
                torch.cuda.synchronize()
            elapsed = min(elapsed, time.perf_counter() - start)
    return len(batch) * tokens / elapsed


def held_bytes(model: Path, dtype: str, mode: str) -> int:
    """Bytes of the tensors a laneserve model of `model` holds (CPU, weights in `dtype`)."""
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(model), dtype, cpu, quantized_weights=mode)
    store = open_weights(ckpt, cpu, torch.float32)
    built = family_for(ckpt.arch).model_class(
        ckpt.arch, get_kernels(cpu), store, cpu, torch.float32, 64
    )
    return resident_bytes(built)


def bytes_with_fp32_as_bf16(directory: Path) -> int:
    """The checkpoint's tensor bytes with its fp32 tensors counted at 2 bytes a value:
    the fixture writes the unquantized tensors (embedding, LM head, norms, gates) in fp32,
    which a bf16 run holds in bf16."""
    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                start, stop = entry["data_offsets"]
                total += (stop - start) // (2 if entry["dtype"] == "F32" else 1)
    return total


def ratios(tps: dict[str, float], base: str) -> dict[str, float]:
    """`base`'s median throughput over each other peer's."""
    return {f"{base}_vs_{n}": round(tps[base] / v, 2) for n, v in tps.items() if n != base}


def side_by_side(
    makers: dict[str, Callable[[], AbstractContextManager[RunFn]]],
    batches: list[int],
    args: argparse.Namespace,
    vocab: int,
    seed: int = 0,
) -> None:
    """The peers loaded at once, their timed runs interleaved at each batch size: one JSON
    line per batch with each peer's median tok/s, every run's seconds and the ratios of
    the first peer to the others."""
    with open_peers(makers) as peers:
        for b in batches:
            batch = prompts(b, args.prompt_len, vocab, seed)
            times = interleaved(peers, batch, args.repeats)
            tps = tok_s(times, b * args.max_tokens)
            row: dict[str, object] = {"batch": b}
            row.update({f"{n}_tok_s": round(v, 1) for n, v in tps.items()})
            row.update(ratios(tps, next(iter(tps))))
            row["seconds"] = {n: [round(t, 2) for t in ts] for n, ts in times.items()}
            print(json.dumps(row), flush=True)


def resident_vs_dequantized(args: argparse.Namespace, cfg: dict, batches: list[int]) -> None:
    """FP4 experts + FP8 attention resident vs dequantized to bf16 vs transformers."""
    root = Path(tempfile.mkdtemp(prefix="ls-bench-deepseek-resident-"))
    plain = build_tiny_deepseek_v4(root / "v4", seed=0, **cfg)
    released, reference = quantized_release(plain, root / "release", root / "reference")
    stored, as_bf16 = checkpoint_bytes(released), bytes_with_fp32_as_bf16(released)
    for mode in ("resident", "dequantized"):
        held = held_bytes(released, "bfloat16", mode)
        print(json.dumps({"weights": mode, "held_bytes": held, "checkpoint_bytes": stored,
                          "held_vs_checkpoint": round(held / stored, 3),
                          "checkpoint_bytes_fp32_as_bf16": as_bf16,
                          "held_vs_that": round(held / as_bf16, 3)}), flush=True)  # fmt: skip
    n = args.max_tokens
    makers: dict[str, Callable[[], AbstractContextManager[RunFn]]] = {
        "resident": partial(laneserve_peer, released, "bfloat16", n, quantized_weights="resident"),
        "dequantized": partial(
            laneserve_peer, released, "bfloat16", n, quantized_weights="dequantized"
        ),
    }
    if not args.no_transformers:
        makers["transformers"] = partial(transformers_peer, reference, "bfloat16", n)
    side_by_side(makers, batches, args, cfg["vocab_size"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny fp32 config, batch 1 / 2")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed runs per peer, interleaved; the median counts"
    )
    ap.add_argument("--no-transformers", action="store_true", help="laneserve peers only")
    ap.add_argument("--no-mtp", action="store_true", help="skip the MTP-vs-no-speculation part")
    ap.add_argument("--family", default="v3", choices=["v3", "v4"])
    ap.add_argument(
        "--resident",
        action="store_true",
        help="V4 with fp4 experts + fp8 attention: resident vs dequantized vs transformers",
    )
    ap.add_argument(
        "--profile-dir",
        default=None,
        help="also run batch 1 once traced into this directory and print the trace analysis",
    )
    ap.add_argument(
        "--mtp-inert-layers",
        type=int,
        default=None,
        help="inert layers after the exact-MTP target's first (default: the config's depth - 1)",
    )
    args = ap.parse_args()
    v4 = args.family == "v4" or args.resident
    cfg, dtype, batches = (
        MID_V4 if v4 else MID,
        args.dtype,
        [int(b) for b in args.batches.split(",")],
    )
    if args.quick:
        cfg, dtype, batches, args.max_tokens = QUICK, "float32", [1, 2], 8
    if args.resident:
        resident_vs_dequantized(args, cfg, batches)
        return
    root = Path(tempfile.mkdtemp(prefix="ls-bench-deepseek-"))
    if v4:
        model = build_tiny_deepseek_v4(root / "v4", seed=0, **cfg)
    else:
        model = build_tiny_deepseek(root / "v3", 3, seed=0, **cfg)
    n = args.max_tokens
    makers: dict[str, Callable[[], AbstractContextManager[RunFn]]] = {
        "laneserve": partial(laneserve_peer, model, dtype, n)
    }
    if not args.no_transformers:
        makers["transformers"] = partial(transformers_peer, model, dtype, n)
    side_by_side(makers, batches, args, cfg["vocab_size"])
    if args.profile_dir:
        one = prompts(1, args.prompt_len, cfg["vocab_size"])
        laneserve_tok_s(model, dtype, one, n, profile_dir=args.profile_dir)
        print(report([args.profile_dir], max_rows=0), flush=True)
    if not args.no_mtp:
        mtp_vs_no_speculation(args, cfg, dtype, root, v4)


def mtp_vs_no_speculation(
    args: argparse.Namespace, cfg: dict, dtype: str, root: Path, v4: bool
) -> None:
    """Exact MTP (k = 1) against no speculation at batch 1, side by side."""
    depth = cfg.get("num_hidden_layers", 4 if v4 else 3)  # the tiny configs: V3 3, V4 4
    inert = depth - 1 if args.mtp_inert_layers is None else args.mtp_inert_layers
    if v4:
        exact = build_exact_deepseek_v4_mtp(root / "exact", inert_layers=inert, **cfg)
    else:
        exact = build_exact_deepseek_mtp(
            root / "exact", inert_layers=inert, **{**cfg, "num_nextn_predict_layers": 1}
        )
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    stats: dict = {}
    n = args.max_tokens
    makers: dict[str, Callable[[], AbstractContextManager[RunFn]]] = {
        "mtp_k1": partial(laneserve_peer, exact, dtype, n, stats, speculative_config=spec),
        "no_spec": partial(laneserve_peer, exact, dtype, n),
    }
    side_by_side(makers, [1], args, cfg["vocab_size"], seed=1)
    accepted = stats["spec_num_accepted"] / max(stats["spec_num_drafts"], 1)
    print(json.dumps({"acceptance": round(accepted, 3), "target_layers": 1 + inert}))


if __name__ == "__main__":
    main()
