"""The dashboard's static files: the vendored uPlot is the pinned release (the hashes
docs/dashboard.md gives), its license ships with it, and the page refers only to its own
server's paths (the browser test checks the requests themselves)."""

from __future__ import annotations

import hashlib
import re

from laneserve.entrypoints.dashboard import STATIC

PINNED = {
    "uPlot.iife.min.js": "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f",
    "uPlot.min.css": "df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04",
}


def test_vendored_uplot_is_the_pinned_release() -> None:
    vendor = STATIC / "vendor" / "uplot"
    for name, digest in PINNED.items():
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
    assert "MIT License" in (vendor / "LICENSE").read_text()


def test_page_refers_only_to_its_own_paths() -> None:
    page = (STATIC / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert refs and all(r.startswith("/dashboard/static/") or r == "data:," for r in refs), refs
    script = (STATIC / "dashboard.js").read_text()
    assert "http://" not in script and "https://" not in script
    assert set(re.findall(r'"(/dashboard/[a-z]+)', script)) == {
        "/dashboard/data",
        "/dashboard/history",
    }
