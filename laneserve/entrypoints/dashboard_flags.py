"""The `laneserve serve` flags of the dashboard, read into `DashboardOptions`.

Kept apart from the dashboard itself so that building the command line stays light.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laneserve.obs.history import default_path

_HIDDEN_FLAGS = {"func", "command", "api_key"}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dashboard")
    g.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the live dashboard at /dashboard and keep its history",
    )
    g.add_argument(
        "--dashboard-history",
        default=None,
        help=f"the history's SQLite file (default: {default_path()})",
    )
    g.add_argument(
        "--dashboard-retention-h", type=float, default=48.0, help="hours of history kept"
    )
    g.add_argument(
        "--dashboard-sample-s", type=float, default=5.0, help="seconds between history samples"
    )
    g.add_argument(
        "--dashboard-steps", type=int, default=64, help="steps in the lanes timeline (1-512)"
    )


@dataclass(frozen=True)
class DashboardOptions:
    history: Path
    retention_s: float
    sample_s: float
    steps: int

    @staticmethod
    def from_cli(ns: argparse.Namespace) -> DashboardOptions:
        if not ns.dashboard_retention_h > 0:
            raise ValueError(f"--dashboard-retention-h must be > 0, got {ns.dashboard_retention_h}")
        if not 1 <= ns.dashboard_sample_s <= 3600:
            raise ValueError(
                f"--dashboard-sample-s must be in [1, 3600], got {ns.dashboard_sample_s}"
            )
        if not 1 <= ns.dashboard_steps <= 512:
            raise ValueError(f"--dashboard-steps must be in [1, 512], got {ns.dashboard_steps}")
        path = Path(ns.dashboard_history) if ns.dashboard_history else default_path()
        return DashboardOptions(
            path, ns.dashboard_retention_h * 3600, ns.dashboard_sample_s, ns.dashboard_steps
        )


def server_flags(ns: argparse.Namespace) -> dict[str, Any]:
    """The flags as run, for the page (the API key shown only as set or not)."""
    flags = {k: v for k, v in sorted(vars(ns).items()) if k not in _HIDDEN_FLAGS}
    flags["api_key"] = "(set)" if ns.api_key else None
    return {k: _plain(v) for k, v in flags.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, str | int | float | bool | None):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)
