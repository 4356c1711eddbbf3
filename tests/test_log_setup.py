"""`LLM()` shows its progress at INFO when the program configured no logging."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
from laneserve.log_setup import show_progress_logs
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.WARNING)
show_progress_logs()
logging.getLogger("laneserve.model.loader").info("loading the model")
"""


def _stderr(mode: str, env_extra: dict[str, str]) -> str:
    env = {**os.environ, **env_extra}
    if not env_extra:
        env.pop("LANESERVE_CONFIGURE_LOGGING", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, check=True
    )
    return proc.stderr


def test_info_lines_shown_by_default() -> None:
    assert "INFO laneserve.model.loader: loading the model" in _stderr("bare", {})


@pytest.mark.parametrize(
    ("mode", "env"),
    [("bare", {"LANESERVE_CONFIGURE_LOGGING": "0"}), ("configured", {})],
    ids=["turned-off", "program-configured-logging"],
)
def test_left_alone(mode: str, env: dict[str, str]) -> None:
    assert "loading the model" not in _stderr(mode, env)
