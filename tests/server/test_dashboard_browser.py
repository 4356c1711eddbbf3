"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright
over its own binary: nothing is downloaded), against `laneserve serve` with the default
model and MTP speculation under a few concurrent requests. The page must log in with the
key, fill its charts with data points (uPlot's data and pixels on the canvases), draw
the lanes timeline, log no console error, and ask nothing of any host but 127.0.0.1.
The screenshot is kept in $LANESERVE_TEST_ARTIFACTS (default: the test's tmp dir).

Skipped, with the reason, when Playwright or the chromium binary is missing
(`apt-get install -y chromium`; .ci/run installs it).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.server.conftest import Server, start_server, stop_server

CHROMIUM = os.environ.get("LANESERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
KEY = "browser-key"
CHARTS = (
    "throughput",
    "requests",
    "cache",
    "ttft",
    "tpot",
    "itl",
    "e2e",
    "spec_accept",
    "spec_len",
)

pytestmark = pytest.mark.slow


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright==1.65.2)"
    if not Path(CHROMIUM).exists():
        return f"no chromium at {CHROMIUM} (apt-get install -y chromium)"
    return None


@pytest.fixture(scope="module")
def loaded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    missing = _browser_missing()
    if missing:
        pytest.skip(f"no browser for the dashboard test: {missing}")
    root = tmp_path_factory.mktemp("browser")
    from laneserve.model.loader import default_model_path

    s = start_server(
        default_model_path(), "--api-key", KEY,
        "--dashboard-history", str(root / "h.sqlite3"), "--dashboard-sample-s", "1",
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}',
        "--max-model-len", "1024", "--dtype", "auto", name="SmolLM2-135M-Instruct",
    )  # fmt: skip
    stop = threading.Event()
    body = {"prompt": "Write a story about a lighthouse.", "max_tokens": 48, "temperature": 0}

    def load(i: int) -> None:
        while not stop.is_set():
            s.post("/v1/completions", {**body, "prompt": f"{body['prompt']} ({i})"})

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    yield s
    stop.set()
    for t in threads:
        t.join(120)
    stop_server(s)


def _artifacts(tmp_path: Path) -> Path:
    out = Path(os.environ.get("LANESERVE_TEST_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_dashboard_in_chromium(loaded_server: Server, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    hosts: list[str] = []
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 2200})

        def guard(route) -> None:  # record every host; let only loopback through
            host = urlparse(route.request.url).hostname or ""
            hosts.append(host)
            route.continue_() if host == "127.0.0.1" else route.abort()

        context.route("**/*", guard)
        page = context.new_page()
        page.goto(f"{loaded_server.url}/dashboard")
        page.fill("input[name=key]", KEY)  # the login form: the page needs the key
        with page.expect_navigation():
            page.click("button[type=submit]")
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.reload()
        for name in CHARTS:  # each chart holds data points (not only "loaded")
            page.wait_for_function(
                f"() => Number(document.getElementById('chart-{name}').dataset.points || 0) > 2",
                timeout=180_000,
            )
        page.wait_for_function(
            "() => Number(document.getElementById('lanes').dataset.steps || 0) > 2", timeout=60_000
        )
        stats = page.evaluate(
            """() => {
              const d = window.laneserveDashboard;
              const out = {};
              for (const [name, u] of Object.entries(d.charts)) {
                out[name] = {x: u.data[0].length, nonNull: u.data.slice(1).flat().filter(v => v != null).length};
              }
              const inked = (canvas) => {
                const px = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
                let n = 0;
                for (let i = 3; i < px.length; i += 4) if (px[i] > 0) n++;
                return n;
              };
              out.throughputInk = inked(document.querySelector('#chart-throughput canvas'));
              out.lanesInk = inked(document.getElementById('lanes'));
              out.model = document.getElementById('model').textContent;
              out.groups = document.querySelectorAll('#info-groups tr').length;
              return out;
            }"""
        )
        page.screenshot(path=str(_artifacts(tmp_path) / "dashboard.png"), full_page=True)
        browser.close()
    for name in CHARTS:
        assert stats[name]["x"] > 2 and stats[name]["nonNull"] > 2, (name, stats[name])
    assert stats["throughputInk"] > 500 and stats["lanesInk"] > 500, stats
    assert stats["model"] == "SmolLM2-135M-Instruct" and stats["groups"] >= 2
    assert not errors, errors
    assert hosts and set(hosts) == {"127.0.0.1"}, sorted(set(hosts))
