"""Concise INFO logging for `LLM` users who configured none (as vLLM does).

A Python program that creates an `LLM` without configuring logging would see nothing
while the model loads, converts or builds kernels; `show_progress_logs` gives the
"laneserve" logger a handler of its own in that case. `LANESERVE_CONFIGURE_LOGGING=0`
turns this off; a program (or the CLI) that configures logging itself is left alone.
"""

from __future__ import annotations

import logging
import os

ENV = "LANESERVE_CONFIGURE_LOGGING"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def show_progress_logs() -> None:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no"):
        return
    logger = logging.getLogger("laneserve")
    if logger.handlers or logging.getLogger().handlers:
        return  # configured already, by the program or an earlier call
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
