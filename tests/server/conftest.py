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


@pytest.fixture(scope="session")
def server(tiny_models: dict[str, Path]) -> Iterator[Server]:
    """One server for every module without flags of its own (a start costs two
    interpreters and a model load); modules that break it start their own."""
    s = start_server(tiny_models["llama"], "--max-queued-requests", "64")
    yield s
    stop_server(s)
