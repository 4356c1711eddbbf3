"""`laneserve bench serve`: load any OpenAI-compatible server (ours, vLLM's) and
report latency and throughput with vLLM `bench serve`'s definitions:

- TTFT: request start -> first streamed chunk that carries choices
- ITL: gaps between successive such chunks
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request
- E2EL: request start -> end of the stream
- output tokens: the server's `usage.completion_tokens` (include_usage)
- throughput: completed requests and output tokens per second of wall time
Closed loop with `--max-concurrency`, open loop with `--request-rate` (Poisson;
inf = all at once). Prompts are random token ids of exactly `--input-len`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load an OpenAI-compatible server; TTFT/TPOT/ITL/E2EL")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    p.add_argument(
        "--endpoint", default=None, help="default: /v1/completions (or chat with --chat)"
    )
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests to send")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight (default: no limit)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (inf: all at once)",
    )
    p.add_argument("--input-len", type=int, default=200, help="random prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--vocab-low", type=int, default=1000, help="lowest random prompt token id")
    p.add_argument("--vocab-high", type=int, default=40000, help="random prompt token ids below")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate --output-len tokens whatever the model says",
    )
    p.add_argument("--num-warmups", type=int, default=1, help="untimed requests first")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.set_defaults(func=run)


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def run(ns: argparse.Namespace) -> int:
    # one INFO line per request from the HTTP client would scroll through the progress bar
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return asyncio.run(_main(ns))


async def _main(ns: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    async with httpx.AsyncClient(
        base_url=ns.base_url, headers=headers, timeout=ns.timeout
    ) as client:
        model = ns.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(ns.seed)
        prompts = [
            [rng.randrange(ns.vocab_low, ns.vocab_high) for _ in range(ns.input_len)]
            for _ in range(ns.num_prompts)
        ]
        for _ in range(ns.num_warmups):
            await _one(client, ns, model, prompts[0])
        limit = asyncio.Semaphore(ns.max_concurrency or ns.num_prompts)
        bar = tqdm(total=ns.num_prompts, desc="requests", file=sys.stderr)

        async def guarded(prompt: list[int]) -> Result:
            async with limit:
                r = await _one(client, ns, model, prompt)
            bar.update(1)
            return r

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(guarded(prompt)))
            if ns.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(ns.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    summary = summarize(results, duration, ns, model)
    _print(summary)
    print(json.dumps(summary))
    return 0 if summary["completed"] == ns.num_prompts else 1


async def _one(client, ns: argparse.Namespace, model: str, prompt: list[int]) -> Result:
    body = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": ns.temperature,
        "ignore_eos": ns.ignore_eos,
    }
    if ns.chat:
        endpoint = ns.endpoint or "/v1/chat/completions"
        body.update(
            messages=[{"role": "user", "content": " ".join(map(str, prompt))}],
            max_completion_tokens=ns.output_len,
        )
    else:
        endpoint = ns.endpoint or "/v1/completions"
        body.update(prompt=prompt, max_tokens=ns.output_len)
    res = Result(ok=False)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                now = time.perf_counter()
                if data.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if data.get("usage"):
                    res.output_tokens = data["usage"].get("completion_tokens", 0)
                    res.prompt_tokens = data["usage"].get("prompt_tokens", 0)
                if "error" in data:
                    res.error = str(data["error"])
                    return res
        res.e2el = time.perf_counter() - start
        res.ok = True
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(values)
    p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
    return {
        "mean": statistics.fmean(s) * scale,
        "median": statistics.median(s) * scale,
        "p99": p99 * scale,
    }


def summarize(results: list[Result], duration: float, ns: argparse.Namespace, model: str) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "bench": "serve",
        "base_url": ns.base_url,
        "model": model,
        "num_prompts": ns.num_prompts,
        "max_concurrency": ns.max_concurrency,
        "request_rate": "inf" if ns.request_rate == float("inf") else ns.request_rate,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.e2el for r in ok]),
    }


def _print(s: dict) -> None:
    lines = [
        f"completed {s['completed']}/{s['num_prompts']} in {s['duration_s']:.2f} s "
        f"(concurrency {s['max_concurrency']}, rate {s['request_rate']})",
        f"output tokens {s['total_output_tokens']}  ->  {s['output_throughput']:.1f} tok/s, "
        f"{s['request_throughput']:.2f} req/s",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        v = s[key]
        lines.append(
            f"{key:8s} mean {v['mean']:9.2f}  median {v['median']:9.2f}  p99 {v['p99']:9.2f}"
        )
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    print("\n".join(lines), file=sys.stderr)
