"""The OpenAI / vLLM request fields that ask for structured output, as one
`StructuredOutputsParams`.

```
 response_format  {"type": "json_object"} | {"type": "json_schema", "json_schema":
                  {"name", "schema", "strict"}} | {"type": "text"} (nothing)
 structured_outputs  vLLM's object: json | json_object | regex | choice | grammar, ...
 guided_json / guided_regex / guided_choice / guided_grammar (+ guided_whitespace_pattern)
                  vLLM's older spelling of the same
```
A request may use one of the three; every malformed value is a ValueError (a 400).
"""

from __future__ import annotations

from typing import Any

from laneserve.structured.params import StructuredOutputsParams

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def from_request(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> StructuredOutputsParams | None:
    """`guided` maps the guided_* fields the request sent to their values."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if response_format is not None and response_format.get("type") != "text":
        found.append(("response_format", _response_format(response_format)))
    if structured_outputs:
        found.append(("structured_outputs", _build(structured_outputs, "structured_outputs")))
    kw = {GUIDED[k]: v for k, v in guided.items() if k in GUIDED and v is not None}
    if kw:
        if guided.get("guided_whitespace_pattern") is not None:
            kw["whitespace_pattern"] = guided["guided_whitespace_pattern"]
        found.append(("guided_*", _build(kw, "guided_*")))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise ValueError(f"{names}: a request may ask for one kind of structured output")
    return found[0][1] if found else None


def _response_format(rf: dict[str, Any]) -> StructuredOutputsParams:
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format: json_schema needs a `schema` object")
        try:
            return StructuredOutputsParams(json=spec["schema"])
        except ValueError as e:
            raise ValueError(f"response_format: {e}") from None
    raise ValueError(
        f"response_format: type must be text, json_object or json_schema, got {kind!r}"
    )


def _build(kw: dict[str, Any], field: str) -> StructuredOutputsParams:
    if not isinstance(kw, dict):
        raise ValueError(f"{field} must be an object")
    try:
        return StructuredOutputsParams(**kw)
    except TypeError as e:  # an unknown or mistyped key
        raise ValueError(f"{field}: {e}") from None
