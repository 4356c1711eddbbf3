"""Default sampling parameters from a checkpoint's `generation_config.json`, as
vLLM's `--generation-config auto` reads them: a request (or an offline call without
SamplingParams) that leaves a field unset gets the checkpoint's value."""

from __future__ import annotations

import json
from pathlib import Path

# generation_config.json key -> SamplingParams field
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(mode: str, model_dir: Path) -> dict[str, object]:
    """`mode`: "vllm" (none: laneserve's own defaults), "auto" (the model's folder)
    or a folder holding a generation_config.json."""
    if mode == "vllm":
        return {}
    folder = model_dir if mode == "auto" else Path(mode)
    path = folder / "generation_config.json"
    if not path.is_file():
        if mode != "auto":
            raise ValueError(f"generation_config: no generation_config.json in {folder}")
        return {}  # NOTE: a model without one (or a .gguf file) keeps the defaults
    data = json.loads(path.read_text())
    out = {ours: data[theirs] for theirs, ours in _KEYS.items() if data.get(theirs) is not None}
    if data.get("do_sample") is False:  # HF's greedy: sampling fields do not apply
        out = {
            "temperature": 0.0,
            **({"max_tokens": out["max_tokens"]} if "max_tokens" in out else {}),
        }
    return out
