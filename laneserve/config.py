"""Frozen, typed engine configuration with vLLM's flag names.

`EngineArgs` is what users give (CLI flags, `LLM(...)` keywords); it is
resolved once into an `EngineConfig` of frozen parts. Values the engine learns
at run time (the number of KV blocks) come back from the worker handshake and
are not stored here.
"""

from __future__ import annotations

import ast
import json
import os

import msgspec

DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
WORKER_MODES = ("thread", "process")
# GGUF linear weights: kept in their quantized blocks (CPU kernels; "quantized" multiplies
# them in exact fp32, "q8-dot" rounds the activations to int8 per 32 for integer dot
# products) or dequantized to dtype; "auto": q8-dot where the CPU has AVX-512 VNNI and the
# dtype is not an explicit float32, else quantized (model/loader.py resolve_gguf_weights)
GGUF_WEIGHTS = ("auto", "quantized", "q8-dot", "dequantized")
# A checkpoint's block-scaled fp8 / MXFP4 linear weights (DeepSeek V3 / V4): kept resident
# as stored (kernels/scaled.py) or dequantized to dtype at load; auto: resident where the
# CPU kernels multiply them natively, else dequantized
QUANTIZED_WEIGHTS = ("auto", "resident", "dequantized")
DEFAULT_MAX_N = 128  # most choices (prompts x n) in one server request
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # `laneserve serve`: larger HTTP bodies are refused


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str  # HF directory or .gguf file (resolved: never empty)
    tokenizer: str | None = None
    dtype: str = "auto"  # as requested; the loader resolves "auto"
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's own limit
    seed: int = 0
    use_kernels: bool = True  # CPU C++ kernels when they build
    chat_template: str | None = None  # a file, or the template itself (None: the model's)
    tokenizer_mode: str = "auto"  # chat format: auto (by architecture), hf (Jinja) or a name
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts and outputs only
    generation_config: str = "vllm"  # "auto": the model's generation_config.json defaults
    gguf_weights: str = "auto"  # one of GGUF_WEIGHTS (CPU only; see docs/kernels.md)
    quantized_weights: str = "auto"  # one of QUANTIZED_WEIGHTS (docs/models.md)
    enforce_eager: bool = False  # CUDA: no decode graphs (CPU always runs eagerly)
    max_logprobs: int = 20  # most logprobs / prompt_logprobs per request (--max-logprobs)


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    block_size: int = 16
    kv_cache_memory_gib: float = 2.0  # budget for all KV blocks
    num_kv_blocks: int | None = None  # explicit block count (wins over the budget)
    # CUDA: fraction of device memory for weights + KV (wins over kv_cache_memory_gib)
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    async_scheduling: bool = True
    max_queued_requests: int | None = None


# Default prompt-lookup suffix lengths (n-gram drafts, ngram_first; the MTP trainer's
# --lookup-weight positions use the same search).
PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX = 2, 4


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    method: str  # "mtp" | "ngram"
    num_speculative_tokens: int = 1
    draft_weights: str | None = None  # MTP: separate safetensors file
    prompt_lookup_min: int = PROMPT_LOOKUP_MIN  # n-gram (and ngram_first): shortest suffix
    prompt_lookup_max: int = PROMPT_LOOKUP_MAX  # n-gram (and ngram_first): longest suffix
    # MTP: a prompt lookup (as method "ngram") drafts first; the head drafts for the rows
    # where the last tokens occurred nowhere earlier in prompt + output
    ngram_first: bool = False
    # no drafts in a step where this many requests are running (vLLM's
    # speculative_disable_by_batch_size): on a compute-bound device verifying
    # drafts of a large batch costs more than the accepted tokens save
    disable_by_batch_size: int | None = None
    # vLLM's tree literal, e.g. "[(0,), (1,), (2,)]": the head's top-3 tokens as
    # alternatives for the first draft (verified in the same forward); a chain of
    # zeros under the first child ("(0, 0)", ...) drafts further positions.
    speculative_token_tree: str | None = None
    # MTP: weight-only quantization of the head's linears at load ("int8": per output
    # row, symmetric; the drafts change slightly, the verified output never does)
    quantization: str | None = None

    @property
    def depth(self) -> int:
        """Draft positions per step (the scheduler's k): the tree's depth."""
        shape = self.tree_shape
        return shape[1] if shape else self.num_speculative_tokens

    @property
    def num_candidates(self) -> int:
        """Alternatives for the first draft position (the tree's width at the root)."""
        shape = self.tree_shape
        return shape[0] if shape else 1

    @property
    def tree_shape(self) -> tuple[int, int] | None:
        """(width at the root, depth) of the token tree; None without one."""
        tree = self.speculative_token_tree
        return None if tree is None else token_tree_shape(tree)

    @property
    def tree(self) -> bool:
        return self.speculative_token_tree is not None

    @staticmethod
    def parse(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the JSON of `--speculative-config` or an `LLM(...)` dict."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {value!r}")
        known = {f for f in SpeculativeConfig.__struct_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative config keys {unknown}; known keys: {sorted(known)}"
            )
        if "method" not in value:
            raise ValueError('speculative config needs "method": "mtp" or "ngram"')
        tree = value.get("speculative_token_tree")
        if isinstance(tree, str) and "num_speculative_tokens" not in value:
            value = {**value, "num_speculative_tokens": token_tree_nodes(tree)}
        try:
            cfg = msgspec.convert(value, SpeculativeConfig)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid speculative config: {e}") from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in ("mtp", "ngram"):
            raise ValueError(f'speculative method must be "mtp" or "ngram", got {self.method!r}')
        if not self.tree and not 1 <= self.num_speculative_tokens <= 8:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 8], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )
        if self.method == "ngram" and self.draft_weights is not None:
            raise ValueError('"draft_weights" only applies to method "mtp"')
        if self.quantization is not None:
            if self.method != "mtp":
                raise ValueError('"quantization" only applies to method "mtp"')
            if self.quantization != "int8":  # kernels.QUANTIZATIONS
                raise ValueError(f'unknown quantization {self.quantization!r}; supported: "int8"')
        if self.ngram_first and self.method != "mtp":
            raise ValueError('"ngram_first" only applies to method "mtp"')
        shape = self.tree_shape
        if shape is not None:
            self._validate_tree(*shape)

    def _validate_tree(self, width: int, depth: int) -> None:
        nodes = width + depth - 1
        if self.num_speculative_tokens != nodes:
            raise ValueError(
                f"num_speculative_tokens ({self.num_speculative_tokens}) must equal the number "
                f"of nodes of speculative_token_tree ({nodes})"
            )
        if width > 1 and self.method != "mtp":
            raise ValueError('a speculative_token_tree with alternatives needs method "mtp"')
        if not (1 <= width <= 8 and depth <= 8):
            raise ValueError("speculative_token_tree: at most 8 alternatives and depth 8")


# One line per key for `--speculative-config --help` (a test keeps it complete).
SPECULATIVE_KEYS = {
    "method": "required: mtp | ngram",
    "num_speculative_tokens": "draft tokens per step, 1..8",
    "draft_weights": "MTP head .safetensors; default: the checkpoint's own or the shipped one",
    "prompt_lookup_min": "shortest suffix an n-gram lookup matches",
    "prompt_lookup_max": "longest suffix an n-gram lookup matches",
    "ngram_first": "MTP: prompt-lookup drafts where found, the head's elsewhere",
    "disable_by_batch_size": "no drafts while this many requests run; default: no limit",
    "speculative_token_tree": 'MTP alternatives, e.g. "[(0,), (1,), (0, 0)]"; default: a chain',
    "quantization": 'MTP head weights: "int8"; default: as loaded',
}


def speculative_keys_help() -> str:
    """`key (what, default)` for every SpeculativeConfig field."""
    parts = []
    for f in msgspec.structs.fields(SpeculativeConfig):
        shown = f.default not in (msgspec.NODEFAULT, None)  # else the text says it
        default = f"; default {json.dumps(f.default)}" if shown else ""
        parts.append(f"{f.name} ({SPECULATIVE_KEYS[f.name]}{default})")
    return "keys: " + ", ".join(parts)


def token_tree_nodes(tree: str) -> int:
    return sum(token_tree_shape(tree)) - 1


def token_tree_shape(tree: str) -> tuple[int, int]:
    """(width at the root, depth) of a vLLM tree literal of the supported shape: root
    children (0,) .. (w-1,) plus a chain (0, 0), (0, 0, 0), ... under the first child."""
    hint = 'e.g. "[(0,), (1,), (2,)]" or "[(0,), (1,), (0, 0)]"'
    try:
        nodes = ast.literal_eval(tree)
        paths = sorted({tuple(int(i) for i in n) for n in nodes}, key=lambda t: (len(t), t))
        ok = len(paths) == len(nodes) and all(len(p) >= 1 for p in paths)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        ok = False
    if not ok:
        raise ValueError(f"speculative_token_tree must be a list of index tuples, {hint}")
    width = sum(len(p) == 1 for p in paths)
    depth = max(len(p) for p in paths)
    want = [(i,) for i in range(width)] + [(0,) * d for d in range(2, depth + 1)]
    if paths != want:
        raise ValueError(
            "speculative_token_tree: only alternatives at the root and a chain under the "
            f"first child are supported, {hint}; got {tree!r}"
        )
    return width, depth


def default_worker_mode() -> str:
    """$LANESERVE_WORKER_MODE when set (e.g. "thread" to keep the model in the calling
    process), else "process": the fastest mode measured (docs/async.md)."""
    return os.environ.get("LANESERVE_WORKER_MODE") or WorkerConfig().mode


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    # "process": the model lives in a spawned worker process; "thread": in this
    # process (same lanes, no IPC). Both the offline LLM and `serve` default to
    # "process" (docs/async.md compares them).
    mode: str = "process"  # one of WORKER_MODES
    restart_on_failure: bool = True
    profile_dir: str | None = None
    num_threads: int | None = None  # torch intra-op threads in the worker
    lane_times: bool = False  # each StepResult carries its lanes' spans (the dashboard)


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    tensor_parallel_size: int = 1  # ranks per model (docs/distributed.md)
    distributed_executor_backend: str = "mp"  # rank processes spawned by the worker
    # machines the ranks are spread over: tensor_parallel_size / nnodes tensor-parallel
    # ranks each, or (expert parallelism) data_parallel_size / nnodes data-parallel ranks
    nnodes: int = 1
    node_rank: int = 0  # this machine's index; node 0 runs the engine and rank 0
    master_addr: str = "127.0.0.1"  # node 0's address, where the ranks meet
    # node 0's rendezvous port (several nodes only): the tensor-parallel group's, or the
    # engine's store where remote data-parallel ranks meet it
    master_port: int = 29501

    # data parallelism: engine cores (scheduler + KV cache + worker) in this engine,
    # each request routed to one of them (docs/distributed.md#data-parallelism)
    data_parallel_size: int = 1
    data_parallel_rank: int = 0  # set per rank by the engine: the worker's own index
    # expert parallelism: the routed experts divided over the data-parallel ranks, which
    # then step in lock step (docs/distributed.md#expert-parallelism)
    enable_expert_parallel: bool = False
    data_parallel_master_port: int = 0  # set by the engine: where the ranks' group meets

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the routed experts are divided over (1: every rank holds them all)."""
        return self.data_parallel_size if self.enable_expert_parallel else 1

    @property
    def data_parallel_over_nodes(self) -> bool:
        """The data-parallel ranks are spread over the machines (not the tensor ranks)."""
        return self.nnodes > 1 and self.data_parallel_size > 1

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks per node."""
        if self.data_parallel_over_nodes:
            return self.tensor_parallel_size
        return self.tensor_parallel_size // self.nnodes

    def node_ranks(self) -> range:
        """The global tensor-parallel ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def dp_ranks_per_node(self) -> int:
        """Data-parallel ranks per node (all of them on one machine)."""
        if self.data_parallel_over_nodes:
            return self.data_parallel_size // self.nnodes
        return self.data_parallel_size

    @property
    def experts_addr(self) -> str:
        """Where the data-parallel ranks' expert group meets: node 0 across machines."""
        return self.master_addr if self.data_parallel_over_nodes else "127.0.0.1"

    def node_dp_ranks(self) -> range:
        """The data-parallel ranks this node runs."""
        first = self.node_rank * self.dp_ranks_per_node
        return range(first, first + self.dp_ranks_per_node)


def _validate_nodes(p: ParallelConfig) -> None:
    if p.nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {p.nnodes}")
    if not 0 <= p.node_rank < p.nnodes:
        raise ValueError(
            f"node_rank must be in [0, nnodes - 1 = {p.nnodes - 1}], got {p.node_rank}"
        )
    if p.data_parallel_over_nodes:
        _validate_dp_nodes(p)
    elif p.tensor_parallel_size % p.nnodes:
        raise ValueError(
            f"tensor_parallel_size {p.tensor_parallel_size} does not divide over nnodes "
            f"{p.nnodes} (each node runs the same number of ranks)"
        )
    if not 0 < p.master_port < 65536:
        raise ValueError(f"master_port must be a TCP port (1..65535), got {p.master_port}")


def _validate_dp_nodes(p: ParallelConfig) -> None:
    if not p.enable_expert_parallel:
        raise ValueError(
            f"data_parallel_size {p.data_parallel_size} over nnodes {p.nnodes} runs with "
            "--enable-expert-parallel only (without it the ranks are independent replicas: "
            "run one laneserve per machine behind a load balancer)"
        )
    if p.data_parallel_size % p.nnodes:
        raise ValueError(
            f"data_parallel_size {p.data_parallel_size} does not divide over nnodes "
            f"{p.nnodes} (each node runs the same number of data-parallel ranks)"
        )


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig | None = None
    worker: WorkerConfig = WorkerConfig()
    parallel: ParallelConfig = ParallelConfig()

    def validate(self) -> None:
        m, c, s = self.model, self.cache, self.scheduler
        self._validate_parallel()
        if m.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {m.dtype!r}")
        if m.gguf_weights not in GGUF_WEIGHTS:
            raise ValueError(f"gguf_weights must be one of {GGUF_WEIGHTS}, got {m.gguf_weights!r}")
        if m.quantized_weights not in QUANTIZED_WEIGHTS:
            raise ValueError(
                f"quantized_weights must be one of {QUANTIZED_WEIGHTS}, got {m.quantized_weights!r}"
            )
        if m.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {m.device!r}")
        if m.max_model_len is not None and m.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {m.max_model_len}")
        if c.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {c.block_size}")
        if c.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {c.kv_cache_memory_gib}")
        if c.gpu_memory_utilization is not None and not 0 < c.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}"
            )
        if c.num_kv_blocks is not None and c.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {c.num_kv_blocks}")
        if s.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {s.max_num_seqs}")
        if s.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {s.max_num_batched_tokens}")
        if self.worker.mode not in WORKER_MODES:
            raise ValueError(f'worker mode must be "thread" or "process", got {self.worker.mode!r}')
        if self.speculative is not None:
            self.speculative.validate()

    def _validate_parallel(self) -> None:
        p = self.parallel
        for name in ("tensor_parallel_size", "data_parallel_size", "data_parallel_rank"):
            value = getattr(p, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if p.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {p.data_parallel_size}")
        if not 0 <= p.data_parallel_rank < p.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be in [0, {p.data_parallel_size}), "
                f"got {p.data_parallel_rank}"
            )
        if p.data_parallel_size > 1 and p.tensor_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 with tensor_parallel_size > 1 is not supported yet: "
                "use one of them"
            )
        if p.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {p.tensor_parallel_size}")
        self._validate_experts()
        if p.distributed_executor_backend != "mp":
            raise ValueError(
                f"distributed_executor_backend must be 'mp', got {p.distributed_executor_backend!r}"
            )
        _validate_nodes(p)
        if p.tensor_parallel_size > 1 and self.model.quantized_weights == "resident":
            raise ValueError(
                'quantized_weights "resident" with tensor_parallel_size > 1 is not supported: '
                "each rank cuts its shard from dequantized weights"
            )
        if p.tensor_parallel_size > 1 and self.worker.mode != "process":
            raise ValueError(
                "tensor_parallel_size > 1 runs in worker processes (worker mode 'process')"
            )
        if p.tensor_parallel_size > 1 and self.speculative and self.speculative.tree:
            raise ValueError(
                "speculative_token_tree with tensor_parallel_size > 1 is not supported yet "
                "(chains of drafts are: n-gram, and MTP where the family's draft head is sharded)"
            )

    def _validate_experts(self) -> None:
        p = self.parallel
        if not isinstance(p.enable_expert_parallel, bool):
            raise ValueError(
                f"enable_expert_parallel must be a boolean, got {p.enable_expert_parallel!r}"
            )
        if p.expert_parallel_size == 1:
            return
        if self.worker.mode != "process":
            raise ValueError(
                "enable_expert_parallel with data_parallel_size > 1 runs the ranks in worker "
                "processes (worker mode 'process')"
            )
        if self.speculative and self.speculative.tree:
            raise ValueError(
                "speculative_token_tree with enable_expert_parallel is not supported "
                "(chains of drafts are)"
            )
