"""DeepSeek V4's own MTP layer (`mtp.0`, release layout) as the draft source: its logits
equal a reference built from transformers' V4 block on the same weights, and
speculative greedy equals plain greedy (which equals transformers) for k = 1 and 2,
sync and async, with drafts verified and many rejected, so that rejected drafts
close compressed windows along the way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laneserve import LLM, SamplingParams
from laneserve.kernels import get_kernels
from laneserve.model.deepseek_v4.model import DeepseekV4Model, cache_groups
from laneserve.model.deepseek_v4.mtp import load_deepseek_v4_mtp
from laneserve.model.interface import single_group_tables
from laneserve.model.layers.attention import TokenTableMetadata
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import open_weights
from laneserve.worker.kv_cache import KvCache
from tests.e2e.test_tiny_models import run
from tests.models.test_deepseek_mtp import _spec, assert_head_options_refused
from tests.models.test_deepseek_v4 import GREEDY, check_against_hf, prompts_of
from tests.models.test_deepseek_v4_cache import tables_for
from tests.models.tiny_deepseek_v4 import add_v4_mtp_layer, hf_mtp_reference, to_release_layout


@pytest.fixture(scope="module")
def with_mtp(deepseek_v4_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    release = to_release_layout(deepseek_v4_model, tmp_path_factory.mktemp("v4mtp") / "r")
    return add_v4_mtp_layer(release, seed=7)


def _hf_logits(ref_dir: Path, x_in: torch.Tensor) -> torch.Tensor:
    """transformers' one-layer model with the block's input streams put in place of the
    embedded ones (a pre-hook on layer 0)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(ref_dir), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()

    def put(_module, args, kwargs):
        return (x_in[None].to(args[0].dtype if args else torch.float32),), kwargs

    layer = model.model.layers[0]
    hook = layer.register_forward_pre_hook(lambda m, a, k: put(m, a, k), with_kwargs=True)
    try:
        t = x_in.shape[0]
        dummy = torch.zeros(1, t, x_in.shape[-1])
        with torch.no_grad():
            h = model.model(inputs_embeds=dummy, position_ids=torch.arange(t)[None])
            return model.get_output_embeddings()(h.last_hidden_state)[0].float()
    finally:
        hook.remove()


def test_mtp_logits_equal_transformers_block(with_mtp: Path, tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    ckpt = resolve_checkpoint(str(with_mtp), "float32", cpu)
    kernels = get_kernels(cpu)
    store = open_weights(ckpt, cpu, torch.float32)
    base = DeepseekV4Model(ckpt.arch, kernels, store, cpu, torch.float32, 80)
    head = load_deepseek_v4_mtp(store, base, kernels, None, None)
    groups = cache_groups(ckpt.arch, 4, 4, 1)
    assert groups[-1].name == "mtp" and groups[-1].kind == "sliding_window"
    kv = KvCache.allocate(groups, [32] * len(groups), 0, cpu, torch.float32)
    ids = torch.tensor(prompts_of([30], seed=8)[0])  # past the window (8): it slides
    n = ids.shape[0]
    tables = tables_for(kv, n)
    _, streams = base.forward(ids, torch.arange(n), TokenTableMetadata(tables, n + 1), kv.layers)
    assert streams.shape == (n, ckpt.arch.v4.hc_mult * ckpt.arch.hidden_size)
    meta = single_group_tables(tables[-1][: n - 1], n)
    out = head.forward(ids[1:], streams[:-1], torch.arange(n - 1), meta, kv.layers[-1][0])
    got = head.logits(out)

    # the block's input, written out from the release layout's definition
    w = {k: store(k, torch.float32) for k in ("embed.weight", "mtp.0.enorm.weight")}
    eps = ckpt.arch.rms_norm_eps

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    e = rms(w["embed.weight"][ids[1:]], w["mtp.0.enorm.weight"]) @ store("mtp.0.e_proj.weight").T
    s = streams[:-1].view(n - 1, ckpt.arch.v4.hc_mult, -1)
    hs = rms(s, store("mtp.0.hnorm.weight")) @ store("mtp.0.h_proj.weight").T
    torch.set_num_threads(1)
    want = _hf_logits(hf_mtp_reference(with_mtp, tmp_path / "ref"), e[:, None, :] + hs)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert torch.equal(head.draft(out)[:, 0], want.argmax(-1))


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True])
def test_speculative_greedy_equals_plain(
    with_mtp: Path, deepseek_v4_model: Path, k: int, async_scheduling: bool
) -> None:
    prompts = prompts_of([37, 9, 22], seed=9)
    with LLM(str(with_mtp), dtype="float32", async_scheduling=async_scheduling, **_spec(k)) as llm:
        got = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0
    assert stats["spec_num_accepted"] < stats["spec_num_drafts"]  # rejected drafts
    check_against_hf(deepseek_v4_model, prompts, got)  # the release copy's weights


def test_checkpoint_without_mtp_layer_is_refused(deepseek_v4_model: Path) -> None:
    with pytest.raises(Exception, match="carries no MTP layer"):
        LLM(str(deepseek_v4_model), dtype="float32", **_spec(1))


def test_head_options_and_token_trees_are_refused(with_mtp: Path) -> None:
    """V4 drafts with its own layer as stored (no draft file, no int8 head), and its
    cache groups cannot hold token-tree side rows."""
    assert_head_options_refused(with_mtp, "does not support token trees")


def test_bfloat16_speculative_greedy_equals_plain(with_mtp: Path) -> None:
    """bf16 weights: prompt rows take the prompt-row linears (bf16 products where the CPU
    has them), decode and verify rows the batch-invariant ones, so verifying drafts
    reproduces plain decoding token for token."""
    prompts = prompts_of([37, 9, 22], seed=10)
    with LLM(str(with_mtp), dtype="bfloat16") as llm:
        plain = run(llm, prompts, GREEDY)
    with LLM(str(with_mtp), dtype="bfloat16", **_spec(2)) as llm:
        spec = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted"] < stats["spec_num_drafts"]
    assert spec == plain


@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True])
def test_exact_mtp_layer_accepted_fully(tmp_path: Path, async_scheduling: bool) -> None:
    """The benchmark's exact-MTP checkpoint (a deciding layer, inert layers behind it,
    an MTP layer copying the first): every draft of k = 2 is accepted, and the tokens
    are transformers' on the same weights."""
    from tests.models.tiny_deepseek_v4 import build_exact_deepseek_v4_mtp
    from tests.tiny_models import hf_greedy

    d = build_exact_deepseek_v4_mtp(tmp_path / "exact", inert_layers=3)
    prompts = prompts_of([37, 9, 22], seed=11)
    with LLM(str(d), dtype="float32", async_scheduling=async_scheduling, **_spec(2)) as llm:
        got = run(llm, prompts, GREEDY)
        stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0
    assert stats["spec_num_accepted"] == stats["spec_num_drafts"]
    source = tmp_path / "exact-src"  # the same weights in transformers' layout
    for p, g in zip(prompts, got, strict=True):
        assert g == hf_greedy(source, p, len(g))


def _next_tokens(src: Path, embeds: torch.Tensor) -> list[int]:
    """transformers' greedy next token after each embedding row, each alone (the exact
    checkpoint's next token depends on the current one only)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(inputs_embeds=embeds[:, None, :]).logits[:, 0].argmax(-1).tolist()


def build_wrong_then_right_mtp(out: Path) -> tuple[Path, Path, int, list[int]]:
    """The exact-MTP checkpoint changed so that the MTP layer always drafts one token
    `c` that the target repeats once it is there (c -> c), and nothing else leads to
    c. After any other token, draft 0 (c) is wrong and draft 1 (c again) is exactly
    what the target says after c.

    How: coordinate 0 of every embedding is 0 and coordinate 1 is 1 (RMS kept 1), except
    c's, which is the flag sqrt(H) e_0, orthogonal to them all; c is the token the
    target says after the flag. `e_proj` sends each embedding to the flag (through
    coordinate 1, or the flag itself), so the MTP layer, a copy of the deciding layer,
    always sees c. Returns (release dir, transformers-layout dir, c, f: the target's
    next token after each token)."""
    from safetensors.torch import load_file, save_file

    from tests.models.tiny_deepseek_v4 import build_exact_deepseek_v4_mtp

    release = build_exact_deepseek_v4_mtp(out, inert_layers=1)
    src = out.with_name(out.name + "-src")
    state = load_file(str(src / "model.safetensors"))
    emb = state["model.embed_tokens.weight"]
    h = emb.shape[1]
    emb[:, :2] = 0.0
    emb *= ((h - 1) / h / emb.pow(2).mean(-1, keepdim=True)).sqrt()
    emb[:, 1] = 1.0
    flag = torch.zeros(h)
    flag[0] = h**0.5
    c = _next_tokens(src, flag[None])[0]
    emb[c] = flag
    save_file(state, str(src / "model.safetensors"))
    rel = load_file(str(release / "model.safetensors"))
    rel["embed.weight"] = emb.clone()
    unit = torch.zeros(h)
    unit[1] = 1.0
    rel["mtp.0.e_proj.weight"] = torch.outer(flag, unit) + torch.outer(flag, flag) / h
    save_file(rel, str(release / "model.safetensors"))
    f = _next_tokens(src, emb)
    assert f[c] == c
    return release, src, c, f


@pytest.fixture(scope="module")
def wrong_then_right(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int, list]:
    return build_wrong_then_right_mtp(tmp_path_factory.mktemp("v4skew") / "r")


@pytest.mark.parametrize("sampled_neighbour", [False, True])
def test_rejected_first_draft_voids_a_matching_second(
    wrong_then_right: tuple[Path, Path, int, list[int]],
    sampled_neighbour: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """k = 2 where draft 0 is wrong and draft 1 equals what the target would say after
    draft 0: the second draft must be rejected with the first (accepted drafts are a
    prefix), and the greedy tokens stay transformers'. Alone, greedy rows verify in the
    fused kernel; next to a sampled request, in the rejection sampler (counted)."""
    from laneserve.sample import rejection_sampler
    from tests.tiny_models import hf_greedy

    d, src, c, f = wrong_then_right
    calls = {"verify": 0}
    verify = rejection_sampler.verify

    def counted(*args, **kwargs):
        calls["verify"] += 1
        return verify(*args, **kwargs)

    monkeypatch.setattr(rejection_sampler, "verify", counted)
    prompts = prompts_of([12, 5], seed=12)
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = [GREEDY] * len(prompts)
    if sampled_neighbour:
        batch.append({"prompt_token_ids": prompts_of([7], seed=13)[0]})
        params.append(
            SamplingParams(temperature=1.0, seed=3, max_tokens=GREEDY.max_tokens, ignore_eos=True)
        )
    with LLM(str(d), dtype="float32", **_spec(2)) as llm:
        outs = llm.generate(batch, params, use_tqdm=False)
        stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0 and (calls["verify"] > 0) == sampled_neighbour
    for p, out in zip(prompts, outs[: len(prompts)], strict=True):
        g = out.outputs[0].token_ids
        assert g == hf_greedy(src, p, len(g))
        assert f[p[-1]] != c and g[0] != c  # the first drafts are c, c: wrong, then right
    assert stats["spec_num_accepted"] < stats["spec_num_drafts"]
