"""laneserve: an LLM inference and serving engine on PyTorch."""

from laneserve.frontend.llm import LLM
from laneserve.outputs import CompletionOutput, RequestOutput
from laneserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

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
