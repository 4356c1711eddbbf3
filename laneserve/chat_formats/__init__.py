"""Chat formats written in code: the prompt encoders some publishers ship instead of a
Jinja chat template (DeepSeek V3.2 and V4), chosen by architecture or by
`--tokenizer-mode` (see docs/serving.md)."""

from laneserve.chat_formats.registry import (
    CHAT_FORMATS,
    TOKENIZER_MODES,
    render_chat,
    resolve_chat_format,
)

__all__ = ["CHAT_FORMATS", "TOKENIZER_MODES", "render_chat", "resolve_chat_format"]
