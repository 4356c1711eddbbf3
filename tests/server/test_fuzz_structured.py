"""Property-based fuzzing of the structured-output fields (hypothesis):
`structured_outputs`, `response_format`, the guided_* fields and `tools` /
`tool_choice`, in valid, oversized and mistyped shapes, while innocent greedy
streams run beside them. No fuzzed request gets a 5xx (nor a 5xx error event),
and every innocent stream gives its usual text with no error.

Bounded: 40 examples per test by default (derandomized: the same bodies each
run); the `slow` variant runs LANESERVE_FUZZ_EXAMPLES (default 1000)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.server.conftest import VLLM_STYLE, Server
from tests.server.test_fuzz import anything, fuzz_settings, texts

pytestmark = pytest.mark.slow  # fuzzers: many generated requests each (CI runs them)

INNOCENT = {"prompt": "The old lighthouse", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

counts = st.sampled_from([0, 1, 3, 1000, 10_001, 1_000_000])
atoms = st.sampled_from(["a", "b", "[a-z]", r"\d", ".", "(ab|c)", "x"])
regexes = st.one_of(
    st.builds(lambda a, n: f"{a}{{{n}}}", atoms, counts),
    st.builds(lambda a, q: a + q, atoms, st.sampled_from(["", "+", "*", "?", "{2,5}"])),
    st.lists(atoms, min_size=1, max_size=5).map("".join),
    texts,
)
leaf_schemas = st.one_of(
    st.sampled_from(
        [{"type": t} for t in ("string", "integer", "number", "boolean", "null", "objekt")]
    ),
    st.builds(lambda r: {"type": "string", "pattern": r}, regexes),
    st.builds(lambda n: {"type": "string", "maxLength": n}, counts),
    st.builds(lambda e: {"enum": e}, st.lists(st.one_of(texts, st.integers()), max_size=3)),
)
schemas = st.recursive(
    leaf_schemas,
    lambda inner: st.one_of(
        st.builds(
            lambda props, extra: {
                "type": "object",
                "properties": props,
                "required": list(props)[:1],
                "additionalProperties": extra,
            },
            st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
            st.booleans(),
        ),
        st.builds(lambda i, n: {"type": "array", "items": i, "maxItems": n}, inner, counts),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda s: {"$defs": {"P": s}, "$ref": "#/$defs/P"}, inner),
        st.just({"$ref": "#/$defs/missing"}),
    ),
    max_leaves=8,
)
lark = st.one_of(
    st.builds(lambda r: f"start: /{r}/", regexes),
    st.builds(lambda n: f'start: "a"~{n}', counts),
    st.sampled_from(['start: "yes" | "no"', "start: x\nx: x", 'root ::= "a" "b"', "start: ("]),
    texts,
)
choices = st.one_of(
    st.lists(texts, min_size=0, max_size=4),
    st.builds(lambda n: [f"c{i}" for i in range(n)], st.sampled_from([1, 5000])),
)
options = st.fixed_dictionaries(
    {},
    optional={
        "disable_any_whitespace": st.one_of(st.booleans(), anything),
        "whitespace_pattern": st.one_of(regexes, anything),
    },
)
kinds = st.one_of(
    st.fixed_dictionaries({"json": st.one_of(schemas, schemas.map(json.dumps), anything)}),
    st.fixed_dictionaries({"regex": st.one_of(regexes, anything)}),
    st.fixed_dictionaries({"choice": st.one_of(choices, anything)}),
    st.fixed_dictionaries({"grammar": st.one_of(lark, anything)}),
    st.fixed_dictionaries({"json_object": st.one_of(st.booleans(), anything)}),
    st.dictionaries(texts, anything, max_size=2),
)
structured_outputs = st.builds(lambda k, o: {**k, **o}, kinds, options)
response_format = st.one_of(
    st.just({"type": "json_object"}),
    st.builds(
        lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, schemas
    ),
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["text", "xml"]), anything)}),
    anything,
)
function = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["f", "g"]), texts)},
    optional={"parameters": st.one_of(schemas, anything), "strict": anything},
)
tools = st.lists(
    st.fixed_dictionaries({"type": st.just("function"), "function": function}),
    min_size=1,
    max_size=2,
)
tool_choice = st.one_of(
    st.sampled_from(["none", "auto", "required"]),
    st.just({"type": "function", "function": {"name": "f"}}),
    anything,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "structured_outputs": st.one_of(structured_outputs, anything),
        "response_format": response_format,
        "guided_regex": regexes,
        "guided_choice": choices,
        "guided_json": schemas,
        "tools": st.one_of(tools, anything),
        "tool_choice": tool_choice,
    },
)


class Innocents:
    """Greedy streams sent one after another while the fuzzing runs; each must
    give the reference text with no error event."""

    def __init__(self, server: Server, reference: str) -> None:
        self.server, self.reference = server, reference
        self.done, self.harmed = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _one(self) -> str:
        url, body = f"{self.server.url}/v1/completions", {**INNOCENT, "stream": True}
        text = ""
        with httpx.stream("POST", url, json=body, timeout=300) as r:
            if r.status_code != 200:
                return f"<status {r.status_code}>"
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return f"<error {chunk['error']}>"
                    text += chunk["choices"][0]["text"]
        return text

    def _run(self) -> None:
        while not self._stop.is_set():
            text = self._one()
            self.done += 1
            if text != self.reference:
                self.harmed.append(text)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(300)


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Server]) -> Server:
    return shared_server("llama", *VLLM_STYLE)


@pytest.fixture(scope="module")
def innocents(server: Server) -> Iterator[Innocents]:
    body = {**INNOCENT, "model": server.model}
    reference = server.post("/v1/completions", body).json()["choices"][0]["text"]
    watch = Innocents(server, reference)
    yield watch
    watch.close()
    assert watch.done > 0
    assert watch.harmed == [], watch.harmed[:3]


def _check(server: Server, body: dict) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=300,
    )
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.headers["content-type"].startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith('data: {"error"'):
                assert json.loads(line[6:])["error"]["code"] < 500, (line, body)
    else:
        r.json()


def _body(fields: dict, stream: bool) -> dict:
    messages = [{"role": "user", "content": "hi"}]
    return {"messages": messages, "max_tokens": 6, "stream": stream, **fields}


@fuzz_settings(40)
@given(fields=FIELDS, stream=st.booleans())
def test_fuzz_structured_fields(
    server: Server, innocents: Innocents, fields: dict, stream: bool
) -> None:
    _check(server, _body(fields, stream))


@pytest.mark.slow
@fuzz_settings(int(os.environ.get("LANESERVE_FUZZ_EXAMPLES", "1000")))
@given(fields=FIELDS, stream=st.booleans())
def test_fuzz_structured_fields_long(
    server: Server, innocents: Innocents, fields: dict, stream: bool
) -> None:
    _check(server, _body(fields, stream))


def test_innocents_were_unharmed(server: Server, innocents: Innocents) -> None:
    """Runs after the fuzz (file order): the streams beside it all gave their text."""
    assert innocents.done > 0 and innocents.harmed == [], innocents.harmed[:3]
    assert httpx.get(f"{server.url}/health").status_code == 200
