"""Reasoning parsers (`--reasoning-parser`): the model's thinking goes to the chat
answer's `reasoning_content`, the rest to `content` (see docs/serving.md)."""

from laneserve.reasoning.parsers import (
    REASONING_PARSERS,
    ReasoningPlan,
    ReasoningStream,
    Thought,
    reasoning_plan,
)

__all__ = ["REASONING_PARSERS", "ReasoningPlan", "ReasoningStream", "Thought", "reasoning_plan"]
