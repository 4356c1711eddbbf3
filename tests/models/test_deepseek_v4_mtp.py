"""DeepSeek V4's own MTP layer (`mtp.0`, release layout) as the draft source: its logits
equal a reference built from transformers' V4 block on the same weights, and
speculative greedy equals plain greedy (which equals transformers) for k = 1 and 2,
sync and async, with drafts verified and many rejected, so that rejected drafts
close compressed windows along the way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laneserve import LLM
from laneserve.kernels import get_kernels
from laneserve.model.deepseek_v4.model import DeepseekV4Model, cache_groups
from laneserve.model.deepseek_v4.mtp import load_deepseek_v4_mtp
from laneserve.model.interface import single_group_tables
from laneserve.model.layers.attention import TokenTableMetadata
from laneserve.model.loader import resolve_checkpoint
from laneserve.model.registry import open_weights
from laneserve.worker.kv_cache import KvCache
from tests.e2e.test_tiny_models import run
from tests.models.test_deepseek_mtp import _spec
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
@pytest.mark.parametrize("async_scheduling", [False, True])
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


@pytest.mark.parametrize("async_scheduling", [False, True])
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
