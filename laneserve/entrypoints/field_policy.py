"""Which request fields beyond the implemented ones a request may carry.

Nothing is ignored silently: a field that would change what is generated and that
laneserve does not implement is a 400 naming it, unless it carries the value that
means "off" (e.g. `function_call: "none"`, `prediction: null`).
Fields that have no effect on generation (bookkeeping the `openai` client and
others send) are accepted and ignored. Anything else, unknown fields included,
is rejected: a typo must not pass for a setting. docs/compatibility.md lists
every field with its status.
"""

from __future__ import annotations

from collections.abc import Callable

# accepted and ignored: none of them changes the tokens generated
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",  # a routing hint; the prefix cache works without it
        "safety_identifier",
        "request_id",
    }
)


def _off(value: object) -> bool:
    """None, false, or an empty string / list / dict: the field asks for nothing."""
    return value is None or value is False or value in ("", [], {})


def _text_modalities(value: object) -> bool:
    return _off(value) or value == ["text"]


def _no_tool_choice(value: object) -> bool:
    return _off(value) or value == "none"


# implemented nowhere yet: accepted only with the value that turns them off
NEUTRAL: dict[str, Callable[[object], bool]] = {
    "suffix": _off,
    "function_call": _no_tool_choice,
    "functions": _off,
    "guided_decoding_backend": _off,
    "use_beam_search": _off,
    "modalities": _text_modalities,
    "audio": _off,
    "prediction": _off,
    "reasoning_effort": _off,
    "verbosity": _off,
    "web_search_options": _off,
    "logits_processors": _off,
    "allowed_token_ids": _off,
    "bad_words": _off,
    "truncate_prompt_tokens": _off,
}


def unsupported_field(fields: dict[str, object], n: int) -> tuple[str, str] | None:
    """(field, message) for the first field this request may not carry, or None.

    `fields` maps every field the client sent (declared ones included) to its value.
    """
    for name, value in fields.items():
        if name in IGNORED:
            continue
        problem = _problem(name, value, n)
        if problem is not None:
            return name, f"{name}: {problem}"
    return None


def _problem(name: str, value: object, n: int) -> str | None:
    if name == "best_of":
        return _best_of(value, n)
    check = NEUTRAL.get(name)
    if check is None:
        return "unknown field; laneserve does not support it (see docs/compatibility.md)"
    if check(value):
        return None
    return f"not supported by laneserve (got {_short(value)})"


def _best_of(value: object, n: int) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return f"best_of must be an integer >= n ({n}), got {_short(value)}"
    if value == n:  # best_of == n is plain sampling of n choices
        return None
    if value > n:
        return f"best_of > n is not supported by laneserve (best_of={value}, n={n})"
    return f"best_of must be an integer >= n ({n}), got {_short(value)}"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
