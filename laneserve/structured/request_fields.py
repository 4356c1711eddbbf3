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

from laneserve.structured.params import KINDS, StructuredOutputsParams

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
    """`guided` maps the guided_* fields the request sent to their values.

    As in vLLM, `response_format` fills in an options-only `structured_outputs`
    object (e.g. `{"disable_any_whitespace": true}`)."""
    if not isinstance(structured_outputs or {}, dict):
        raise ValueError("structured_outputs must be an object")
    fields = dict(structured_outputs or {})
    asked = ["structured_outputs"] if any(fields.get(k) is not None for k in KINDS) else []
    if response_format is not None and response_format.get("type") != "text":
        asked.append("response_format")
        fields.update(_response_format(response_format))
    kw = {GUIDED[k]: v for k, v in guided.items() if k in GUIDED and v is not None}
    if kw:
        asked.append("guided_*")
        fields.update(kw)
        if guided.get("guided_whitespace_pattern") is not None:
            fields["whitespace_pattern"] = guided["guided_whitespace_pattern"]
    if len(asked) > 1:
        raise ValueError(
            f"{' and '.join(asked)}: a request may ask for one kind of structured output"
        )
    return _build(fields, asked[0] if asked else "structured_outputs") if fields else None


def _response_format(rf: dict[str, Any]) -> dict[str, Any]:
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format: json_schema needs a `schema` object")
        return {"json": spec["schema"]}
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
    except ValueError as e:
        if field == "structured_outputs":
            raise
        raise ValueError(f"{field}: {e}") from None
