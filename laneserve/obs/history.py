"""The dashboard's history: one JSON point every few seconds in an SQLite file.

One file can hold several servers' histories (each keyed by its address), so the
default file under the cache dir serves every `laneserve serve` on the machine, and a
server that restarts on the same address finds its past. Rows older than the retention
are deleted as new ones arrive. Every call may block on the disk: the server calls
these from a worker thread, never on its event loop. The connection is shared by those
threads behind a lock (sqlite3 objects are not safe to use from two threads at once).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

from laneserve.paths import cache_root

MAX_PAGE = 5000  # most points in one answer
_PRUNE_EVERY = 12  # writes between two retention sweeps


def default_path() -> Path:
    return cache_root() / "dashboard" / "history.sqlite3"


class HistoryStore:
    def __init__(self, path: str | Path, server: str, retention_s: float) -> None:
        if retention_s <= 0:
            raise ValueError(f"the history retention must be > 0, got {retention_s}")
        self.path = Path(path)
        self.server = server
        self.retention_s = retention_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=10.0, check_same_thread=False)
        self._writes = 0
        self._closed = False
        with self._lock, self._db:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS samples ("
                " server TEXT NOT NULL, t REAL NOT NULL, data TEXT NOT NULL,"
                " PRIMARY KEY (server, t))"
            )

    def add(self, point: dict) -> None:
        """Store one point (its "t": seconds since the epoch); prune now and then."""
        t = float(point["t"])
        with self._lock:
            if self._closed:  # NOTE: a write that was queued when the server stopped
                return
            self._insert(t, point)

    def _insert(self, t: float, point: dict) -> None:
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO samples (server, t, data) VALUES (?, ?, ?)",
                (self.server, t, json.dumps(point, separators=(",", ":"))),
            )
            self._writes += 1
            if self._writes % _PRUNE_EVERY == 1:
                self._prune(t)

    def prune(self, now: float) -> int:
        """Delete every server's rows older than the retention; how many went."""
        with self._lock, self._db:
            return self._prune(now)

    def _prune(self, now: float) -> int:
        cur = self._db.execute("DELETE FROM samples WHERE t < ?", (now - self.retention_s,))
        return cur.rowcount

    def page(
        self, since: float, limit: int, until: float | None = None
    ) -> tuple[list[dict], float | None]:
        """Points with since < t (<= until), oldest first, at most `limit`; and the
        `since` of the next page, or None when this one is the last."""
        limit = max(1, min(limit, MAX_PAGE))
        query = "SELECT t, data FROM samples WHERE server = ? AND t > ?"
        args: list = [self.server, since]
        if until is not None:
            query += " AND t <= ?"
            args.append(until)
        query += " ORDER BY t LIMIT ?"
        args.append(limit + 1)  # NOTE: one more tells whether a next page exists
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        more = len(rows) > limit
        rows = rows[:limit]
        points = [json.loads(data) for _, data in rows]
        return points, (rows[-1][0] if more else None)

    def count(self) -> int:
        with self._lock:
            return self._db.execute(
                "SELECT COUNT(*) FROM samples WHERE server = ?", (self.server,)
            ).fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._db.close()
