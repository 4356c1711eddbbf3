"""`laneserve profile analyze TRACE...`: read Chrome traces written with --profile-dir."""

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


def run_analyze(ns: argparse.Namespace) -> int:
    print(report(ns.traces, ns.max_rows))
    return 0
