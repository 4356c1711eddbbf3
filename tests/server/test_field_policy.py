"""The request-field policy itself (no server): which values pass."""

from __future__ import annotations

import pytest

from laneserve.entrypoints.field_policy import IGNORED, NEUTRAL, unsupported_field


def test_ignored_fields_pass_with_any_value() -> None:
    assert unsupported_field({name: {"any": 1} for name in IGNORED}, n=1) is None


@pytest.mark.parametrize("name", sorted(NEUTRAL))
def test_each_neutral_field_passes_off_and_fails_on(name: str) -> None:
    assert unsupported_field({name: None}, n=1) is None
    bad = unsupported_field({name: {"on": True}}, n=1)
    assert bad is not None and bad[0] == name and bad[1].startswith(f"{name}:")


@pytest.mark.parametrize(
    ("fields", "n", "ok"),
    [
        ({"best_of": 2}, 2, True),
        ({"best_of": 3}, 2, False),
        ({"best_of": 1}, 2, False),
        ({"best_of": True}, 1, False),
        ({"tools": [{}]}, 1, False),  # declared by chat requests only: unknown elsewhere
        ({"function_call": "none"}, 1, True),
        ({"function_call": "auto"}, 1, False),  # the deprecated spelling is not served
        ({"prediction": None}, 1, True),
        ({"prediction": {"type": "content"}}, 1, False),
        ({"modalities": ["text"]}, 1, True),
        ({"modalities": ["text", "audio"]}, 1, False),
        ({"whatever": None}, 1, False),  # unknown: rejected even when null
    ],
)
def test_cross_field_rules(fields: dict, n: int, ok: bool) -> None:
    assert (unsupported_field(fields, n) is None) is ok
