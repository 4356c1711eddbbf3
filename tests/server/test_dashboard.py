"""`/dashboard` on a real `laneserve serve` (tiny model, worker process): the key guards
the page and its data (header or login cookie, never the API), the data and history
endpoints answer and page, bad parameters are a 400, the history survives a restart,
`--no-dashboard` removes it, and the lanes timeline is the trace's spans."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, free_port, start_server, stop_server, wait_for

KEY = "dash-key"
AUTH = {"authorization": f"Bearer {KEY}"}


def _load(server: Server, n: int = 6) -> None:
    """A few concurrent greedy requests, so that steps, tokens and latencies exist."""
    body = {"model": server.model, "prompt": "The river", "max_tokens": 16, "ignore_eos": True}
    threads = [
        threading.Thread(target=server.post, args=("/v1/completions", body)) for _ in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _data(server: Server, since: float = 0) -> dict:
    r = httpx.get(f"{server.url}/dashboard/data", params={"since": since}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def dash(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("dash")
    s = start_server(
        tiny_models["llama"], "--api-key", KEY, "--dashboard-history", str(root / "h.sqlite3"),
        "--dashboard-sample-s", "1",
    )  # fmt: skip
    _load(s)
    yield s
    stop_server(s)


def test_key_guards_page_and_data_not_the_api(dash: Server) -> None:
    page = httpx.get(f"{dash.url}/dashboard")
    assert page.status_code == 401 and 'action="/dashboard/login"' in page.text
    assert "uPlot" not in page.text and "chart-" not in page.text  # the form only
    for path in ("/dashboard/data", "/dashboard/history", "/dashboard/static/dashboard.js"):
        r = httpx.get(f"{dash.url}{path}")
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", path
    assert (
        httpx.get(f"{dash.url}/dashboard/data", headers={"authorization": "Bearer no"}).status_code
        == 401
    )
    wrong = httpx.post(f"{dash.url}/dashboard/login", data={"key": "nope"})
    assert wrong.status_code == 401 and "not right" in wrong.text
    ok = httpx.post(f"{dash.url}/dashboard/login", data={"key": KEY})
    assert ok.status_code == 303 and ok.headers["location"] == "/dashboard"
    cookie = ok.cookies["laneserve_dashboard"]
    assert KEY not in cookie
    assert "httponly" in ok.headers["set-cookie"].lower()
    jar = {"laneserve_dashboard": cookie}
    with httpx.Client(cookies=jar) as c:
        page = c.get(f"{dash.url}/dashboard")
        assert page.status_code == 200 and "chart-throughput" in page.text
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert c.get(f"{dash.url}/dashboard/static/dashboard.js").status_code == 200
        assert c.get(f"{dash.url}/dashboard/data").status_code == 200
        assert c.get(f"{dash.url}/v1/models").status_code == 401  # the cookie opens no API
    forged = httpx.get(f"{dash.url}/dashboard/data", cookies={"laneserve_dashboard": "0" * 64})
    assert forged.status_code == 401
    huge = httpx.post(f"{dash.url}/dashboard/login", content=b"key=" + b"x" * 10000)
    assert huge.status_code == 401


def test_data_has_the_run(dash: Server) -> None:
    _load(dash)  # NOTE: fresh latencies: the module's first load may be past the 60 s window
    wait_for(
        lambda: any((p["gen_tps"] or 0) > 0 for p in _data(dash)["points"]), "a point with tokens"
    )
    d = _data(dash)
    info = d["info"]
    assert info["ready"] and info["model"] == "tiny" and info["flags"]["api_key"] == "(set)"
    assert KEY not in json.dumps(info)
    assert info["cache_groups"] and info["cache_groups"][0]["kind"] == "full_attention"
    last = d["points"][-1]
    assert last["ttft"][0] is not None and last["e2e"][2] >= last["e2e"][0]
    assert len(d["lanes"]) > 1 and all(
        r["prepare"][0] <= r["prepare"][1] <= r["device"][1] <= r["output"][1] for r in d["lanes"]
    )
    later = _data(dash, since=d["points"][-1]["t"])
    assert all(p["t"] > d["points"][-1]["t"] for p in later["points"])


def test_history_pages_and_rejects_bad_params(dash: Server) -> None:
    def page(**params) -> httpx.Response:
        return httpx.get(f"{dash.url}/dashboard/history", params=params, headers=AUTH)

    wait_for(lambda: len(page(since=0).json()["points"]) >= 3, "three history samples", 60)
    everything = page(since=0, limit=5000).json()
    assert everything["next"] is None
    seen, since = [], 0.0
    while True:
        d = page(since=since, limit=2).json()
        assert len(d["points"]) <= 2
        seen += [p["t"] for p in d["points"]]
        if d["next"] is None:
            break
        since = d["next"]
    want = [p["t"] for p in everything["points"]]
    assert seen[: len(want)] == want and seen == sorted(set(seen))
    for bad in (
        {"since": "soon"},
        {"since": "nan"},
        {"limit": "0"},
        {"limit": "2.5"},
        {"limit": "9999999"},
    ):
        r = page(**bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, bad


@pytest.mark.slow
def test_history_survives_restart_and_lanes_match_trace(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    port, db, traces = free_port(), tmp_path / "h.sqlite3", tmp_path / "traces"
    args = ("--dashboard-history", str(db), "--dashboard-sample-s", "1")
    first = start_server(tiny_models["llama"], *args, "--profile-dir", str(traces), port=port)
    try:
        _load(first)
        wait_for(lambda: len(_history(first)) >= 2, "history samples")
        lanes = _data(first)["lanes"]
        before = _history(first)
    finally:
        stop_server(first)
    _check_lanes_against_trace(lanes, traces)
    second = start_server(tiny_models["llama"], *args, port=port)
    try:
        after = _history(second)
        assert [p["t"] for p in after[: len(before)]] == [p["t"] for p in before]
    finally:
        stop_server(second)
    off = start_server(tiny_models["llama"], "--no-dashboard")
    try:
        assert httpx.get(f"{off.url}/dashboard").status_code == 404
        assert httpx.get(f"{off.url}/dashboard/data").status_code == 404
    finally:
        stop_server(off)


def _history(server: Server) -> list[dict]:
    return httpx.get(f"{server.url}/dashboard/history", params={"since": 0}).json()["points"]


def _check_lanes_against_trace(lanes: list[dict], traces: Path) -> None:
    """Every step on the timeline has the trace's prepare / device / reclaim spans:
    the same start and duration, in the trace's microseconds."""
    files = list(traces.glob("trace-worker-*.json"))
    assert files, "the worker wrote no trace"
    events = json.loads(files[0].read_text())["traceEvents"]
    spans = {
        (e["name"], e["args"]["step"]): (e["ts"], e["dur"])
        for e in events
        if e.get("ph") == "X" and "step" in e.get("args", {})
    }
    assert len(lanes) > 1
    for row in lanes:
        for lane, name in (("prepare", "prepare"), ("device", "device"), ("output", "reclaim")):
            ts, dur = spans[(name, row["step"])]
            start, end = row[lane]
            assert start == pytest.approx(ts, abs=1e-3) and end - start == pytest.approx(
                dur, abs=1e-3
            )
    gaps = [r["gap_us"] for r in lanes if r["gap_us"] is not None]
    assert gaps and all(g >= 0 for g in gaps)


def test_bad_dashboard_flags_fail_fast(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    import argparse
    import subprocess
    import sys

    from laneserve.entrypoints import serve
    from laneserve.entrypoints.dashboard_flags import DashboardOptions

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    for extra, message in (
        (["--dashboard-retention-h", "0"], "--dashboard-retention-h must be > 0"),
        (["--dashboard-steps", "0"], "--dashboard-steps must be in"),
        (["--dashboard-steps", "513"], "--dashboard-steps must be in"),
        (["--dashboard-sample-s", "0.5"], "--dashboard-sample-s must be in"),
    ):
        with pytest.raises(ValueError, match=message):
            DashboardOptions.from_cli(parser.parse_args(["serve", *extra]))
    ok = DashboardOptions.from_cli(parser.parse_args(["serve", "--dashboard-history", "x.db"]))
    assert ok.history == Path("x.db") and ok.retention_s == 48 * 3600 and ok.steps == 64
    assert parser.parse_args(["serve", "--no-dashboard"]).dashboard is False
    # a history file that is not a database: the server refuses to start, with the reason
    bad_db = tmp_path / "bad.sqlite3"
    bad_db.write_bytes(b"not an sqlite database at all" * 100)
    proc = subprocess.run(
        [sys.executable, "-m", "laneserve.entrypoints.cli", "serve", "--model",
         str(tiny_models["llama"]), "--port", str(free_port()), "--dashboard-history", str(bad_db)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "the dashboard history" in proc.stdout, (
        proc.stdout + proc.stderr
    )
