"""`laneserve profile analyze|merge TRACE...`: read Chrome traces written with --profile-dir."""

from __future__ import annotations

import argparse

from laneserve.obs.trace_analysis import report


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="analyze traces recorded with --profile-dir")
    psub = p.add_subparsers(dest="profile_command", metavar="ACTION")
    psub.required = True
    a = psub.add_parser(
        "analyze", help="device spans, exposed host gaps and overlap per decode step"
    )
    a.add_argument("traces", nargs="+", help="trace JSON files or --profile-dir directories")
    a.add_argument("--max-rows", type=int, default=20, help="most steps listed")
    a.set_defaults(func=run_analyze)
    m = psub.add_parser(
        "merge", help="join the engine's and the worker's traces into one file for Perfetto"
    )
    m.add_argument("traces", nargs="+", help="trace JSON files or --profile-dir directories")
    m.add_argument("-o", "--output", required=True, help="the merged trace file to write")
    m.set_defaults(func=run_merge)


def run_analyze(ns: argparse.Namespace) -> int:
    print(report(ns.traces, ns.max_rows))
    return 0


def run_merge(ns: argparse.Namespace) -> int:
    from laneserve.obs.trace_merge import write_merged

    try:
        out = write_merged(ns.traces, ns.output)
    except (OSError, ValueError) as e:
        print(f"error: {e}")
        return 1
    print(f"wrote {out} (open it in Perfetto)")
    return 0
