"""vLLM's `skip_tokenizer_init`, offline and in `serve`, on a checkpoint directory that
has no tokenizer files: token-id prompts give the same tokens as with the tokenizer;
text prompts, chat and stop strings are refused clearly (a 400 in the server)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from laneserve import LLM, SamplingParams

PROMPT = [5, 17, 42, 99, 3, 250]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def bare(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama checkpoint without any tokenizer file."""
    out = tmp_path_factory.mktemp("bare") / "llama"
    shutil.copytree(tiny_models["llama"], out)
    for f in out.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    assert not any("token" in f.name for f in out.iterdir())
    return out


def test_offline_token_ids_in_and_out(bare: Path, tiny_models: dict[str, Path]) -> None:
    with LLM(str(tiny_models["llama"]), dtype="float32") as llm:
        want = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    with LLM(str(bare), dtype="float32", skip_tokenizer_init=True) as llm:
        got = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="send prompts as token ids"):
            llm.generate(["some text"], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="chat needs one"):
            llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="stop strings"):
            llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(stop=["x"]), use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert got[0].outputs[0].text == ""


def test_without_the_flag_a_bare_directory_fails_clearly(bare: Path) -> None:
    with pytest.raises(Exception, match="tokenizer"):
        LLM(str(bare), dtype="float32")


@pytest.fixture(scope="module")
def server(bare: Path) -> Iterator:
    from tests.server.conftest import start_server, stop_server

    s = start_server(bare, "--skip-tokenizer-init")
    yield s
    stop_server(s)


@pytest.mark.slow
def test_serve_token_ids_and_refusals(server, tiny_models: dict[str, Path]) -> None:
    with LLM(str(tiny_models["llama"]), dtype="float32") as llm:
        want = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    ids = list(want[0].outputs[0].token_ids)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 1}  # fmt: skip
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == ids and choice["prompt_token_ids"] == PROMPT
    assert choice["text"] == "" and choice["logprobs"]["tokens"][0] == f"token_id:{ids[0]}"
    streamed: list[int] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as s:  # fmt: skip
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += c.get("token_ids") or []
    assert streamed == ids
    text = server.post("/v1/completions", {**body, "prompt": "hello"})
    assert text.status_code == 400 and "token ids" in text.json()["error"]["message"]
    chat = server.post(
        "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat.status_code == 400 and "skip_tokenizer_init" in chat.json()["error"]["message"]
    stop = server.post("/v1/completions", {**body, "stop": ["x"]})
    assert stop.status_code == 400 and "stop strings" in stop.json()["error"]["message"]
