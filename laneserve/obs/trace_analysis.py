"""`laneserve profile analyze TRACE...`: device spans, exposed host gaps, overlap.

For consecutive device invocations N and N+1 the *exposed host gap* is
start(device N+1) - end(device N): time the device sat idle waiting for host
work. *Overlapped* means prepare(N+1) had finished before device(N) ended.
Only pairs of decode steps (no prefill rows) enter the summary.

Each worker process (each rank's, each file) pairs its own steps: with several, the
report has a section per process and names the critical one. Tensor-parallel ranks run
the same steps in lock step and meet in the forward's collectives, so the others wait
for the latest one inside their device spans: the critical rank of a step pair is the
one with the largest host gap, and the report counts how often each rank was it and
its mean gap (each gap is measured within one process, so this holds across machines
whose clocks differ). Data-parallel ranks number their own steps independently: the
critical one is the slowest per decode step (device + gap).
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from laneserve.obs.profiling import TP_ROLE


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


def load_processes(paths: list[str | Path]) -> dict[str, list[dict]]:
    """The span events of each process that ran device steps, by its name (its
    process_name and pid), in file order."""
    out: dict[str, list[dict]] = {}
    for f in trace_files(paths):
        data = json.loads(f.read_text())["traceEvents"]
        names = {e["pid"]: e["args"]["name"] for e in data if e.get("name") == "process_name"}
        spans = [e for e in data if e.get("ph") == "X"]
        for pid in dict.fromkeys(e["pid"] for e in spans if e["name"] == "device"):
            key = f"{names.get(pid, 'process')} (pid {pid}, {f.name})"
            out[key] = [e for e in spans if e["pid"] == pid]
    return out


@dataclass
class CriticalByStep:
    num_pairs: int
    mean_gap_us: float  # the critical process's gap, averaged over the step pairs
    median_gap_us: float
    times_critical: dict[str, int]  # process -> step pairs where it had the largest gap

    def line(self) -> str:
        counts = ", ".join(f"{n} in {k}" for n, k in self.times_critical.items())
        return (
            f"critical (the largest host gap of each of {self.num_pairs} shared decode step "
            f"pairs): {counts}; its gap mean {self.mean_gap_us:.0f} us "
            f"(median {self.median_gap_us:.0f})"
        )


def critical_by_step(per_process: dict[str, list[StepSpans]]) -> CriticalByStep | None:
    """Over the decode step pairs that every process ran (tensor-parallel ranks run the
    same steps): whose gap was the largest, and how large. None when no pair is shared
    (one process, or data-parallel ranks with their own steps)."""
    gaps = {n: {b.step: g for _, b, g, _ in pairs(st)} for n, st in per_process.items()}
    if len(gaps) < 2:
        return None
    common = set.intersection(*(set(g) for g in gaps.values()))
    if not common:
        return None
    worst: list[float] = []
    times = dict.fromkeys(gaps, 0)
    for step in sorted(common):
        name = max(gaps, key=lambda n: gaps[n][step])
        times[name] += 1
        worst.append(gaps[name][step])
    return CriticalByStep(len(common), statistics.fmean(worst), statistics.median(worst), times)


def report(paths: list[str | Path], max_rows: int = 20) -> str:
    processes = load_processes(paths)
    if len(processes) <= 1:
        return _report_steps(step_spans(load_events(paths)), max_rows)
    lines, step_us = [], {}
    for name, events in processes.items():
        steps = step_spans(events)
        lines += [f"== {name}", _report_steps(steps, max_rows)]
        s = summarize(steps)
        if s is not None:
            step_us[name] = (s.mean_device_us + s.mean_gap_us, s.mean_gap_us)
    tp = {n: step_spans(ev) for n, ev in processes.items() if n.startswith(TP_ROLE + " ")}
    shared = critical_by_step(tp)
    if shared is not None:
        lines.append(shared.line())
    elif step_us:
        name = max(step_us, key=lambda n: step_us[n][0])
        total, gap = step_us[name]
        lines.append(
            f"critical: {name}: decode step {total / 1000:.2f} ms (device + gap), "
            f"exposed gap mean {gap:.0f} us"
        )
    return "\n".join(lines)


def _report_steps(steps: list[StepSpans], max_rows: int) -> str:
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
        lines.append(
            f"summary: {s.num_pairs} decode step pairs, device mean {s.mean_device_us / 1000:.2f} ms "
            f"(median {s.median_device_us / 1000:.2f}), exposed gap mean {s.mean_gap_us:.0f} us "
            f"(median {s.median_gap_us:.0f}), overlapped {s.overlapped}/{s.num_pairs}"
        )
    return "\n".join(lines)
