"""Where laneserve keeps its cache: converted GGUF models and built CPU kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$LANESERVE_CACHE_DIR``, else ``~/.cache/laneserve``."""
    env = os.environ.get("LANESERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "laneserve"
