"""GGUF files of the qwen2 / qwen3 / mistral architectures (tiny ones, written here
as llama.cpp writes them): laneserve's greedy output == transformers on the HF
checkpoint the file was made from (fp32), and the tokenizer read from the file
encodes as the original does. transformers reading the same file checks the writer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from laneserve.model import gguf as gguf_mod
from tests.tiny_models import build_tiny_model, hf_greedy, write_tiny_gguf

# case -> (builder family, seed, tied embeddings, GGUF architecture, laneserve architecture)
CASES = {
    "qwen2": ("qwen2", 2, False, "qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3-gguf", 3, True, "qwen3", "Qwen3ForCausalLM"),
    "mistral": ("mistral", 5, False, "mistral", "MistralForCausalLM"),
    # most Mistral GGUFs in the wild say "llama": the same math within the window
    "mistral-as-llama": ("mistral", 5, False, "llama", "LlamaForCausalLM"),
}
N = 20
TEXT = "The old lighthouse stood, Zürich 東京 🙂<|im_end|>"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(HF checkpoint, GGUF file) per case, each file alone in its directory."""
    root = tmp_path_factory.mktemp("gguf")
    built: dict[str, Path] = {}
    out = {}
    for case, (family, seed, tie, arch, _) in CASES.items():
        if family not in built:
            built[family] = build_tiny_model(root / "hf" / family, family, seed=seed, tie=tie)
        (root / case).mkdir()
        out[case] = (
            built[family],
            write_tiny_gguf(built[family], root / case / f"{case}.gguf", arch),
        )
    return out


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(2, 18))] for _ in range(n)]


@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v[3] != "mistral"])
def test_transformers_reads_the_written_file_as_the_original(files: dict, case: str) -> None:
    """The writer is right: transformers' own GGUF reader gives the original's output
    (its gguf-py knows no "mistral" architecture, so that case relies on the others)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    hf_dir, gguf_file = files[case]
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    cfg = GenerationConfig(do_sample=False, max_new_tokens=N, eos_token_id=None, pad_token_id=0)
    for p in prompts(2, seed=1):
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        assert out[0, len(p) :].tolist() == hf_greedy(hf_dir, p, N)
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    assert tok.encode(TEXT) == AutoTokenizer.from_pretrained(str(hf_dir)).encode(TEXT)


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_greedy_matches_transformers(
    files: dict, case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    # conversions go to a temporary directory (the compiled kernels stay where they are)
    monkeypatch.setattr(gguf_mod, "cache_root", lambda: tmp_path / "cache")
    hf_dir, gguf_file = files[case]
    batch = prompts(4, seed=2)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    with LLM(str(gguf_file), dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        converted = json.loads((llm.engine.model_dir / "config.json").read_text())
        encoded = llm.get_tokenizer().encode(TEXT)
    assert converted["architectures"] == [CASES[case][4]]
    assert encoded == AutoTokenizer.from_pretrained(str(hf_dir)).encode(TEXT)
    for p, o in zip(batch, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_dir, p, N), f"{case}: {len(p)} tokens"
