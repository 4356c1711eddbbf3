"""The CUDA path: laneserve with decode graphs, laneserve eager (`enforce_eager`) and
transformers `generate`, side by side in one process.

Random-weight Llama checkpoints of real shapes (SmolLM2-135M, SmolLM2-360M and a
1.7B-parameter shape; the embedded model's tokenizer), greedy, EOS ignored. Prints
tok/s per engine and batch size, the ratios, how many decode steps replayed a graph,
and at batch 1 the share of the memory-bandwidth limit (every weight byte read once per
token; `--hbm-gbps`, default from the device name).

    python benchmarks/bench_cuda.py                           # all shapes, batch 1 / 8 / 32
    python benchmarks/bench_cuda.py --shapes 1.7b --batches 1 --profile-dir /tmp/trace
    python benchmarks/bench_cuda.py --quick                   # a tiny shape on any device
    python benchmarks/bench_cuda.py --tp 2 --no-hf            # also tensor parallel (NCCL)

`--tokenizer DIR` (tokenizer.json and its config) is needed where the embedded GGUF
cannot be converted (no `gguf` package); by default it is taken from the conversion.
Run from the repository root. On CPU there are no graphs: both laneserve rows run eagerly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_deepseek import prompts, transformers_tok_s
from laneserve import LLM, SamplingParams
from laneserve.obs.trace_analysis import report

SHAPES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                 num_attention_heads=15, num_key_value_heads=5, head_dim=64),
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                 num_attention_heads=32, num_key_value_heads=32, head_dim=64),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}  # fmt: skip
VOCAB = 49152  # the embedded tokenizer's
HBM_GBPS = {"H200": 4800.0, "H100": 3350.0}  # SXM parts; pass --hbm-gbps for others


def build_checkpoint(out: Path, shape: dict, tokenizer: Path, dtype: torch.dtype) -> int:
    """A random-weight Llama checkpoint; returns its parameter bytes (tied head once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, **shape,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(str(out))
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def default_tokenizer() -> Path:
    from laneserve.model.gguf import converted_dir
    from laneserve.model.loader import default_model_path

    return converted_dir(default_model_path(), torch.bfloat16)


def laneserve_run(
    model: Path, dtype: str, batch: list[list[int]], tokens: int, eager: bool, **kw: object
) -> tuple[float, int]:
    """(tok/s, decode steps that replayed a graph) of one timed run after a warm-up."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in batch]
    with LLM(
        str(model), dtype=dtype, enable_prefix_caching=False, enforce_eager=eager,
        worker_mode="thread", max_num_seqs=max(len(batch), 1), **kw,
    ) as llm:  # fmt: skip
        llm.generate(reqs, params, use_tqdm=False)  # warm-up: captures the batch's buckets
        graphs = llm.engine.client.worker.runner.graphs
        before = graphs.replays if graphs is not None else 0
        _sync()
        start = time.perf_counter()
        llm.generate(reqs, params, use_tqdm=False)
        _sync()
        elapsed = time.perf_counter() - start
        replays = (graphs.replays - before) if graphs is not None else 0
    return len(batch) * tokens / elapsed, replays


def laneserve_tp_tok_s(
    model: Path, dtype: str, batch: list[list[int]], tokens: int, tp: int
) -> float:
    """tok/s of one timed run after a warm-up, on `tp` rank processes (NCCL on CUDA;
    decode steps run eagerly with tp > 1)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in batch]
    with LLM(
        str(model), dtype=dtype, enable_prefix_caching=False, worker_mode="process",
        tensor_parallel_size=tp, max_num_seqs=max(len(batch), 1),
    ) as llm:  # fmt: skip
        llm.generate(reqs, params, use_tqdm=False)
        start = time.perf_counter()
        llm.generate(reqs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return len(batch) * tokens / elapsed


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="135m,360m,1.7b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--hbm-gbps", type=float, default=None, help="peak memory bandwidth, GB/s")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--profile-dir", default=None, help="trace batch 1 of the last shape")
    ap.add_argument("--quick", action="store_true", help="the tiny shape, batch 1 / 4, 16 tokens")
    ap.add_argument("--tp", type=int, default=1, help="also run on this many ranks (one per GPU)")
    args = ap.parse_args()
    shapes, batches = args.shapes.split(","), [int(b) for b in args.batches.split(",")]
    if args.quick:
        shapes, batches, args.max_tokens = ["tiny"], [1, 4], 16
    tokenizer = args.tokenizer or default_tokenizer()
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    peak = args.hbm_gbps or _peak_bandwidth()
    root = Path(tempfile.mkdtemp(prefix="ls-bench-cuda-"))
    for name in shapes:
        model = root / name
        weight_bytes = build_checkpoint(model, SHAPES[name], tokenizer, dtype)
        for b in batches:
            batch = prompts(b, args.prompt_len, VOCAB)
            row: dict = {"shape": name, "batch": b}
            for label, eager in (("graphs", False), ("eager", True)):
                tok_s, replays = laneserve_run(model, args.dtype, batch, args.max_tokens, eager)
                row[f"laneserve_{label}_tok_s"] = round(tok_s, 1)
                row[f"{label}_replays"] = replays
            if args.tp > 1:
                tp_tok_s = laneserve_tp_tok_s(model, args.dtype, batch, args.max_tokens, args.tp)
                row[f"laneserve_tp{args.tp}_tok_s"] = round(tp_tok_s, 1)
                row[f"tp{args.tp}_vs_eager"] = round(tp_tok_s / row["laneserve_eager_tok_s"], 2)
            if not args.no_hf:
                hf = transformers_tok_s(model, args.dtype, batch, args.max_tokens)
                row["transformers_tok_s"] = round(hf, 1)
                row["graphs_vs_transformers"] = round(row["laneserve_graphs_tok_s"] / hf, 2)
            row["graphs_vs_eager"] = round(
                row["laneserve_graphs_tok_s"] / row["laneserve_eager_tok_s"], 2
            )
            if b == 1 and peak:
                limit = peak * 1e9 / weight_bytes
                row["bandwidth_limit_tok_s"] = round(limit, 1)
                row["share_of_limit"] = round(row["laneserve_graphs_tok_s"] / limit, 3)
            print(json.dumps(row), flush=True)
    if args.profile_dir:
        one = prompts(1, args.prompt_len, VOCAB)
        laneserve_run(model, args.dtype, one, args.max_tokens, False, profile_dir=args.profile_dir)
        print(report([args.profile_dir], max_rows=0), flush=True)


def _peak_bandwidth() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in HBM_GBPS.items() if k in name), None)


if __name__ == "__main__":
    main()
