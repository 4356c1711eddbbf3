"""How many bytes a loaded model's tensors hold, and how many its checkpoint stores.

`resident_bytes` walks a model object (its attributes, lists, tuples, dicts and
dataclasses, e.g. packed weights) and sums the storage of every tensor it reaches, each
storage once (views and stacked experts share one). Kernels objects are not walked.
`checkpoint_bytes` sums the tensors of a directory's safetensors files (headers aside).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from laneserve.kernels import Kernels


def resident_bytes(root: Any) -> int:
    """Bytes of the distinct tensor storages reachable from `root` (see the module)."""
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif _walkable(obj):
            stack.extend(vars(obj).values())
    return sum(storages.values())


def _walkable(obj: Any) -> bool:
    module = type(obj).__module__ or ""
    return (
        hasattr(obj, "__dict__")
        and module.startswith("laneserve.")
        and not isinstance(obj, type)
        and not isinstance(obj, Kernels)
    )


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the tensors in the directory's *.safetensors files."""
    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                start, stop = entry["data_offsets"]
                total += stop - start
    return total
