"""Bad input gets a clear error, and the engine keeps working afterwards."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from laneserve import LLM, SamplingParams


def test_missing_model_path() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/no/such/model")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"not a .gguf file"):
        LLM(str(f))


def test_corrupt_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANESERVE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x07" * 64)
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        LLM(str(f))


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(
        ValueError, match=r"unsupported architecture.*LlamaForCausalLM.*Qwen3ForCausalLM"
    ):
        LLM(str(tmp_path))


def test_directory_without_weights(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    shutil.copy(tiny_models["llama"] / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        LLM(str(tmp_path))


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_wrong_tensor_shape(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    d = _copy_model(tiny_models["llama"], tmp_path / "m")
    w = load_file(str(d / "model.safetensors"))
    w["model.layers.1.mlp.down_proj.weight"] = w["model.layers.1.mlp.down_proj.weight"][
        :, :-1
    ].contiguous()
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight.*expected"):
        LLM(str(d))


def test_nan_tensor(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    d = _copy_model(tiny_models["qwen2"], tmp_path / "m")
    w = load_file(str(d / "model.safetensors"))
    w["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"q_proj.weight.*NaN"):
        LLM(str(d))


def test_truncated_safetensors(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    d = _copy_model(tiny_models["qwen3"], tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors"):
        LLM(str(d))


def test_missing_tensor(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    d = _copy_model(tiny_models["llama"], tmp_path / "m")
    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.2.post_attention_layernorm.weight"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"post_attention_layernorm.weight.*missing"):
        LLM(str(d))


def test_bad_requests_fail_alone(tiny_models: dict[str, Path]) -> None:
    with LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64) as llm:
        with pytest.raises(ValueError, match="max_model_len is 64"):
            llm.generate({"prompt_token_ids": [5] * 64}, use_tqdm=False)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate({"prompt_token_ids": [5, 99999]}, use_tqdm=False)
        with pytest.raises(ValueError, match="prompt is empty"):
            llm.generate({"prompt_token_ids": []}, use_tqdm=False)
        with pytest.raises(ValueError, match="temperature"):
            llm.generate("hi", SamplingParams(temperature=-1), use_tqdm=False)
        with pytest.raises(TypeError, match="unknown engine arguments"):
            LLM(str(tiny_models["llama"]), max_num_seq=3)
        # a batch with one bad prompt is rejected whole, before anything runs
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate(
                [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7] * 80}], use_tqdm=False
            )
        out = llm.generate(
            {"prompt_token_ids": [5, 6, 7]},
            SamplingParams(max_tokens=5, temperature=0),
            use_tqdm=False,
        )
        assert len(out[0].outputs[0].token_ids) >= 1
        assert not llm.engine.has_unfinished


def test_engine_argument_validation(tiny_models: dict[str, Path]) -> None:
    d = str(tiny_models["llama"])
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(d, dtype="int3")
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds"):
        LLM(d, max_model_len=100000)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(d, num_kv_blocks=2, max_model_len=256)
    with pytest.raises(ValueError, match="speculative"):
        LLM(d, speculative_config='{"method": "eagle"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(d, speculative_config="{method")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            LLM(d, device="cuda")


def test_cli_reports_errors_cleanly() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "laneserve.entrypoints.cli",
            "generate",
            "hi",
            "--model",
            "/no/such/dir",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "error: model path '/no/such/dir' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--peers", "hf,bogus"], "unknown peers ['bogus']"),
        (["--peers", "vllm"], "--peers vllm needs --vllm-python"),
    ],
)
def test_bench_offline_rejects_bad_peers(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "laneserve.entrypoints.cli", "bench", "offline", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--holdout", "100"], "--holdout must be in [1, 64], got 100"),
        (["--num-prompts", "0"], "--num-prompts must be in [1, 15884], got 0"),
    ],
)
def test_train_mtp_rejects_bad_counts(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    """Through the command line's main in this process (a process of its own only adds
    an interpreter start; test_cli_reports_errors_cleanly runs the real process)."""
    from laneserve.entrypoints import cli

    out = str(tmp_path / "head.safetensors")
    assert cli.main(["train-mtp", "--out", out, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not Path(out).exists()


HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


def test_a_hub_id_is_told_what_is_accepted(capsys: pytest.CaptureFixture) -> None:
    """A model hub id is not a typo: the answer says what laneserve loads, that nothing
    is downloaded and how to get the model, from `LLM()` and from the command line."""
    from laneserve.entrypoints import cli

    with pytest.raises(ValueError, match="is not a local path") as info:
        LLM(HUB_ID)
    message = str(info.value)
    for part in ("a local HF model directory", ".gguf file", "downloads nothing", "download"):
        assert part in message, message
    assert cli.main(["generate", "hi", "--model", HUB_ID]) == 2
    err = capsys.readouterr().err
    assert f"error: model {HUB_ID!r} is not a local path" in err and "Traceback" not in err
    with pytest.raises(ValueError, match=r"does not exist \(laneserve loads a local HF"):
        LLM("./no/such/model")  # a path, not an id: the plain answer


def test_llm_with_a_hub_id_shows_no_laneserve_internals(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(f"from laneserve import LLM\nLLM({HUB_ID!r})\n")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1
    frames = [line for line in proc.stderr.splitlines() if line.lstrip().startswith('File "')]
    # the user's line, and LLM() raising: nothing from deeper inside laneserve
    assert len(frames) == 2 and frames[1].endswith("in __init__"), proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("laneserve.model_path.ModelPathError")


def test_a_port_in_use_is_refused_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tiny_models: dict[str, Path]
) -> None:
    import socket

    from laneserve.entrypoints import cli
    from laneserve.frontend import async_llm

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(async_llm.AsyncLLM, "__init__", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = cli.main(["serve", "--model", str(tiny_models["llama"]), "--port", str(port)])
    out = capsys.readouterr().out
    assert code == 2
    assert f"error: port {port} on 127.0.0.1 is in use" in out and "--port" in out, out


@pytest.mark.parametrize(
    ("python", "message"),
    [
        ("/no/such/python", "is not an executable file"),
        pytest.param(
            sys.executable,
            "has no vllm package",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here"
            ),
        ),
    ],
)
def test_bench_offline_checks_vllm_python_before_running(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, python: str, message: str
) -> None:
    import laneserve
    from laneserve.entrypoints import cli

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(laneserve, "LLM", no_run)
    code = cli.main(["bench", "offline", "--peers", "hf,vllm", "--vllm-python", python])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


def test_import_without_the_dependencies_says_which_python_to_use() -> None:
    """The system Python lacks laneserve's dependencies: the import error says to use
    the set-up environment (simulated by hiding tqdm from this one)."""
    code = "import sys; sys.modules['tqdm'] = None; import laneserve"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError:") and "tqdm" in last, proc.stderr
    assert "scripts/run.sh" in last and ".venv/bin/python" in last, last
