"""`laneserve bench quality` (laneserve/bench/bench_quality.py, quality_metrics.py):
perplexity over llama-perplexity's windows, checked against transformers' fp32 NLL on the
same windows; the exact mode's KL to the reference is 0 and q8-dot's is not; bad inputs
fail before (or instead of) a measurement, with messages that say what is wrong."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from laneserve.bench import bench_quality as bq
from laneserve.bench.quality_metrics import Scores, windows
from laneserve.engine_args import EngineArgs
from laneserve.entrypoints.cli import build_parser
from laneserve.entrypoints.cli import main as cli_main
from laneserve.kernels import get_kernels
from tests.tiny_models import CORPUS, build_tiny_model, write_tiny_gguf

N_CTX = 48
TEXT = " ".join(CORPUS)  # ~1000 tokens of the tiny tokenizer: several windows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quality")
    hf = build_tiny_model(root / "hf", "llama", seed=11, tie=True)
    (root / "file").mkdir()
    quant = {"proj.weight": "Q4_1", "embed_tokens.weight": "Q8_0"}
    gguf = write_tiny_gguf(hf, root / "file" / "tiny.gguf", "llama", quant)
    return {"hf": hf, "gguf": gguf}


def _hf_nll(model_dir: Path, text: str, n_ctx: int, limit: int) -> list[float]:
    """transformers fp32 NLL of every scored token (second half of each window)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out: list[float] = []
    for w in range(min(len(ids) // n_ctx, limit)):
        x = torch.tensor([ids[w * n_ctx : (w + 1) * n_ctx]])
        with torch.no_grad():
            lp = torch.log_softmax(model(x).logits[0].double(), dim=-1)
        first = n_ctx // 2
        for p in range(first, n_ctx - 1):
            out.append(-float(lp[p, x[0, p + 1]]))
    return out


def test_perplexity_equals_transformers_and_exact_kl_is_zero(tiny: dict[str, Path]) -> None:
    result = bq.measure(EngineArgs(model=str(tiny["hf"])), ["exact", "bf16"], TEXT, N_CTX, 4)
    assert result["windows"] == 4 and result["scored_tokens"] == 4 * (N_CTX - 1 - N_CTX // 2)
    nll = _hf_nll(tiny["hf"], TEXT, N_CTX, 4)
    assert len(nll) == result["scored_tokens"]
    expected = math.exp(sum(nll) / len(nll))
    rows = result["rows"]
    ref, exact = rows["exact (reference)"], rows["exact"]
    assert ref["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert (exact["mean_kl"], exact["max_kl"], exact["same_top_pct"]) == (0.0, 0.0, 100.0)
    assert exact["perplexity"] == ref["perplexity"]
    # bf16 weights: a different computation, so its KL is positive (it engaged)
    assert rows["bf16"]["mean_kl"] > 0.0


def test_the_command_on_a_gguf_scores_every_mode(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default modes of a GGUF file (exact, default, q8-dot), end to end through the
    command line: exit 0, finite perplexities, KL 0 for exact and > 0 for q8-dot."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    argv = ["bench", "quality", "--text", str(text), "--model", str(tiny["gguf"])]
    assert cli_main([*argv, "--ctx-size", str(N_CTX), "--chunks", "2"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    rows = result["rows"]
    assert list(rows) == ["exact (reference)", "exact", "default", "q8-dot"]
    assert all(math.isfinite(r["perplexity"]) for r in rows.values())
    assert "| q8-dot |" in err and "| default |" in err
    # the default is q8-dot where the CPU kernels have VNNI, else the exact path
    vnni = getattr(get_kernels(torch.device("cpu")), "vnni", False)
    want = "q8 activations" if vnni else "fp32 activations"
    assert rows["default"]["numerics"] == f"bfloat16, GGUF weights quantized, {want}"
    assert rows["exact"]["mean_kl"] == 0.0
    q8 = rows["q8-dot"]
    # each engine ran the numerics it names (the GGUF kept quantized in both)
    assert rows["exact"]["numerics"] == "float32, GGUF weights quantized, fp32 activations"
    assert q8["numerics"].endswith("GGUF weights quantized, q8 activations"), q8
    assert 0.0 < q8["mean_kl"] < 0.05 and abs(q8["delta_ppl_pct"]) < 5.0, q8


def test_windows_follow_llama_perplexity() -> None:
    toks = list(range(10, 31))  # 21 tokens: two windows of 8, the tail of 5 dropped
    assert windows(toks, 8, None, None) == [toks[:8], toks[8:16]]
    assert windows(toks, 8, 1, None) == [[1, *toks[1:8]], [1, *toks[9:16]]]
    assert windows(toks, 8, None, 1) == [toks[:8]]
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(toks, 32, None, None)
    with pytest.raises(ValueError, match="--chunks"):
        windows(toks, 8, None, 0)


def test_scores_of_a_hand_computed_example() -> None:
    """Two positions, a vocabulary of 2, values worked out by hand:
    reference p = (1/2, 1/2) and (3/4, 1/4); mode q = (1/4, 3/4) and (3/4, 1/4).
    Position 0: KL = 1/2 ln(2) + 1/2 ln(2/3) = 1/2 ln(4/3); its target 1 has q = 3/4.
    Position 1: the same distribution, KL = 0; its target 0 has q = 3/4.
    Mean NLL = ln(4/3), so the perplexity is 4/3; mean KL = 1/4 ln(4/3)."""
    ref = torch.tensor([[0.5, 0.5], [0.75, 0.25]]).log()
    mode = torch.tensor([[0.25, 0.75], [0.75, 0.25]]).log()
    s = Scores()
    s.add(mode, torch.tensor([1, 0]), ref)
    assert s.count == 2
    assert s.perplexity == pytest.approx(4 / 3, rel=1e-6)
    assert s.mean_kl == pytest.approx(0.25 * math.log(4 / 3), rel=1e-6)
    assert s.kl_max == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert s.same_top == 1  # position 0: argmax 0 (a tie, first index) vs 1
    # both NLLs equal: no spread, so no uncertainty
    assert s.perplexity_error == pytest.approx(0.0, abs=1e-6)
    row = s.row(reference_ppl=1.0)
    assert row["delta_ppl_pct"] == pytest.approx(100 / 3, rel=1e-6)
    # a zero reference probability contributes nothing (not NaN), as in llama.cpp
    zero = Scores()
    zero.add(mode[:1], torch.tensor([1]), torch.tensor([[0.0, float("-inf")]]))
    assert zero.mean_kl == pytest.approx(math.log(4), rel=1e-6)


def test_scores_match_the_formulas() -> None:
    torch.manual_seed(0)
    ref = torch.log_softmax(torch.randn(5, 7), dim=-1)
    mode = torch.log_softmax(torch.randn(5, 7), dim=-1)
    targets = torch.tensor([0, 3, 6, 2, 2])
    s = Scores()
    s.add(mode, targets, ref)
    nll = [-float(mode[i, t]) for i, t in enumerate(targets.tolist())]
    assert s.perplexity == pytest.approx(math.exp(sum(nll) / 5), rel=1e-12)
    kl = [float((ref[i].exp() * (ref[i] - mode[i])).sum()) for i in range(5)]
    assert s.mean_kl == pytest.approx(sum(kl) / 5, rel=1e-6)
    assert s.kl_max == pytest.approx(max(kl), rel=1e-6)
    assert s.same_top == int((mode.argmax(1) == ref.argmax(1)).sum())


def _run(argv: list[str]) -> int:
    ns = build_parser().parse_args(["bench", "quality", *argv])
    return ns.func(ns)


def test_bad_inputs_are_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        _run(["--text", str(tmp_path / "missing.txt")])
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n")
    with pytest.raises(ValueError, match="is empty"):
        _run(["--text", str(empty)])
    bad = tmp_path / "ids.txt"
    bad.write_text("1 2 three")
    with pytest.raises(ValueError, match="not a list of token ids"):
        _run(["--token-ids", str(bad)])
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    with pytest.raises(ValueError, match="unknown modes"):
        _run(["--text", str(text), "--modes", "exact,fp4"])
    with pytest.raises(ValueError, match="GGUF files only"):
        _run(["--text", str(text), "--modes", "q8-dot", "--model", str(tmp_path)])
    with pytest.raises(SystemExit):  # one input, not both
        _run(["--text", str(text), "--token-ids", str(bad)])


def test_default_modes_follow_the_model() -> None:
    assert bq.parse_modes(None, None) == ["exact", "default", "q8-dot"]  # the embedded GGUF
    assert bq.parse_modes(None, "m.gguf") == ["exact", "default", "q8-dot"]
    assert bq.parse_modes(None, "hf-dir") == ["exact", "default", "bf16"]


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        (None, [], "does not exist"),
        ("", [], "is empty"),
        ("The old lighthouse.", [], "fewer than one window"),
        (TEXT, ["--modes", "exact,fp4"], "unknown modes"),
    ],
    ids=["missing", "empty", "too-short", "unknown-mode"],
)
def test_bad_input_exits_nonzero_with_a_message(
    tiny: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    extra: list[str],
    message: str,
) -> None:
    path = tmp_path / "input.txt"
    if content is not None:
        path.write_text(content)
    argv = ["bench", "quality", "--text", str(path), "--model", str(tiny["hf"]), *extra]
    rc = cli_main([*argv, "--ctx-size", str(N_CTX)])
    err = capsys.readouterr().err
    assert rc == 2 and "error: " in err and message in err, (rc, err)


def test_bad_input_exit_code_of_the_installed_command(tmp_path: Path) -> None:
    """The process itself (not only main()'s return value) exits non-zero."""
    import subprocess
    import sys

    missing = tmp_path / "missing.txt"
    cmd = [sys.executable, "-m", "laneserve.entrypoints.cli", "bench", "quality"]
    proc = subprocess.run(
        [*cmd, "--text", str(missing)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    assert f"input file {str(missing)!r} does not exist" in proc.stderr


def test_bad_inputs_found_with_the_model(tiny: dict[str, Path], tmp_path: Path) -> None:
    model = ["--model", str(tiny["hf"]), "--modes", "exact"]
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    with pytest.raises(ValueError, match="--ctx-size 1024 is larger than the model's context"):
        _run(["--text", str(text), "--ctx-size", "1024", *model])
    short = tmp_path / "short.txt"
    short.write_text("The old lighthouse.")
    with pytest.raises(ValueError, match="fewer than one window"):
        _run(["--text", str(short), *model])
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([5, 9, 100000]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _run(["--token-ids", str(ids), *model])


def test_token_ids_file_and_table(
    tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(5 + i % 200) for i in range(2 * N_CTX + 3)))
    argv = ["--token-ids", str(ids), "--model", str(tiny["hf"]), "--modes", "exact"]
    assert _run([*argv, "--ctx-size", str(N_CTX)]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["windows"] == 2 and result["rows"]["exact"]["mean_kl"] == 0.0
    assert "| exact (reference) |" in err and "| exact |" in err
