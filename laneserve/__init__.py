"""laneserve: an LLM inference and serving engine on PyTorch."""

import sys

try:
    from laneserve.frontend.llm import LLM
    from laneserve.outputs import CompletionOutput, RequestOutput
    from laneserve.sampling_params import (
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )
except ModuleNotFoundError as e:  # a dependency is missing: another interpreter
    if e.name is None or e.name.startswith("laneserve"):
        raise
    raise ModuleNotFoundError(
        f"{e.msg}: laneserve's dependencies are not installed for {sys.executable}; "
        "use the environment that scripts/run.sh sets up (.venv/bin/python, or "
        "`source .venv/bin/activate` first)",
        name=e.name,
    ) from e

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
