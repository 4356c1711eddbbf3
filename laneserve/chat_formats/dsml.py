"""DSML, the markup DeepSeek V3.2 and V4 write tool calls in.

A call block (V3.2 names it `function_calls`, V4 `tool_calls`):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A string argument is written as is (`string="true"`), any other value as JSON.
"""

from __future__ import annotations

import json

TOKEN = "｜DSML｜"
V32_BLOCK = "function_calls"
V4_BLOCK = "tool_calls"


def to_json(value: object) -> str:
    """JSON as the reference encoders write it (non-ASCII kept as is)."""
    return json.dumps(value, ensure_ascii=False)


def encode_parameters(arguments: object) -> str:
    """The parameter lines of one invoke; `arguments` is the OpenAI JSON text (or the
    object itself)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call arguments are not JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {arguments!r}")
    lines = []
    for key, value in arguments.items():
        text = value if isinstance(value, str) else to_json(value)
        flag = "true" if isinstance(value, str) else "false"
        lines.append(f'<{TOKEN}parameter name="{key}" string="{flag}">{text}</{TOKEN}parameter>')
    return "\n".join(lines)


def encode_calls(calls: list[dict], block: str) -> str:
    """`calls`: OpenAI tool calls ({"function": {"name", "arguments"}})."""
    invokes = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"a tool call needs function.name, got {call!r}")
        params = encode_parameters(fn.get("arguments", "{}"))
        invokes.append(f'<{TOKEN}invoke name="{fn["name"]}">\n{params}\n</{TOKEN}invoke>')
    return f"<{TOKEN}{block}>\n" + "\n".join(invokes) + f"\n</{TOKEN}{block}>"


def decode_arguments(params: list[tuple[str, str, bool]]) -> str:
    """(name, value text, is_string) parameters -> the OpenAI arguments JSON text: a
    string value is quoted, any other kept as the JSON the model wrote."""
    parts = [
        f"{to_json(name)}: {to_json(value) if is_str else value}" for name, value, is_str in params
    ]
    return "{" + ", ".join(parts) + "}"
