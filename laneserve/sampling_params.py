"""Sampling parameters with vLLM's field names.

`temperature=0` means greedy. Every invalid value raises ValueError with a
message that names the field, the value and the allowed range. The struct is a
msgspec Struct so it crosses the engine/worker boundary as it is.
"""

from __future__ import annotations

import enum

import msgspec

from laneserve.structured.params import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]


class RequestOutputKind(enum.IntEnum):
    """What `LLM.llm_engine.step()` returns for a request (vLLM's names): everything so
    far, only what is new since the last step, or only the finished output.
    `LLM.generate` / `LLM.chat` return finished outputs whatever this says (as vLLM)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_MAX_LOGPROBS = 20
_MAX_BIAS = 100.0  # OpenAI's range for logit_bias values
# NOTE: the params cross to the worker as msgpack (64-bit integers) and land in
# int64 tensors / torch generators: every integer is bounded so that no value can
# fail there, far from the client that sent it.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample one request (vLLM semantics).

    Penalties: `repetition_penalty` (HF/vLLM style, over prompt and output
    tokens: positive logits are divided by it, negative ones multiplied),
    `presence_penalty` and `frequency_penalty` (OpenAI style, over output
    tokens: logit -= presence * [count > 0] + frequency * count).
    `logit_bias` (OpenAI): token id -> a value in [-100, 100] added to that
    token's logit before penalties and sampling (greedy included).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # logprob of each prompt token after the first (given its prefix), plus the
    # top-n; a request asking for them does not use prefix-cache hits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # the output must match a JSON schema / regex / choice / grammar (laneserve/structured)
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(
                f"output_kind must be a RequestOutputKind (0, 1 or 2), got {self.output_kind!r}"
            ) from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        self._validate_counts()
        self._validate_floats()
        self._validate_stops()
        self._validate_bias()

    def _validate_counts(self) -> None:
        _check(
            _int_in(self.n, 1, INT32_MAX),
            f"n must be an integer in [1, {INT32_MAX}], got {self.n!r}",
        )
        _check(
            _int_in(self.top_k, 0, INT32_MAX),
            f"top_k must be 0 or -1 (disabled) or an integer in [1, {INT32_MAX}], got {self.top_k!r}",
        )
        _check(
            self.seed is None or _int_in(self.seed, INT64_MIN, INT64_MAX),
            f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}",
        )
        _check(
            self.max_tokens is None or _int_in(self.max_tokens, 1, INT32_MAX),
            f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}",
        )
        _check(
            _int_in(self.min_tokens, 0, INT32_MAX),
            f"min_tokens must be an integer in [0, {INT32_MAX}], got {self.min_tokens!r}",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            )
        _check(
            self.logprobs is None or _int_in(self.logprobs, 0, _MAX_LOGPROBS),
            f"logprobs must be an integer in [0, {_MAX_LOGPROBS}], got {self.logprobs!r}",
        )
        _check(
            self.prompt_logprobs is None or _int_in(self.prompt_logprobs, 0, _MAX_LOGPROBS),
            f"prompt_logprobs must be an integer in [0, {_MAX_LOGPROBS}], "
            f"got {self.prompt_logprobs!r}",
        )

    def _validate_floats(self) -> None:
        _check(
            _is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
            f"temperature must be in [0, 100], got {self.temperature!r}",
        )
        _check(
            _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_number(value) and -2.0 <= value <= 2.0,
                f"{name} must be in [-2, 2], got {value!r}",
            )
        _check(
            _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}",
        )

    def _validate_stops(self) -> None:
        if self.stop is not None:
            _check(
                isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
                f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}",
            )
            _check(
                all(is_valid_utf8(s) for s in self.stop),
                "stop strings must be valid Unicode (no lone surrogates)",
            )
        if self.stop_token_ids is not None:
            _check(
                isinstance(self.stop_token_ids, list)
                and all(_int_in(t, 0, INT32_MAX) for t in self.stop_token_ids),
                f"stop_token_ids must be integers in [0, {INT32_MAX}], got {self.stop_token_ids!r}",
            )

    def _validate_bias(self) -> None:
        if self.logit_bias is None:
            return
        _check(isinstance(self.logit_bias, dict), "logit_bias must map token ids to numbers")
        for tok, bias in self.logit_bias.items():
            _check(
                _int_in(tok, 0, INT32_MAX),
                f"logit_bias: token ids must be integers in [0, {INT32_MAX}], got {tok!r}",
            )
            _check(
                _is_number(bias) and -_MAX_BIAS <= bias <= _MAX_BIAS,
                f"logit_bias: values must be in [-100, 100], got {bias!r} for token {tok}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def never_speculates(self) -> bool:
        """Logits processing that reads the history or is applied to one logits row
        per request (penalties, logit_bias): such requests decode without drafts."""
        return self.uses_penalties or bool(self.logit_bias)

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop) if isinstance(self.stop, list) else []

    def with_seed(self, seed: int | None) -> SamplingParams:
        """A copy with another seed (used to fan `n` out into n requests)."""
        return msgspec.structs.replace(self, seed=seed)


def is_valid_utf8(text: str) -> bool:
    """False for strings with lone surrogates (JSON can carry them, UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _int_in(value: object, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
