"""A real `laneserve serve` process on loopback (tiny model, worker process)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    model: str
    api_key: str | None = None

    def client(self):
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0
        )

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = s.value
        return out

    def post(self, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
        auth = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.post(
            f"{self.url}{path}", json=body, headers={**auth, **(headers or {})}, timeout=120
        )

    def greedy(self, prompt: str = "The old lighthouse stood at the end") -> str:
        """A normal greedy request: its text must not change across faults."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        r = self.post("/v1/completions", {**body, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 120.0) -> None:
    """Poll until `condition` holds. The limit is a generous bound for a hang, not
    a timing claim: tests phrase what they wait for as an event."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for: {what}")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, *extra: str, name: str = "tiny", port: int | None = None) -> Server:
    port = port or free_port()
    cmd = [
        sys.executable, "-m", "laneserve.entrypoints.cli", "serve", "--model", str(model),
        "--dtype", "float32", "--port", str(port), "--served-model-name", name, "--max-model-len", "256", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                key = extra[extra.index("--api-key") + 1] if "--api-key" in extra else None
                return Server(url, proc, name, key)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()


# Flag sets of the servers that several modules share (see `shared_server`).
# LIMITED: small body and --max-n limits (test_hardening, test_fuzz); refuses a
# request's own chat template, as test_hardening checks.
LIMIT_BYTES = 10_000
MAX_N = 4
LIMITED = ("--max-request-bytes", str(LIMIT_BYTES), "--max-n", str(MAX_N))
# VLLM_STYLE: a vLLM-style launch line (flags from vLLM's docs and scripts), two served
# names, a request's own chat template trusted (test_vllm_launch, test_request_fields,
# test_isolation, test_fuzz_structured).
MAX_LOGPROBS = 3
MAX_NUM_SEQS = 16
VLLM_STYLE = (
    "--disable-log-stats", "--disable-log-requests", "--enable-chunked-prefill",
    "--swap-space", "16", "--kv-cache-dtype", "auto", "--max-logprobs", str(MAX_LOGPROBS),
    "--load-format", "safetensors", "--max-num-seqs", str(MAX_NUM_SEQS), "--trust-remote-code",
    "--served-model-name", "tiny", "alias-b", "--uvicorn-log-level", "error",
    "--tensor-parallel-size", "1", "--trust-request-chat-template",
)  # fmt: skip
# QWEN2: the qwen2 checkpoint with room for many concurrent constrained requests
# (test_structured_output, test_responses_api).
QWEN2 = ("--max-num-seqs", "32")


@pytest.fixture(scope="session")
def shared_server(tiny_models: dict[str, Path]) -> Iterator[Callable[..., Server]]:
    """`shared_server(family, *flags)`: one server per (tiny model, flag set) for the
    whole session, started on first use (a start costs two interpreters, a model load
    and the kernel library). Safe because every module that shares one takes its
    reference texts on the server it gets, reads gauges that return to 0 when idle (no
    counter totals) and leaves the server serving: each ends by checking that it does."""
    started: dict[tuple[str, ...], Server] = {}

    def get(family: str, *flags: str) -> Server:
        key = (family, *flags)
        if key not in started:
            started[key] = start_server(tiny_models[family], *flags)
        assert started[key].proc.poll() is None, f"the shared server {key} exited"
        return started[key]

    yield get
    for s in started.values():
        stop_server(s)


@pytest.fixture(scope="session")
def server(tiny_models: dict[str, Path]) -> Iterator[Server]:
    """One server for every module without flags of its own (a start costs two
    interpreters and a model load); modules that break it start their own. test_faults
    kills its worker once: the server restarts it and must then serve the same text,
    so the modules after it see a restarted worker; every module reads counters as
    differences."""
    s = start_server(tiny_models["llama"], "--max-queued-requests", "64")
    yield s
    stop_server(s)
