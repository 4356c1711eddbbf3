"""DeepSeek V3.2's prompt format (the model ships a Python encoder, no Jinja template).

Behaviour follows DeepSeek's reference encoder (`encoding/encoding_dsv32.py` of the
V3.2 model repository) and is checked byte for byte against its outputs:

- `<｜begin▁of▁sentence｜>`, a system message as bare text (tools appended), each user
  turn as `<｜User｜>…<｜Assistant｜>` followed by `<think>` (the last user turn, in
  thinking mode) or `</think>`; an assistant turn is `[reasoning</think>]content[DSML
  calls]<｜end▁of▁sentence｜>`.
- Tool results follow the calls as `<function_results>` with one `<result>` each.
- Thinking mode drops the reasoning of turns before the last user message.
"""

from __future__ import annotations

from laneserve.chat_formats import dsml

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
THINK, END_THINK = "<think>", "</think>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
_T = dsml.TOKEN
TOOLS_HEADER = (
    "## Tools\nYou have access to a set of tools you can use to answer the user's question.\n"
    f'You can invoke functions by writing a "<{_T}function_calls>" block like the following '
    f"as part of your reply to the user:\n<{_T}function_calls>\n"
    f'<{_T}invoke name="$FUNCTION_NAME">\n<{_T}parameter name="$PARAMETER_NAME" '
    f'string="true|false">$PARAMETER_VALUE</{_T}parameter>\n...\n</{_T}invoke>\n'
    f'<{_T}invoke name="$FUNCTION_NAME2">\n...\n</{_T}invoke>\n</{_T}function_calls>\n'
    "String and scalar parameters should be specified as is without any escaping or quotes, "
    'while lists and objects should use JSON format. The "string" attribute should be set '
    'to "true" for string type parameters and "false" for other types (numbers, booleans, '
    "arrays, objects).\nIf the thinking_mode is enabled, then after function results you "
    "should strongly consider outputting a thinking block. Here is an example:\n"
    f"<{_T}function_calls>\n...\n</{_T}function_calls>\n<function_results>\n...\n"
    f"</function_results>\n{THINK}...thinking about results{END_THINK}\n"
    "Here are the functions available in JSONSchema format:\n<functions>\n"
)
TOOLS_FOOTER = "\n</functions>\n"
RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


def encode(messages: list[dict], thinking: bool, drop_thinking: bool = True) -> str:
    """The prompt text of a conversation (OpenAI message dicts; tools ride on a system
    or developer message's `tools`)."""
    msgs = list(messages)
    if thinking and drop_thinking:
        msgs = _drop_old_reasoning(msgs)
    last = _last_user(msgs)
    return BOS + "".join(_render(i, msgs, thinking, last) for i in range(len(msgs)))


def _last_user(msgs: list[dict]) -> int:
    return max(
        (i for i, m in enumerate(msgs) if m.get("role") in ("user", "developer")), default=-1
    )


def _extras(msg: dict) -> str:
    out = ""
    if msg.get("tools"):
        schemas = "\n".join(dsml.to_json(t["function"]) for t in msg["tools"])
        out += "\n\n" + TOOLS_HEADER + schemas + TOOLS_FOOTER
    if msg.get("response_format"):
        out += "\n\n" + RESPONSE_FORMAT + dsml.to_json(msg["response_format"])
    return out


def _opens(i: int, last: int, thinking: bool) -> str:
    return THINK if i == last and thinking else END_THINK


def _render(i: int, msgs: list[dict], thinking: bool, last: int) -> str:
    msg, role = msgs[i], msgs[i].get("role")
    content = msg.get("content")
    if role == "system":
        return (content or "") + _extras(msg)
    if role == "developer":
        if not content:
            raise ValueError("a developer message needs content")
        text = _extras(msg) + f"\n\n# The user's message is: {content}"
        return USER + text + ASSISTANT + _opens(i, last, thinking)
    if role == "user":
        return USER + str(content) + ASSISTANT + _opens(i, last, thinking)
    if role == "tool":
        return _tool(i, msgs, thinking, last)
    if role == "assistant":
        return _assistant(i, msg, thinking, last)
    raise ValueError(f"the deepseek_v32 chat format has no role {role!r}")


def _tool(i: int, msgs: list[dict], thinking: bool, last: int) -> str:
    start = i
    while start > 0 and msgs[start - 1].get("role") == "tool":
        start -= 1
    calls = msgs[start - 1].get("tool_calls") if start > 0 else None
    n = i - start + 1  # this result answers the n-th call
    if start == 0 or msgs[start - 1].get("role") != "assistant" or not calls or len(calls) < n:
        raise ValueError(f"message {i}: a tool result without a matching assistant tool call")
    out = "\n\n<function_results>" if n == 1 else ""
    out += f"\n<result>{msgs[i].get('content')}</result>"
    if n == len(calls):
        out += "\n</function_results>\n\n" + (THINK if i >= last and thinking else END_THINK)
    return out


def _assistant(i: int, msg: dict, thinking: bool, last: int) -> str:
    calls = ""
    if msg.get("tool_calls"):
        calls = "\n\n" + dsml.encode_calls(msg["tool_calls"], dsml.V32_BLOCK)
    reasoning = ""
    if thinking and i > last:
        text = msg.get("reasoning_content") or msg.get("reasoning")
        if not text and not calls:
            raise ValueError(f"message {i}: a thinking-mode answer needs reasoning or tool calls")
        reasoning = (text or "") + END_THINK
    return reasoning + (msg.get("content") or "") + calls + EOS


def _drop_old_reasoning(msgs: list[dict]) -> list[dict]:
    """Before the last user turn: assistant turns lose their reasoning, developer
    turns are left out."""
    last = _last_user(msgs)
    out = []
    for i, msg in enumerate(msgs):
        if msg.get("role") in ("user", "system", "tool") or i >= last:
            out.append(msg)
        elif msg.get("role") == "assistant":
            out.append(
                {k: v for k, v in msg.items() if k not in ("reasoning_content", "reasoning")}
            )
    return out
