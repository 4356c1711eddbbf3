"""Where a layer's tensors come from: the one weight-getter type every layer takes.

A getter is called as `get(name)` or `get(name, dtype)`: the checkpoint tensor `name`,
in `dtype` if given (the activation dtype otherwise). `loader.WeightStore` is the
getter of a checkpoint (it also offers `has` and `quantized_linear`, which layers look
for with `getattr`); tests pass a dict's `__getitem__` or a small function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WeightGetter = Callable[..., torch.Tensor]  # (name[, dtype]) -> tensor
