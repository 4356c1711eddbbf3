"""DeepSeek V4's prompt format (the model ships a Python encoder, no Jinja template).

Behaviour follows DeepSeek's reference encoder (`encoding/encoding_dsv4.py` of the V4
model repository) and is checked byte for byte against its test vectors:

- `<｜begin▁of▁sentence｜>`, then each message; a system message is its bare text, a
  user or developer one follows `<｜User｜>`, a `latest_reminder` one
  `<｜latest_reminder｜>`; an assistant turn is `[reasoning</think>]content[DSML calls]`
  and `<｜end▁of▁sentence｜>`.
- After the last user turn comes `<｜Assistant｜>` and `<think>` (thinking) or `</think>`.
- V4 has no tool role: tool results become `<tool_result>…</tool_result>` blocks of a
  user turn (merged with the user text that follows), ordered as the calls were.
- Thinking mode drops the reasoning of turns before the last user message (unless the
  conversation has tools, or `drop_thinking` is off).
"""

from __future__ import annotations

import copy

from laneserve.chat_formats import dsml

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
THINK, END_THINK = "<think>", "</think>"
USER, ASSISTANT, REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
TASKS = {t: f"<｜{t}｜>" for t in ("action", "query", "authority", "domain", "title", "read_url")}
EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem "
    "to resolve the root cause, rigorously stress-testing your logic against all potential "
    "paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no "
    "assumption is left unchecked.\n\n"
)
_T = dsml.TOKEN
TOOLS_HEADER = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can "
    f'invoke tools by writing a "<{_T}tool_calls>" block like the following:\n\n'
    f'<{_T}tool_calls>\n<{_T}invoke name="$TOOL_NAME">\n<{_T}parameter name="$PARAMETER_NAME" '
    f'string="true|false">$PARAMETER_VALUE</{_T}parameter>\n...\n</{_T}invoke>\n'
    f'<{_T}invoke name="$TOOL_NAME2">\n...\n</{_T}invoke>\n</{_T}tool_calls>\n\n'
    'String parameters should be specified as is and set `string="true"`. For all other '
    "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete "
    f"reasoning inside {THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_FOOTER = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to "
    "invoke tool calls.\n"
)
RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


def encode(
    messages: list[dict],
    thinking: bool,
    drop_thinking: bool = True,
    reasoning_effort: str | None = None,
) -> str:
    """The prompt text of a conversation (OpenAI message dicts; tools ride on a system
    or developer message's `tools`)."""
    if reasoning_effort not in (None, "high", "max"):
        raise ValueError(f"reasoning_effort must be 'high' or 'max', got {reasoning_effort!r}")
    msgs = _order_tool_results(_merge_tool_messages(messages))
    if any(m.get("tools") for m in msgs):
        drop_thinking = False  # tool use keeps every turn's reasoning
    if thinking and drop_thinking:
        msgs = _drop_old_reasoning(msgs)
    return BOS + "".join(
        _render(i, msgs, thinking, drop_thinking, reasoning_effort) for i in range(len(msgs))
    )


def _last_user(msgs: list[dict]) -> int:
    return max(
        (i for i, m in enumerate(msgs) if m.get("role") in ("user", "developer")), default=-1
    )


def _tools_text(tools: list[dict]) -> str:
    schemas = "\n".join(dsml.to_json(t["function"]) for t in tools)
    return TOOLS_HEADER + schemas + TOOLS_FOOTER


def _extras(msg: dict) -> str:
    out = ""
    if msg.get("tools"):
        out += "\n\n" + _tools_text(msg["tools"])
    if msg.get("response_format"):
        out += "\n\n" + RESPONSE_FORMAT + dsml.to_json(msg["response_format"])
    return out


def _user_text(msg: dict) -> str:
    blocks = msg.get("content_blocks")
    if not blocks:
        return msg.get("content") or ""
    parts = []
    for b in blocks:
        if b.get("type") == "text":
            parts.append(b.get("text", ""))
        elif b.get("type") == "tool_result":
            parts.append(f"<tool_result>{_result_text(b.get('content', ''))}</tool_result>")
        else:
            parts.append(f"[Unsupported {b.get('type')}]")
    return "\n\n".join(parts)


def _result_text(content: object) -> str:
    if not isinstance(content, list):
        return str(content)
    return "\n\n".join(
        b.get("text", "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
        for b in content
    )


def _assistant(i: int, msgs: list[dict], thinking: bool, drop: bool) -> str:
    msg = msgs[i]
    calls = ""
    if msg.get("tool_calls"):
        calls = "\n\n" + dsml.encode_calls(msg["tool_calls"], dsml.V4_BLOCK)
    reasoning = ""
    after_task = i > 0 and msgs[i - 1].get("task") is not None
    if thinking and not after_task and (not drop or i > _last_user(msgs)):
        reasoning = _reasoning(msg) + END_THINK
    end = "" if msg.get("wo_eos") else EOS
    return reasoning + (msg.get("content") or "") + calls + end


def _reasoning(msg: dict) -> str:
    return msg.get("reasoning_content") or msg.get("reasoning") or ""


def _render(i: int, msgs: list[dict], thinking: bool, drop: bool, effort: str | None) -> str:
    msg, role = msgs[i], msgs[i].get("role")
    out = EFFORT_MAX if i == 0 and thinking and effort == "max" else ""
    if role == "system":
        out += (msg.get("content") or "") + _extras(msg)
    elif role == "developer":
        if not msg.get("content"):
            raise ValueError("a developer message needs content")
        out += USER + msg["content"] + _extras(msg)
    elif role == "user":
        out += USER + _user_text(msg)
    elif role == "latest_reminder":
        out += REMINDER + (msg.get("content") or "")
    elif role == "assistant":
        out += _assistant(i, msgs, thinking, drop)
    else:
        raise ValueError(f"the deepseek_v4 chat format has no role {role!r}")
    return out + _transition(i, msgs, thinking, drop)


def _transition(i: int, msgs: list[dict], thinking: bool, drop: bool) -> str:
    """What opens the model's turn after message i (nothing if a user turn follows)."""
    if i + 1 < len(msgs) and msgs[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return ""
    task = msgs[i].get("task")
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; one of {sorted(TASKS)}")
        if task != "action":
            return TASKS[task]
        return ASSISTANT + (THINK if thinking else END_THINK) + TASKS[task]
    if msgs[i].get("role") not in ("user", "developer"):
        return ""
    opens = thinking and (not drop or i >= _last_user(msgs))
    return ASSISTANT + (THINK if opens else END_THINK)


def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Tool results (and the user text after them) become blocks of one user turn."""
    out: list[dict] = []
    for raw in messages:
        msg = copy.deepcopy(raw)
        role = msg.get("role")
        prev: dict = out[-1] if out else {}
        open_user = prev.get("role") == "user" and "content_blocks" in prev
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""),
                     "content": msg.get("content", "")}  # fmt: skip
            if open_user:
                prev["content_blocks"].append(block)
            else:
                out.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            text = {"type": "text", "text": msg.get("content", "")}
            if open_user and prev.get("task") is None:
                prev["content_blocks"].append(text)
            else:
                keep = {k: msg[k] for k in ("task", "wo_eos", "mask") if k in msg}
                out.append({"role": "user", "content": msg.get("content", ""),
                            "content_blocks": [text], **keep})  # fmt: skip
        else:
            out.append(msg)
    return out


def _order_tool_results(msgs: list[dict]) -> list[dict]:
    """Tool results in the order the assistant made the calls (by call id)."""
    order: dict[str, int] = {}
    for msg in msgs:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {c.get("id"): n for n, c in enumerate(msg["tool_calls"]) if c.get("id")}
        elif msg.get("role") == "user" and msg.get("content_blocks") and order:
            blocks = msg["content_blocks"]
            results = [b for b in blocks if b.get("type") == "tool_result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id"), 0)))
                msg["content_blocks"] = [
                    next(ranked) if b.get("type") == "tool_result" else b for b in blocks
                ]
    return msgs


def _drop_old_reasoning(msgs: list[dict]) -> list[dict]:
    """Before the last user turn: assistant turns lose their reasoning, developer
    turns (and any other role) are left out."""
    last = _last_user(msgs)
    keep = ("user", "system", "tool", "latest_reminder", "direct_search_results")
    out = []
    for i, msg in enumerate(msgs):
        if msg.get("role") in keep or i >= last:
            out.append(msg)
        elif msg.get("role") == "assistant":
            out.append(
                {k: v for k, v in msg.items() if k not in ("reasoning_content", "reasoning")}
            )
    return out
