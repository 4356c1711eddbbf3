"""GGUF file -> HF-style model directory in the cache (once per file and dtype).

The tensors are dequantized with the `gguf` package, renamed to HF names, the
llama.cpp q/k row permutation is undone (llama / mistral only), and the result
is saved as safetensors next to an HF `config.json` and the tokenizer that
transformers builds from the GGUF metadata. Later starts load the directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from laneserve.model.arch import GGUF_ARCHITECTURES, SUPPORTED_ARCHITECTURES, UnsupportedModelError
from laneserve.paths import cache_root

log = logging.getLogger(__name__)

_CONVERSION_VERSION = 1
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def content_key(path: Path, sample_bytes: int = 1 << 20, samples: int = 8) -> str:
    """A key for the file's content, not its name or mtime: the size and a hash of the
    header and of evenly spaced samples (a reinstall of the same file keeps its key)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        for i in range(samples + 1):
            f.seek(0 if i == 0 else size * i // (samples + 1))
            h.update(f.read(sample_bytes))
    return h.hexdigest()[:16]


def converted_dir(gguf_path: Path, dtype: torch.dtype) -> Path:
    """The cache directory for this file's content and dtype, converting it if needed."""
    dtype_name = str(dtype).removeprefix("torch.")
    key = f"{gguf_path.stem}-{content_key(gguf_path)}-{dtype_name}-v{_CONVERSION_VERSION}"
    out = cache_root() / "gguf" / key
    if (out / "complete").exists():
        return out
    remove_stale_partials(out.parent)
    log.info("converting %s to %s safetensors (first start only) -> %s", gguf_path, dtype_name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    try:
        _convert(gguf_path, tmp, dtype)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "complete").write_text("ok\n")
    if out.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)
    log.info("converted in %.1f s", time.perf_counter() - start)
    return out


def remove_stale_partials(folder: Path) -> list[Path]:
    """Delete conversions left half-done by a process that no longer runs."""
    removed = []
    for tmp in folder.glob("*.tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[1]
        if pid.isdigit() and _alive(int(pid)):
            continue  # another process is converting right now
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _convert(path: Path, out: Path, dtype: torch.dtype) -> None:
    import gguf
    from safetensors.torch import save_file

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from None
    config = _hf_config(reader)
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", leave=False):
        name = _hf_name(t.name)
        if name is None:
            continue
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ValueError(f"GGUF tensor {t.name} in {path} is corrupt: {e}") from None
        array = np.asarray(array, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if config["model_type"] in ("llama", "mistral") and name.endswith(
            ("q_proj.weight", "k_proj.weight")
        ):
            heads = config["num_attention_heads"]
            if name.endswith("k_proj.weight"):
                heads = config["num_key_value_heads"]
            array = _unpermute(array, heads)
        tensors[name] = torch.from_numpy(np.array(array, copy=True)).to(dtype)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    _save_tokenizer(path, out)


def _hf_config(reader) -> dict:
    fields = {
        k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")
    }
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; laneserve supports "
            f"{sorted(GGUF_ARCHITECTURES)} (HF: {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    hidden = int(fields[f"{arch}.embedding_length"])
    heads = int(fields[f"{arch}.attention.head_count"])
    tok = reader.fields
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(fields[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(fields[f"{arch}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(fields.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length", 2048)),
        "vocab_size": int(
            fields.get(f"{arch}.vocab_size") or len(tok["tokenizer.ggml.tokens"].data)
        ),
        "hidden_act": "silu",
        "dtype": "bfloat16",
    }
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        field = tok.get(f"tokenizer.ggml.{key}")
        if field is not None:
            config[hf_key] = int(_field_value(field))
    if arch == "qwen2":
        config["attention_bias"] = True
    return config


def _field_value(field):
    value = field.contents()
    return value


def _hf_name(gguf_name: str) -> str | None:
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        hf = _LAYER_NAMES.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    hf = _TOP_NAMES.get(stem)
    return None if hf is None else f"{hf}.{kind}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleave of q/k projections."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _save_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
