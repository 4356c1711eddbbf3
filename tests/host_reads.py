"""A guard that fails on anything that would read a device value back to the host.

Code a CUDA graph captures must not do that (`.item()`, `.tolist()`, `bool(t)`, boolean
masks, `nonzero`): on CUDA each is a synchronisation and its result is frozen into the
graph. On CPU there is nothing to synchronise, so the guard looks for the operations
themselves: the dispatcher's scalar reads and data-dependent shapes, and the Python
methods that read values without dispatching.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_DEPENDENT = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
}


class HostRead(AssertionError):
    pass


class _Guard(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _DATA_DEPENDENT:
            raise HostRead(f"{func} reads a device value on the host")
        if func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        ):
            raise HostRead("a boolean mask index has a data-dependent shape")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise HostRead("Tensor.tolist reads device values on the host")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", refuse)
        with _Guard():
            yield
