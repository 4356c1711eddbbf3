"""`laneserve profile analyze TRACE...`: device spans, exposed host gaps, overlap.

For consecutive device invocations N and N+1 the *exposed host gap* is
start(device N+1) - end(device N): time the device sat idle waiting for host
work. *Overlapped* means prepare(N+1) had finished before device(N) ended.
Only pairs of decode steps (no prefill rows) enter the summary.

With several ranks (one trace file each) every rank gets its own summary, and the
*critical rank* of a step pair is the one with the largest host gap: the ranks meet in
the forward's collectives, so the others wait for it inside their device spans and its
gap is the one the whole group pays. Gaps are measured within each rank's process, so
the comparison holds across machines whose clocks differ.
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass
class StepSpans:
    step: int
    decode: bool
    device_start: float = 0.0  # µs
    device_end: float = 0.0
    prepare_end: float | None = None


@dataclass
class Summary:
    num_pairs: int
    mean_device_us: float
    median_device_us: float
    mean_gap_us: float
    median_gap_us: float
    overlapped: int

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def trace_files(paths: list[str | Path]) -> list[Path]:
    """The trace files named, or found in the --profile-dir directories named."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("trace-*.json")) if p.is_dir() else [p]
    return files


def load_events(paths: list[str | Path]) -> list[dict]:
    events = []
    for f in trace_files(paths):
        events += [e for e in json.loads(f.read_text())["traceEvents"] if e.get("ph") == "X"]
    return events


def rank_of(role: str) -> int | None:
    """The worker rank a trace role names ("worker": 0, "worker-rank3": 3), else None."""
    if role == "worker":
        return 0
    head, _, rank = role.partition("-rank")
    return int(rank) if head == "worker" and rank.isdigit() else None


def rank_events(paths: list[str | Path]) -> dict[int, list[dict]]:
    """The spans of each worker rank's trace files (engine files left out)."""
    out: dict[int, list[dict]] = {}
    for f in trace_files(paths):
        events = json.loads(f.read_text())["traceEvents"]
        roles = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
        rank = rank_of(roles[0]) if roles else None
        if rank is not None:
            out.setdefault(rank, []).extend(e for e in events if e.get("ph") == "X")
    return out


def step_spans(events: list[dict]) -> list[StepSpans]:
    steps: dict[int, StepSpans] = {}
    for e in events:
        step = e.get("args", {}).get("step")
        if step is None:
            continue
        s = steps.setdefault(step, StepSpans(step, False))
        if e["name"] == "device":
            s.device_start, s.device_end = e["ts"], e["ts"] + e["dur"]
            s.decode = bool(e["args"].get("decode", False))
        elif e["name"] == "prepare":
            s.prepare_end = e["ts"] + e["dur"]
    return sorted((s for s in steps.values() if s.device_end), key=lambda s: s.device_start)


def pairs(steps: list[StepSpans]) -> list[tuple[StepSpans, StepSpans, float, bool]]:
    out = []
    for a, b in itertools.pairwise(steps):
        if not (a.decode and b.decode):
            continue
        gap = max(0.0, b.device_start - a.device_end)
        overlapped = b.prepare_end is not None and b.prepare_end <= a.device_end
        out.append((a, b, gap, overlapped))
    return out


def summarize(steps: list[StepSpans]) -> Summary | None:
    ps = pairs(steps)
    if not ps:
        return None
    dev = [a.device_end - a.device_start for a, _, _, _ in ps]
    gaps = [g for _, _, g, _ in ps]
    return Summary(
        num_pairs=len(ps),
        mean_device_us=statistics.fmean(dev),
        median_device_us=statistics.median(dev),
        mean_gap_us=statistics.fmean(gaps),
        median_gap_us=statistics.median(gaps),
        overlapped=sum(1 for *_, o in ps if o),
    )


@dataclass
class CriticalRank:
    num_pairs: int
    mean_gap_us: float  # the critical rank's gap, averaged over the step pairs
    median_gap_us: float
    times_critical: dict[int, int]  # rank -> step pairs where it was the critical one


def critical_rank(per_rank: dict[int, list[StepSpans]]) -> CriticalRank | None:
    """Over the decode step pairs every rank ran: whose gap was the largest, and how large."""
    gaps: dict[int, dict[int, float]] = {
        rank: {b.step: gap for _, b, gap, _ in pairs(steps)} for rank, steps in per_rank.items()
    }
    common = set.intersection(*(set(g) for g in gaps.values())) if gaps else set()
    if not common:
        return None
    worst: list[float] = []
    times = dict.fromkeys(sorted(gaps), 0)
    for step in sorted(common):
        rank = max(sorted(gaps), key=lambda r: gaps[r][step])
        times[rank] += 1
        worst.append(gaps[rank][step])
    return CriticalRank(len(common), statistics.fmean(worst), statistics.median(worst), times)


def report(paths: list[str | Path], max_rows: int = 20) -> str:
    per_rank = {r: step_spans(ev) for r, ev in sorted(rank_events(paths).items())}
    if len(per_rank) > 1:
        return _ranks_report(per_rank)
    steps = step_spans(load_events(paths))
    lines = ["step  device_ms  gap_us  prepare(N+1)<=end(device N)"]
    ps = pairs(steps)
    for a, b, gap, overlapped in ps[:max_rows]:
        lines.append(
            f"{b.step:5d}  {(a.device_end - a.device_start) / 1000:9.2f}  {gap:6.0f}  {'yes' if overlapped else 'no'}"
        )
    if len(ps) > max_rows:
        lines.append(f"... {len(ps) - max_rows} more decode steps")
    s = summarize(steps)
    if s is None:
        lines.append("no consecutive decode steps in the trace")
    else:
        lines.append("summary: " + _summary_line(s))
    return "\n".join(lines)


def _summary_line(s: Summary) -> str:
    return (
        f"{s.num_pairs} decode step pairs, device mean {s.mean_device_us / 1000:.2f} ms "
        f"(median {s.median_device_us / 1000:.2f}), exposed gap mean {s.mean_gap_us:.0f} us "
        f"(median {s.median_gap_us:.0f}), overlapped {s.overlapped}/{s.num_pairs}"
    )


def _ranks_report(per_rank: dict[int, list[StepSpans]]) -> str:
    lines = []
    for rank, steps in per_rank.items():
        s = summarize(steps)
        lines.append(f"rank {rank}: " + (_summary_line(s) if s else "no consecutive decode steps"))
    c = critical_rank(per_rank)
    if c is None:
        lines.append("critical rank: no decode step pair that every rank ran")
    else:
        counts = ", ".join(f"rank {r} in {n}" for r, n in c.times_critical.items())
        lines.append(
            f"critical rank (the largest gap of each of {c.num_pairs} step pairs): {counts}; "
            f"its gap mean {c.mean_gap_us:.0f} us (median {c.median_gap_us:.0f})"
        )
    return "\n".join(lines)
