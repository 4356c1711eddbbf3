"""The trainable MTP module and the inference MTP head compute the same thing,
and `laneserve train-mtp` produces a loadable head (tiny model, a few steps)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from laneserve.kernels import TorchKernels, get_kernels
from laneserve.model.layers.attention import AttentionMetadata, PrefillSpan
from laneserve.model.llama.model import LlamaModel
from laneserve.model.llama.mtp import load_mtp_head
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import open_weights
from laneserve.training import mtp_prompts
from laneserve.training.mtp_data import Sample, ShardDir, collect, generate_samples
from laneserve.training.mtp_module import MtpTrainModule
from laneserve.training.train_mtp import distill_loss, lookup_covered


def test_train_module_matches_inference_head(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    for family in ("llama", "qwen2", "qwen3"):
        cpu = torch.device("cpu")
        ckpt = resolve_checkpoint(str(tiny_models[family]), "float32", cpu)
        module = MtpTrainModule.from_base(ckpt, None)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        module.set_draft_vocab(torch.arange(0, 320, 3))
        path = tmp_path / f"{family}.safetensors"
        module.export(path, {"hidden_size": str(ckpt.arch.hidden_size)})
        with torch.no_grad():  # the export is bf16: round the trained parameters (not the
            for p in module.parameters():  # frozen base buffers) to compare like with like
                p.copy_(p.to(torch.bfloat16).float())
        kernels = get_kernels(cpu)
        store = open_weights(ckpt, cpu, torch.float32)
        base = LlamaModel(ckpt.arch, kernels, store, cpu, torch.float32, 512)
        head = load_mtp_head(store, base, kernels, str(path), None)
        n, h = 20, ckpt.arch.hidden_size
        nxt = torch.randint(3, 320, (n,))
        hidden = torch.randn(n, h)
        with torch.no_grad():
            ref = module(nxt[None], hidden[None])[0]  # [n, Vd]
        a = ckpt.arch
        cache = tuple(torch.zeros(2, 16, a.num_kv_heads, a.head_dim) for _ in range(2))
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n),
            num_decode_tokens=0,
            decode_block_tables=None,
            decode_seq_lens=None,
            decode_query_start_loc=None,
            prefills=(PrefillSpan(0, n, 0, torch.tensor([0, 1])),),
        )
        out = head.forward(nxt, hidden, torch.arange(n), meta, cache)
        got = head.head(out)
        assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3), (family, (got - ref).abs().max())
        assert torch.equal(head.draft(out)[:, 0], torch.arange(0, 320, 3)[ref.argmax(-1)])


@pytest.mark.slow
def test_train_mtp_cli_resumes_and_produces_a_working_head(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "head.safetensors"
    cmd = [
        sys.executable, "-m", "laneserve.entrypoints.cli", "train-mtp", "--model", str(tiny_models["qwen3"]),
        "--out", str(out), "--num-prompts", "16", "--max-new-tokens", "16", "--epochs", "1",
        "--draft-vocab", "200", "--dtype", "float32", "--lookup-weight", "0.5",
    ]  # fmt: skip
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    info = json.loads(first.stdout.strip().splitlines()[-1])
    assert info["trained_positions"] > 0 and info["draft_vocab"] == 200  # numbers, not text
    # resumed with mixed precision from the checkpoint on
    again_args = ["--epochs", "2", "--draft-vocab", "200", "--dtype", "float32", "--resume"]
    again = subprocess.run(
        [*cmd[:-8], *again_args, "--train-dtype", "bfloat16", "--lookup-weight", "0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (
        again.returncode == 0
        and "resumed training data" in again.stderr
        and "resumed training at step" in again.stderr
    )
    # more prompts: the saved data grows, and the old checkpoint is not resumed
    more = subprocess.run(
        [*cmd[:-8], *again_args[:-1], "--num-prompts", "20", "--resume"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert more.returncode == 0, more.stderr[-2000:]
    assert "holds 16 of 20 prompts" in more.stderr and "training from the start" in more.stderr
    with LLM(
        str(tiny_models["qwen3"]),
        dtype="float32",
        speculative_config={"method": "mtp", "draft_weights": str(out)},
    ) as llm:
        got = llm.generate(
            {"prompt_token_ids": [5, 6, 7]},
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )
        assert len(got[0].outputs[0].token_ids) == 12 and llm.get_stats()["spec_num_drafts"] > 0


def test_interrupted_generation_resumes_from_its_saved_batches(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """An interrupted data generation keeps its finished batches; resuming generates only
    the rest, and the data equal an uninterrupted run's."""
    prompts = mtp_prompts.training_prompts(10)
    with _generation_llm(tiny_models) as llm:
        whole = generate_samples(llm, prompts, 8, 4, "whole")
        shards = ShardDir(tmp_path, "training")
        real, calls = llm.generate, []

        def generate(*args: object, **kwargs: object) -> object:
            calls.append(len(args[0]))
            if len(calls) == 3:
                raise KeyboardInterrupt  # stopped during the third batch
            return real(*args, **kwargs)

        llm.generate = generate
        with pytest.raises(KeyboardInterrupt):
            generate_samples(llm, prompts, 8, 4, "interrupted", shards)
        assert [(a, b) for a, b, _ in shards.files()] == [(0, 4), (4, 8)]
        calls.clear()
        resumed = generate_samples(llm, prompts, 8, 4, "resumed", shards)
        assert calls == [2]  # only the last two prompts were generated again
    _assert_same_samples(resumed, whole)
    # shards of other settings are refused, not mixed in
    with pytest.raises(ValueError, match="other prompts or --max-new-tokens"):
        shards.load(prompts, 9)
    with pytest.raises(ValueError, match="other prompts or --max-new-tokens"):
        shards.load(mtp_prompts.training_prompts(12)[2:], 8)
    shards.clear()
    assert shards.files() == []


def test_resume_with_more_prompts_extends_the_saved_data(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """A finished data file for the first prompts is kept and only the rest generated; the
    result equals a fresh run's. A file made for other settings is refused."""
    prompts = mtp_prompts.training_prompts(10)
    path = tmp_path / "data.pt"
    with _generation_llm(tiny_models) as llm:
        whole = collect(llm, tmp_path / "whole.pt", prompts, 8, 4, "whole", resume=False)
        collect(llm, path, prompts[:6], 8, 4, "training", resume=False)
        real, calls = llm.generate, []

        def generate(*args: object, **kwargs: object) -> object:
            calls.append(len(args[0]))
            return real(*args, **kwargs)

        llm.generate = generate
        grown = collect(llm, path, prompts, 8, 4, "training", resume=True)
        assert calls == [4]  # only the 4 new prompts
        again = collect(llm, path, prompts, 8, 4, "training", resume=True)
        assert calls == [4]  # read back: nothing generated
    _assert_same_samples(grown, whole)
    _assert_same_samples(again, whole)
    assert not list(tmp_path.glob("training-*"))  # the shards went into data.pt
    for other, max_new in ((prompts, 9), (prompts[1:], 8), (prompts[:5], 8)):
        with pytest.raises(ValueError, match="other prompts or --max-new-tokens"):
            collect(None, path, other, max_new, 4, "training", resume=True)
    # a data file written before files recorded their prompts is read as it is
    torch.save([s.__dict__ for s in whole], tmp_path / "old.pt")
    _assert_same_samples(collect(None, tmp_path / "old.pt", [], 8, 4, "old", resume=True), whole)


def _generation_llm(tiny_models: dict[str, Path]) -> LLM:
    """The engine as `train-mtp` sets it up for generation, on the tiny Qwen3."""
    return LLM(
        str(tiny_models["qwen3"]),
        dtype="float32",
        async_scheduling=False,
        enable_prefix_caching=False,
        max_num_seqs=4,
        worker_mode="thread",
    )


def _assert_same_samples(got: list[Sample], want: list[Sample]) -> None:
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        assert a.tokens == b.tokens and a.prompt_len == b.prompt_len
        assert torch.equal(a.hidden, b.hidden)


def _train_inputs(
    tiny_models: dict[str, Path], seed: int, shape: tuple[int, int]
) -> tuple[MtpTrainModule, torch.Tensor, torch.Tensor]:
    """A trainable head on the tiny Llama (draft vocab: even ids) and random (t[i+1], h[i])."""
    ckpt = resolve_checkpoint(str(tiny_models["llama"]), "float32", torch.device("cpu"))
    module = MtpTrainModule.from_base(ckpt, None)
    module.set_draft_vocab(torch.arange(0, 320, 2))
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, 320, shape, generator=g)
    hid = torch.randn(*shape, ckpt.arch.hidden_size, generator=g)
    return module, nxt, hid


def test_soft_distillation_targets_the_next_position(tiny_models: dict[str, Path]) -> None:
    """Soft: cross-entropy against the target's own distribution of t[i+2], i.e. its
    logits at position i + 1 (from h[i+1]); "hard": against the greedy token."""
    module, nxt, hid = _train_inputs(tiny_models, seed=0, shape=(2, 6))
    tgt = torch.full((2, 6), -100)
    tgt[0, 1:4] = torch.tensor([3, 7, 11])
    tgt[1, 0] = 5
    with torch.no_grad():
        soft = distill_loss(module, nxt, hid, tgt, "soft")
        hard = distill_loss(module, nxt, hid, tgt, "hard")
        logp = module(nxt, hid).log_softmax(-1)
        want_soft, want_hard = [], []
        for b, j in [(0, 1), (0, 2), (0, 3), (1, 0)]:
            teacher = (hid[b, j + 1] @ module.head_draft.T).softmax(-1)
            want_soft.append(-(teacher * logp[b, j]).sum())
            want_hard.append(-logp[b, j, tgt[b, j]])
    torch.testing.assert_close(soft, torch.stack(want_soft).mean())
    torch.testing.assert_close(hard, torch.stack(want_hard).mean())
    with torch.no_grad():  # the MLP and head at the target positions only: the same logits
        torch.testing.assert_close(module(nxt, hid, only=tgt >= 0), module(nxt, hid)[tgt >= 0])


def test_prompt_sets_are_disjoint() -> None:
    """Held-out prompts share no topic or template with training; the benchmarks' chat
    prompts are not training prompts."""
    topics, more = set(mtp_prompts.TOPICS), set(mtp_prompts.MORE_TOPICS)
    assert not (topics | more) & set(mtp_prompts.HELDOUT_TOPICS)
    assert not topics & more
    assert not set(mtp_prompts.TEMPLATES) & set(mtp_prompts.HELDOUT_TEMPLATES)
    train = {text for text, _ in mtp_prompts.training_prompts(10**9)}
    assert len(train) == len(mtp_prompts.training_prompts(10**9))
    assert not train & {text for text, _ in mtp_prompts.heldout_prompts(10**9)}
    benches = (
        "Explain why the sky is blue.",
        "Write a short story about a lighthouse keeper.",
        "Explain glaciers to a ten-year-old.",  # free chat in benchmarks/mtp_acceptance.py
        "Why is sleep important?",
    )
    for bench in benches:
        assert bench not in train
    # any prefix mixes chat and raw text and spreads over the templates
    first = mtp_prompts.training_prompts(200)
    assert {chat for _, chat in first} == {True, False}


def test_added_topics_leave_the_earlier_prompts_in_place() -> None:
    """Saved generation data (shards, `data.pt`) stays valid: the prompts over `TOPICS`
    come first and are the same list as before `MORE_TOPICS` was added."""
    first = len(mtp_prompts.TOPICS) * (len(mtp_prompts.TEMPLATES) + len(mtp_prompts.OPENINGS))
    prompts = mtp_prompts.training_prompts(10**9)
    digest = hashlib.sha256(json.dumps(prompts[:first]).encode()).hexdigest()
    assert (first, digest[:16]) == (7942, "597b989fb1d4779e")
    forms = mtp_prompts.TEMPLATES + mtp_prompts.OPENINGS
    built = {f.format(t=t) for f in forms for t in mtp_prompts.TOPICS}
    assert {text for text, _ in prompts[:first]} == built
    assert not built & {text for text, _ in prompts[first:]}


def test_lookup_covered_matches_the_lookup_kernel() -> None:
    """The trainer's `--lookup-weight` positions are exactly those where the runtime
    lookup (`kernels.ngram_lookup`, n = 2..4) finds a match for the context."""
    kern = TorchKernels()
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        seq = torch.randint(0, 3 + trial % 5, (40,), generator=g).tolist()
        covered = lookup_covered(seq)
        hist = torch.tensor([seq])
        for c in range(len(seq) + 1):
            _, num = kern.ngram_lookup(hist, torch.tensor([c]), torch.tensor([0]), 40, 1, 2, 4)
            assert covered[c] == bool(num[0] > 0), (trial, c)


def test_distill_loss_weights_positions(tiny_models: dict[str, Path]) -> None:
    module, nxt, hid = _train_inputs(tiny_models, seed=1, shape=(1, 5))
    tgt = torch.tensor([[3, 7, -100, 11, -100]])
    weight = torch.tensor([[1.0, 0.25, 1.0, 0.25, 1.0]])
    with torch.no_grad():
        # one position at a time (the others masked out), then the weighted mean of the three
        per = [
            distill_loss(module, nxt, hid, tgt.where(tgt == t, -100), "soft") for t in (3, 7, 11)
        ]
        got = distill_loss(module, nxt, hid, tgt, "soft", weight)
        ones = distill_loss(module, nxt, hid, tgt, "soft", torch.ones(1, 5))
        plain = distill_loss(module, nxt, hid, tgt, "soft")
    torch.testing.assert_close(got, (per[0] + 0.25 * per[1] + 0.25 * per[2]) / 1.5)
    torch.testing.assert_close(ones, plain)


def test_train_mtp_holdout_scales_with_the_prompts() -> None:
    from laneserve.training.train_mtp import default_holdout

    assert [default_holdout(n) for n in (1, 8, 40, 256, 3200)] == [1, 1, 5, 32, 32]


def test_exported_head_has_a_normal_file_mode(tmp_path: Path) -> None:
    import os

    from laneserve.training.mtp_module import _normal_file_mode

    f = tmp_path / "head.safetensors"
    f.write_bytes(b"x")
    f.chmod(0o600)
    umask = os.umask(0o022)
    try:
        _normal_file_mode(f)
    finally:
        os.umask(umask)
    assert f.stat().st_mode & 0o777 == 0o644
