"""vLLM's engine flags: accepted with the values that describe what laneserve does,
refused with the reason otherwise (engine_compat.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from laneserve.engine_args import EngineArgs
from laneserve.engine_compat import check_vllm_flags, checkpoint_quantization

OK = {
    "kv_cache_dtype": "auto",
    "quantization": None,
    "load_format": "auto",
    "enable_chunked_prefill": None,
    "max_logprobs": 20,
}


def fp8_checkpoint(tmp_path: Path) -> str:
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_accepted_values(tmp_path: Path) -> None:
    check_vllm_flags("m.gguf", **{**OK, "quantization": "gguf", "load_format": "gguf"})
    check_vllm_flags(None, **{**OK, "quantization": "gguf"})  # the embedded GGUF model
    check_vllm_flags(fp8_checkpoint(tmp_path), **{**OK, "quantization": "fp8"})
    check_vllm_flags(
        str(tmp_path), **{**OK, "load_format": "safetensors", "enable_chunked_prefill": True}
    )
    check_vllm_flags(str(tmp_path), **{**OK, "max_logprobs": 0})


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"kv_cache_dtype": "fp8"}, "keeps the KV cache in the model's dtype"),
        ({"quantization": "awq"}, "does not quantize at load time"),
        ({"quantization": "gguf"}, "not quantized"),
        ({"load_format": "pt"}, "loads safetensors"),
        ({"load_format": "gguf"}, "loads safetensors"),
        ({"enable_chunked_prefill": False}, "always prefills long prompts in chunks"),
        ({"max_logprobs": 21}, "at most 20"),
        ({"max_logprobs": -1}, "at most 20"),
    ],
)
def test_refused_values_say_why(tmp_path: Path, change: dict, fragment: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"not supported|cannot|must") as e:
        check_vllm_flags(str(tmp_path), **{**OK, **change})
    assert fragment in str(e.value)


def test_fp8_checkpoint_refuses_another_method(tmp_path: Path) -> None:
    model = fp8_checkpoint(tmp_path)
    assert checkpoint_quantization(model) == "fp8"
    with pytest.raises(ValueError, match="this checkpoint is fp8"):
        check_vllm_flags(model, **{**OK, "quantization": "gptq"})


def test_a_vllm_launch_line_parses() -> None:
    """The flags of a vLLM docs-style launch line all parse into EngineArgs."""
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    line = (
        "--dtype float32 --max-model-len 256 --disable-log-stats --enable-chunked-prefill "
        "--swap-space 16 --kv-cache-dtype auto --max-logprobs 5 --load-format safetensors "
        "--quantization fp8 --max-num-seqs 8 --gpu-memory-utilization 0.9"
    )
    args = EngineArgs.from_cli(parser.parse_args(line.split()))
    assert args.swap_space == 16 and args.max_logprobs == 5 and args.disable_log_stats
    assert args.enable_chunked_prefill is True and args.quantization == "fp8"
