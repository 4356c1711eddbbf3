"""Registers the subcommands other than `generate` (each lives in its own module)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from laneserve.entrypoints import bench_offline, profile_cmd

    bench = sub.add_parser("bench", help="benchmarks: offline (vs HF transformers)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench_sub.required = True
    bench_offline.add_parser(bench_sub)
    profile_cmd.add_parser(sub)
