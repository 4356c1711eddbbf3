"""The model's context limit, read from its config (or GGUF header) without loading
weights, so that a `max_model_len` beyond it is refused before the model loads."""

from __future__ import annotations

import json
from pathlib import Path


def context_limit(model: str | None) -> int | None:
    """The longest context the checkpoint supports (a sliding window caps it, as the
    worker does); None where it cannot be read cheaply (the worker checks again)."""
    from laneserve.model.loader import default_model_path

    path = Path(model).expanduser() if model else default_model_path()
    if path.is_dir() and (path / "config.json").is_file():
        return _from_hf_config(path / "config.json")
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    return None


def _from_hf_config(config_path: Path) -> int | None:
    from laneserve.model.arch import ArchConfig, UnsupportedModelError

    try:
        arch = ArchConfig.from_hf(json.loads(config_path.read_text()))
    except (ValueError, UnsupportedModelError, KeyError, TypeError):
        return None  # the loader reports what is wrong with it
    limit = arch.max_position_embeddings
    if arch.sliding_window is not None:
        limit = min(limit, arch.sliding_window)
    return limit


def _from_gguf(path: Path) -> int | None:
    from laneserve.model.gguf_header import read_scalars

    try:
        fields = read_scalars(path)  # the header only: the tokenizer's arrays are skipped
    except (OSError, ValueError):  # unreadable header: the loader reports it
        return None
    value = fields.get(f"{fields.get('general.architecture')}.context_length")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def check_max_model_len(model: str | None, want: int | None) -> None:
    """Refuse a `max_model_len` beyond the checkpoint's limit (same message as the worker)."""
    if want is None:
        return
    limit = context_limit(model)
    if limit is not None and want > limit:
        raise ValueError(f"max_model_len={want} exceeds the model's limit of {limit} tokens")
