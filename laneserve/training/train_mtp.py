"""`laneserve train-mtp`: train an MTP head for any supported model by
self-distillation (see `mtp_data.py` for the data).

The head (enorm, hnorm, eh_proj, one decoder layer of the base architecture)
learns, with teacher forcing over whole sequences, to predict the base
model's own t[i+2] from (h[i], t[i+1]); embedding, final norm and LM head are
the base model's, frozen. The loss runs over a *draft vocabulary*: the most
frequent target tokens, which also makes every draft's LM-head matmul small
at inference. The decoder layer starts from the base model's last layer.

`--lookup-weight W` scales the loss at positions where a prompt lookup (the last n =
2..4 tokens of the context seen earlier in it, as `ngram_first` searches) finds a match:
with `ngram_first` the lookup drafts there, so the head need not learn to copy (0 skips
those positions and leaves the head's capacity to the rest).

Resumable: data and checkpoints live in `<out>.work/`; `--resume` continues
from the last checkpoint, or, if generation was interrupted, from its last saved
batch (`mtp_data.ShardDir`); with a larger `--num-prompts` it extends the saved
data (the prompt list only grows at its end) and trains afresh on the whole.
The export is bf16 safetensors with DeepSeek-V3
names (`model.layers.{L}.*`) plus `draft_vocab`, and metadata recording how
it was trained, its top-1 accuracy on sequences from held-out prompts (topics
and templates the training prompts do not use; = greedy k=1 acceptance there)
and on as many training sequences (the gap shows overfitting).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from laneserve.config import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN
from laneserve.training.mtp_data import Sample, collect, in_process_worker
from laneserve.training.mtp_module import MtpTrainModule
from laneserve.training.mtp_prompts import heldout_prompts, training_prompts

log = logging.getLogger(__name__)


def run(ns: argparse.Namespace) -> int:
    from laneserve import LLM

    _check_counts(ns)
    torch.manual_seed(ns.seed)
    out = Path(ns.out)
    work = out.with_name(out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    llm = LLM(
        ns.model,
        dtype=ns.dtype,
        async_scheduling=False,
        enable_prefix_caching=False,
        max_num_seqs=ns.gen_batch,
        worker_mode="thread",  # the data tap reads the runner in this process
    )
    args = (ns.max_new_tokens, ns.gen_batch)
    samples = collect(
        llm, work / "data.pt", training_prompts(ns.num_prompts), *args, "training", ns.resume
    )
    held = collect(
        llm, work / "heldout.pt", heldout_prompts(ns.holdout), *args, "held-out", ns.resume
    )
    gen_s = time.perf_counter() - start
    worker = in_process_worker(llm)
    module = MtpTrainModule.from_base(worker.ckpt, worker.model)
    vocab = draft_vocabulary(samples, ns.draft_vocab, worker.ckpt.arch.vocab_size)
    module.set_draft_vocab(vocab)
    llm.shutdown()
    train = samples
    train_loop(module, train, ns, work)
    acc = accuracy(module, held)
    train_acc = accuracy(module, train[: len(held)])
    meta = {
        "base_model": worker.ckpt.known_name or worker.ckpt.source,
        "hidden_size": str(worker.ckpt.arch.hidden_size),
        "trained_sequences": str(len(train)),
        "trained_positions": str(sum(_num_targets(s) for s in train)),
        "draft_vocab": str(len(vocab)),
        "draft_vocab_coverage": f"{coverage(samples, vocab):.4f}",
        "heldout_top1": f"{acc:.4f}",  # unseen prompts (topics and templates)
        "train_top1": f"{train_acc:.4f}",  # as many training sequences: the overfitting gap
        "epochs": str(ns.epochs),
        "generation_s": f"{gen_s:.0f}",
        "total_s": f"{time.perf_counter() - start:.0f}",
        "command": "laneserve train-mtp "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(ns).items()
            if k not in ("func", "resume", "log_level", "command") and v is not None
        ),
    }
    module.export(out, meta)
    print(json.dumps({"out": str(out), **{k: _number_or_text(v) for k, v in meta.items()}}))
    return 0


def _number_or_text(value: str) -> int | float | str:
    """Metadata values are text in the file; the printed summary shows numbers as numbers."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def default_holdout(num_prompts: int) -> int:
    """Held-out sequences: an eighth of the training prompts, at least 1 and at most 32,
    so that a small run does not spend most of its time on held-out data."""
    return max(1, min(32, num_prompts // 8))


def _check_counts(ns: argparse.Namespace) -> None:
    if ns.holdout is None:
        ns.holdout = default_holdout(ns.num_prompts)
    if not 0.0 <= ns.lookup_weight <= 1.0:
        raise ValueError(f"--lookup-weight must be in [0, 1], got {ns.lookup_weight}")
    most_train, most_held = len(training_prompts(10**9)), len(heldout_prompts(10**9))
    if not 1 <= ns.num_prompts <= most_train:
        raise ValueError(f"--num-prompts must be in [1, {most_train}], got {ns.num_prompts}")
    if not 1 <= ns.holdout <= most_held:
        raise ValueError(f"--holdout must be in [1, {most_held}], got {ns.holdout}")


def _num_targets(s: Sample) -> int:
    return max(0, len(s.tokens) - s.prompt_len)


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int) -> torch.Tensor:
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.tokens), minlength=vocab_size)
    return counts.topk(size).indices.sort().values


def coverage(samples: list[Sample], vocab: torch.Tensor) -> float:
    keep = set(vocab.tolist())
    targets = [t for s in samples for t in s.tokens[s.prompt_len :]]
    return sum(t in keep for t in targets) / max(1, len(targets))


def batches(samples: list[Sample], size: int, rng: random.Random) -> list[list[Sample]]:
    order = sorted(samples, key=lambda s: len(s.tokens))  # similar lengths: little padding
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    rng.shuffle(groups)
    return groups


def collate(group: list[Sample], vocab_index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(next tokens [B, L], hidden [B, L, H], targets in draft-vocab ids [B, L] (-100 = skip))."""
    n = max(len(s.tokens) - 1 for s in group)
    b, h = len(group), group[0].hidden.shape[1]
    nxt = torch.zeros((b, n), dtype=torch.int64)
    hid = torch.zeros((b, n, h), dtype=torch.float32)
    tgt = torch.full((b, n), -100, dtype=torch.int64)
    for i, s in enumerate(group):
        toks = torch.tensor(s.tokens)
        m = len(s.tokens) - 1
        nxt[i, :m] = toks[1:]
        hid[i, :m] = s.hidden.float()
        # position j predicts t[j+2]; only generated targets (j + 2 >= prompt_len)
        j = torch.arange(max(0, s.prompt_len - 2), m - 1)
        mapped = vocab_index[toks[j + 2]]
        tgt[i, j] = torch.where(mapped >= 0, mapped, torch.full_like(mapped, -100))
    return nxt, hid, tgt


def lookup_covered(
    tokens: list[int], n_min: int = PROMPT_LOOKUP_MIN, n_max: int = PROMPT_LOOKUP_MAX
) -> list[bool]:
    """covered[c] for c = 0..len(tokens): with the context tokens[:c], a prompt lookup
    finds its last n tokens (n_min <= n <= n_max) at an earlier start s <= c - n - 1, as
    `kernels.ngram_lookup` searches."""
    seen: list[set[tuple[int, ...]]] = [set() for _ in range(n_max + 1)]
    covered = [False] * (len(tokens) + 1)
    for c in range(len(tokens) + 1):
        for n in range(n_min, n_max + 1):
            s = c - n - 1  # the latest start an earlier occurrence may have
            if s >= 0:
                seen[n].add(tuple(tokens[s : s + n]))
                covered[c] = covered[c] or tuple(tokens[c - n : c]) in seen[n]
    return covered


def target_weights(
    group: list[Sample], tgt: torch.Tensor, lookup_weight: float
) -> torch.Tensor | None:
    """[B, L] loss weight per position: `lookup_weight` where a prompt lookup covers the
    target (position j predicts t[j+2] from the context t[:j+2]), else 1. None when every
    weight is 1 (the plain mean, as before the option existed)."""
    if lookup_weight == 1.0:
        return None
    weight = torch.ones(tgt.shape)
    for i, s in enumerate(group):
        covered = torch.tensor(lookup_covered(s.tokens)[2:])  # context length j + 2
        n = min(covered.shape[0], tgt.shape[1])
        weight[i, :n] = torch.where(covered[:n], lookup_weight, 1.0)
    return weight


def train_loop(
    module: MtpTrainModule, train: list[Sample], ns: argparse.Namespace, work: Path
) -> None:
    rng = random.Random(ns.seed)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=ns.lr, weight_decay=ns.weight_decay)
    steps_per_epoch = math.ceil(len(train) / ns.batch_size)
    total = max(1, int(steps_per_epoch * ns.epochs))
    step = 0
    ckpt = work / "checkpoint.pt"
    state = torch.load(ckpt) if ns.resume and ckpt.exists() else None
    if state is not None and state.get("sequences", len(train)) != len(train):
        log.info(
            "checkpoint was for %d sequences, not %d: training from the start",
            state["sequences"],
            len(train),
        )
        state = None
    if state is not None:
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        log.info("resumed training at step %d/%d", step, total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)),
    )
    for _ in range(step):
        sched.step()
    bar = tqdm(total=total, initial=step, desc="training MTP head", unit="step")
    epoch_batches: list[list[Sample]] = []
    while step < total:
        if not epoch_batches:
            epoch_batches = batches(train, ns.batch_size, rng)
        group = epoch_batches.pop()
        nxt, hid, tgt = collate(group, module.vocab_index)
        weight = target_weights(group, tgt, ns.lookup_weight)
        if weight is not None:
            tgt = tgt.masked_fill(weight == 0, -100)  # weight 0: not even computed
        if not (tgt >= 0).any():
            continue  # every target outside the draft vocabulary: nothing to learn
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ns.train_dtype == "bfloat16"):
            loss = distill_loss(module, nxt, hid, tgt, ns.distill, weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % 50 == 0 or step == total:
            saved = {"module": module.state_dict(), "opt": opt.state_dict(), "step": step}
            torch.save({**saved, "sequences": len(train)}, ckpt)
    bar.close()


def distill_loss(
    module: MtpTrainModule,
    nxt: torch.Tensor,  # [B, L] t[i+1]
    hid: torch.Tensor,  # [B, L, H] target normed hidden h[i]
    tgt: torch.Tensor,  # [B, L] t[i+2] in draft-vocab ids, -100 = skip
    mode: str,
    weight: torch.Tensor | None = None,  # [B, L] per-position loss weight (None: all 1)
) -> torch.Tensor:
    """Cross-entropy of the head's t[i+2] logits against the target: its greedy token
    ("hard"), or its whole distribution over the draft vocabulary ("soft"), which is the
    target's output at position i + 1, computed from h[i+1]. A weighted mean over the
    positions that have a target."""
    mask = tgt >= 0
    logits = module(nxt, hid, only=mask).float()  # [n, Vd]
    if mode == "hard":
        per_pos = F.cross_entropy(logits, tgt[mask], reduction="none")
    else:
        # NOTE: position i's target is never a sequence's last input, so h[i+1] exists.
        following = torch.cat([hid[:, 1:], torch.zeros_like(hid[:, :1])], dim=1)
        teacher = module.teacher_logits(following[mask]).float().softmax(dim=-1)
        per_pos = -(teacher * logits.log_softmax(dim=-1)).sum(dim=-1)
    if weight is None:
        return per_pos.mean()
    w = weight[mask].to(per_pos.dtype)
    return (per_pos * w).sum() / w.sum()


@torch.no_grad()
def accuracy(module: MtpTrainModule, held: list[Sample]) -> float:
    hit = n = 0
    for s in held:
        nxt, hid, tgt = collate([s], module.vocab_index)
        pred = module(nxt, hid).argmax(-1)
        mask = tgt >= 0
        full_mask = _generated_mask(s, tgt.shape[1])
        hit += int((pred[mask] == tgt[mask]).sum())
        n += int(full_mask.sum())  # targets outside the draft vocab count as misses
    return hit / max(1, n)


def _generated_mask(s: Sample, n: int) -> torch.Tensor:
    m = torch.zeros(n, dtype=torch.bool)
    m[max(0, s.prompt_len - 2) : len(s.tokens) - 2] = True
    return m
