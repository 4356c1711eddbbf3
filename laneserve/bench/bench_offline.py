"""`laneserve bench offline`: laneserve vs HF transformers `generate` (and vLLM's
CPU build where it is installed), one run.

The workload is the peers' (shared/peers/workload.py): prompts are token-id
windows of a fixed English corpus, every sequence of a case the same length
(12 or 200 tokens), 128 new tokens, greedy, EOS ignored. For each batch size
both engines run the same prompts; the table prints output tokens/s and the
ratio laneserve / peer. Progress goes to stderr, one JSON line to stdout.

The `vllm` peer runs `peer_vllm.py` under the interpreter given by
`--vllm-python` (vLLM lives in its own environment) on the same converted
checkpoint directory, the same token-id prompts and the same settings
(bf16, greedy, EOS ignored, prefix caching off).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from laneserve.bench.workload import NEW_TOKENS, corpus_ids, prompt_token_ids

PEERS = ("hf", "hf-fp32", "vllm", "vllm-fp32")


def add_parser(sub: argparse._SubParsersAction) -> None:
    from laneserve.engine_args import EngineArgs

    p = sub.add_parser(
        "offline", help="offline throughput vs HF transformers (same prompts, one run)"
    )
    p.add_argument("--batches", default="1,8,32", help="comma list of batch sizes")
    p.add_argument(
        "--cases", default="short", help="comma list of prompt cases: short (12 tokens), long (200)"
    )
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens per request")
    p.add_argument(
        "--repeats", type=int, default=1, help="timed runs per case and batch (the median counts)"
    )
    p.add_argument("--peers", default="hf", help="comma list: hf, hf-fp32, vllm, vllm-fp32, none")
    p.add_argument("--hf-dtype", default="bfloat16", help="dtype of the hf peer")
    p.add_argument("--vllm-python", default=None, help="python of an environment with vLLM")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from laneserve import LLM, SamplingParams
    from laneserve.engine_args import EngineArgs

    batches = [int(b) for b in ns.batches.split(",")]
    cases = ns.cases.split(",")
    peers = [p for p in ns.peers.split(",") if p and p != "none"]
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peers {sorted(unknown)}: choose from {', '.join(PEERS)}, none")
    if any(p.startswith("vllm") for p in peers) and not ns.vllm_python:
        raise ValueError("--peers vllm needs --vllm-python PATH (the python of vLLM's environment)")
    if any(p.startswith("vllm") for p in peers):
        check_vllm_python(ns.vllm_python)  # NOTE: before the laneserve and HF runs
    args = EngineArgs.from_cli(ns)
    args.enable_prefix_caching = False  # repeats must not hit the cache
    args.max_num_seqs = max(args.max_num_seqs, max(batches))
    llm = LLM(**vars(args))
    tok = llm.get_tokenizer()
    ids = corpus_ids(tok)
    params = SamplingParams(temperature=0, max_tokens=ns.new_tokens, ignore_eos=True)
    rows = []
    jobs = [(c, b) for c in cases for b in batches]
    for case, bs in tqdm(jobs, desc="laneserve", file=sys.stderr):
        prompts = [{"prompt_token_ids": p} for p in prompt_token_ids(ids, case, bs)]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        times = []
        for _ in range(ns.repeats):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
            assert all(len(o.outputs[0].token_ids) == ns.new_tokens for o in outs)
        e2e = statistics.median(times)
        rows.append(
            {
                "engine": "laneserve",
                "case": case,
                "batch": bs,
                "e2e_s": round(e2e, 3),
                "output_tok_s": round(bs * ns.new_tokens / e2e, 1),
                "first_tokens_seq0": outs[0].outputs[0].token_ids[:12],
            }
        )
    model_dir = str(llm.engine.model_dir)
    stats = llm.get_stats()
    llm.shutdown()
    del llm
    for peer in peers:
        dtype = "float32" if peer.endswith("-fp32") else ns.hf_dtype
        if peer.startswith("vllm"):
            vllm = (ns.vllm_python, peer, dtype)
            rows += _run_vllm(vllm, model_dir, jobs, ids, ns.new_tokens, ns.repeats)
        else:
            rows += _run_hf(model_dir, dtype, jobs, ids, ns.new_tokens, ns.repeats, peer)
    _print_table(rows, peers)
    print(json.dumps({"bench": "offline", "rows": rows, "laneserve_stats": stats}))
    return 0


def _run_hf(
    model_dir: str, dtype: str, jobs: list, ids: list[int], n: int, repeats: int, name: str
) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=2)
    rows = []
    for case, bs in tqdm(jobs, desc=name, file=sys.stderr):
        x = torch.tensor(prompt_token_ids(ids, case, bs))
        with torch.inference_mode():
            model.generate(
                x[:1],
                attention_mask=torch.ones_like(x[:1]),
                generation_config=GenerationConfig(
                    do_sample=False, max_new_tokens=4, pad_token_id=2
                ),
            )
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
                times.append(time.perf_counter() - t)
        e2e = statistics.median(times)
        rows.append(
            {
                "engine": name,
                "dtype": dtype,
                "case": case,
                "batch": bs,
                "e2e_s": round(e2e, 3),
                "output_tok_s": round(bs * n / e2e, 1),
                "first_tokens_seq0": out[0, x.shape[1] : x.shape[1] + 12].tolist(),
            }
        )
    return rows


def check_vllm_python(python: str) -> None:
    """Refuse a --vllm-python that is no runnable interpreter with vLLM installed (found
    without importing it, so the check takes a moment, not vLLM's start-up)."""
    path = shutil.which(python) or python
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise ValueError(f"--vllm-python {python!r} is not an executable file")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        proc = subprocess.run([path, "-c", probe], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"--vllm-python {python!r} does not run: {e}") from None
    if proc.returncode != 0:
        raise ValueError(
            f"--vllm-python {python!r} has no vllm package (exit code {proc.returncode}); "
            "give the python of the environment where vLLM is installed"
        )


def _run_vllm(
    vllm: tuple[str, str, str], model_dir: str, jobs: list, ids: list[int], n: int, repeats: int
) -> list[dict]:
    python, name, dtype = vllm
    script = Path(__file__).with_name("peer_vllm.py")
    job = {
        "name": name,
        "dtype": dtype,
        "model": model_dir,
        "new_tokens": n,
        "repeats": repeats,
        "max_model_len": 512,
        "jobs": [{"case": c, "batch": b, "prompts": prompt_token_ids(ids, c, b)} for c, b in jobs],
    }
    print(f"vllm: {python} {script.name} ({len(jobs)} cases)", file=sys.stderr)
    proc = subprocess.run(
        [python, str(script)], input=json.dumps(job), stdout=subprocess.PIPE, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the vLLM peer failed (exit code {proc.returncode}); see its log above")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _print_table(rows: list[dict], peers: list[str]) -> None:
    ours = {(r["case"], r["batch"]): r for r in rows if r["engine"] == "laneserve"}
    head = "| case | batch | laneserve tok/s |" + "".join(
        f" {p} tok/s | ratio vs {p} |" for p in peers
    )
    print(head, file=sys.stderr)
    print("|" + "---|" * (3 + 2 * len(peers)), file=sys.stderr)
    for (case, bs), r in ours.items():
        line = f"| {case} | {bs} | {r['output_tok_s']} |"
        for p in peers:
            peer = next(
                (x for x in rows if x["engine"] == p and x["case"] == case and x["batch"] == bs),
                None,
            )
            if peer:
                line += (
                    f" {peer['output_tok_s']} | {r['output_tok_s'] / peer['output_tok_s']:.2f}x |"
                )
        print(line, file=sys.stderr)
