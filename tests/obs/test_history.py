"""The dashboard history file: survives a reopen, prunes past its retention, pages in
order without a point twice or missing, and keeps servers apart."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from laneserve.obs.history import MAX_PAGE, HistoryStore


def _fill(store: HistoryStore, times: list[float]) -> None:
    for t in times:
        store.add({"t": t, "gen_tps": t * 2})


def test_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "h.sqlite3"
    store = HistoryStore(path, "127.0.0.1:1", retention_s=3600)
    _fill(store, [1000.0, 1005.0])
    store.close()
    again = HistoryStore(path, "127.0.0.1:1", retention_s=3600)
    points, nxt = again.page(0, 10)
    assert [p["t"] for p in points] == [1000.0, 1005.0] and nxt is None
    assert points[1]["gen_tps"] == 2010.0
    again.close()
    again.add({"t": 1010.0})  # a write queued behind the close is dropped, not an error


def test_retention_prunes(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3", "a", retention_s=100)
    _fill(store, [0.0, 50.0, 120.0, 150.0])
    assert store.count() == 4  # the first write swept (nothing old yet), later ones wait
    assert store.prune(now=160.0) == 2  # 0 and 50 are older than 160 - 100
    assert [p["t"] for p in store.page(-1, 10)[0]] == [120.0, 150.0]
    store.close()


def test_writes_sweep_old_rows(tmp_path: Path) -> None:
    """A sweep runs every few writes on its own, so the file stays bounded."""
    store = HistoryStore(tmp_path / "h.sqlite3", "a", retention_s=10)
    _fill(store, [float(t) for t in range(100)])
    assert store.count() < 40  # without sweeps: 100
    store.close()


def test_pages_in_order(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3", "a", retention_s=1e9)
    times = [1000.0 + 5 * i for i in range(23)]
    _fill(store, times)
    seen, since, pages = [], 0.0, 0
    while True:
        points, nxt = store.page(since, 5)
        pages += 1
        seen += [p["t"] for p in points]
        if nxt is None:
            break
        assert nxt == points[-1]["t"]
        since = nxt
    assert seen == times and pages == 5
    # until bounds the page; an exact multiple has no empty trailing page
    points, nxt = store.page(0, 5, until=1020.0)
    assert [p["t"] for p in points] == times[:5] and nxt is None
    assert store.page(times[-1], 5) == ([], None)
    store.close()


def test_limit_is_bounded_and_servers_apart(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    a, b = HistoryStore(path, "a", 1e9), HistoryStore(path, "b", 1e9)
    _fill(a, [1.0, 2.0])
    _fill(b, [3.0])
    assert [p["t"] for p in a.page(0, MAX_PAGE * 10)[0]] == [1.0, 2.0]
    assert [p["t"] for p in b.page(0, 0)[0]] == [3.0]  # NOTE: a limit below 1 reads 1
    a.close()
    b.close()


def test_bad_retention_and_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="retention"):
        HistoryStore(tmp_path / "h.sqlite3", "a", 0)
    bad = tmp_path / "not-a-db"
    bad.write_bytes(b"this is not an sqlite file, not at all" * 100)
    with pytest.raises(sqlite3.DatabaseError):
        HistoryStore(bad, "a", 10)
