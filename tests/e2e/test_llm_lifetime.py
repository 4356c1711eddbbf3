"""An `LLM` dropped without shutdown() is collected and releases its worker: the lane
threads end and the worker (model, KV cache) is freed. Checked with weak references and
threading.enumerate, never with timings."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

from laneserve import LLM, SamplingParams


def _lane_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("lane-")}


def _start(model: Path) -> tuple[weakref.ref, weakref.ref, set[threading.Thread]]:
    before = _lane_threads()
    llm = LLM(str(model), dtype="float32", max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    worker = llm.engine.client.worker
    lanes = _lane_threads() - before
    assert lanes, "the in-process worker runs on lane threads"
    return weakref.ref(llm), weakref.ref(worker), lanes


def test_dropped_llm_releases_worker_and_threads(tiny_models: dict[str, Path]) -> None:
    llm_ref, worker_ref, lanes = _start(tiny_models["llama"])
    gc.collect()
    assert llm_ref() is None
    assert not any(t.is_alive() for t in lanes)
    assert worker_ref() is None


def test_shutdown_is_idempotent_and_releases(tiny_models: dict[str, Path]) -> None:
    before = _lane_threads()
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64)
    lanes = _lane_threads() - before
    worker_ref = weakref.ref(llm.engine.client.worker)
    llm.shutdown()
    llm.shutdown()
    assert lanes and not any(t.is_alive() for t in lanes)
    del llm
    gc.collect()
    assert worker_ref() is None
