"""`laneserve profile merge`: the engine's and the worker's traces as one timeline.

Each process writes its own file; Perfetto opens one file at a time. Merging
keeps every span and thread name, and names each process once: an engine and
an in-process worker share a pid (their lanes have distinct thread ids, see
`profiling.py`), so the process is named after both roles.
"""

from __future__ import annotations

import json
from pathlib import Path

from laneserve.obs.trace_analysis import trace_files


def merge_traces(paths: list[str | Path]) -> dict:
    """One Chrome trace holding every event of the files (or directories) given."""
    spans: list[dict] = []
    threads: dict[tuple[int, int], str] = {}
    roles: dict[int, list[str]] = {}
    for f in trace_files(paths):
        for e in json.loads(f.read_text())["traceEvents"]:
            if e.get("ph") != "M":
                spans.append(e)
            elif e["name"] == "thread_name":
                _name_thread(threads, e)
            elif e["name"] == "process_name":
                names = roles.setdefault(e["pid"], [])
                if e["args"]["name"] not in names:
                    names.append(e["args"]["name"])
    meta = [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        for (pid, tid), name in sorted(threads.items())
    ] + [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": " + ".join(names)}}
        for pid, names in sorted(roles.items())
    ]
    spans.sort(key=lambda e: e.get("ts", 0.0))
    return {"traceEvents": meta + spans, "displayTimeUnit": "ms"}


def _name_thread(threads: dict[tuple[int, int], str], event: dict) -> None:
    key = (event["pid"], event["tid"])
    name = event["args"]["name"]
    if threads.setdefault(key, name) != name:
        raise ValueError(f"thread {key} is named both {threads[key]!r} and {name!r}")


def write_merged(paths: list[str | Path], out: str | Path) -> Path:
    out = Path(out)
    data = merge_traces(paths)
    if not data["traceEvents"]:
        raise ValueError(f"no trace events found in {[str(p) for p in paths]}")
    out.write_text(json.dumps(data))
    return out
