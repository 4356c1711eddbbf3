"""What `--model` / `LLM(model)` accepts, checked before anything loads.

laneserve loads a local HF model directory (config.json + *.safetensors) or a local
`.gguf` file, and downloads nothing. A name that looks like a model hub id
(`Qwen/Qwen2.5-0.5B-Instruct`) and is no local path gets an answer that says so and
how to fetch the model, instead of the "does not exist" of a mistyped path.
"""

from __future__ import annotations

import re
from pathlib import Path

ACCEPTED = "a local HF model directory (config.json + *.safetensors) or a .gguf file"
# owner/name, as model hubs spell ids: no leading "/", ".", "~", one slash
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelPathError(ValueError):
    """`model` names nothing that laneserve can load."""


def check_model_path(model: str | None) -> None:
    """Raise ModelPathError for a `model` that is not an existing local path (None: the
    embedded default model, checked by its loader)."""
    if not model:
        return
    path = Path(model).expanduser()
    if path.exists():
        return
    if _HUB_ID.fullmatch(model):
        raise ModelPathError(
            f"model {model!r} is not a local path: laneserve loads {ACCEPTED} and downloads "
            f"nothing. If {model!r} is a model hub id, download it first (for example "
            f"`hf download {model} --local-dir DIR`, from the huggingface_hub package) "
            "and pass --model DIR"
        )
    raise ModelPathError(
        f"model path {model!r} does not exist (laneserve loads {ACCEPTED}; nothing is downloaded)"
    )
