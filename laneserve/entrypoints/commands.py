"""Registers the subcommands other than `generate` (each lives in its own module).

NOTE: building the parser must not import torch (`--help` stays fast): the modules
imported here declare flags at import time and load the engine only when run.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from laneserve.bench import bench_offline, bench_quality, bench_serve
    from laneserve.entrypoints import cache_cmd, chat, profile_cmd, serve
    from laneserve.training import cli as train_cli

    bench = sub.add_parser(
        "bench",
        help="benchmarks: offline (vs HF transformers), serve (any OpenAI server), quality",
    )
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench_sub.required = True
    bench_offline.add_parser(bench_sub)
    bench_serve.add_parser(bench_sub)
    bench_quality.add_parser(bench_sub)
    profile_cmd.add_parser(sub)
    train_cli.add_parser(sub)
    serve.add_parser(sub)
    chat.add_parser(sub)
    cache_cmd.add_parser(sub)
