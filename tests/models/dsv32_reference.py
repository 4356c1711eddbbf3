"""An independent fp32 reference for DeepSeek V3.2, written from the algorithm of
DeepSeek's own V3.2 inference code (`inference/model.py` of the V3.2 repositories):
dense, one sequence, recomputed from scratch for every generated token, reading the
checkpoint's released tensor names and config keys directly. It shares no code with
laneserve or transformers.

Per layer (h the residual stream, x = RMSNorm(h)):

```
 qr   = RMSNorm(q_a_proj x)                      the indexer reads it too
 q    = q_b_proj qr  -> per head [nope | rope], rope rotated in interleaved pairs
 c,pe = kv_a_proj_with_mqa x;  c = RMSNorm(c);  pe rotated in interleaved pairs
 k, v = kv_b_proj c  -> per head [k_nope | v];  key = [k_nope | pe]
 indexer: iq = wq_b qr, ik = LayerNorm(wk x), first rope dims rotated in half-split
          pairs; w = weights_proj x / sqrt(Hi);
          score[s, t] = sum_h w[s, h] relu(iq[s, h] . ik[t]) / sqrt(Di), causal;
          each query keeps its top min(index_topk, S) positions
 attention over the kept causal positions, softmax scale qk_head_dim^-0.5 * mscale^2
```

DeepSeek's kernels also rotate the indexer's q and k by a Hadamard matrix and score in
fp8; the rotation leaves every q . k unchanged and fp8 is a precision choice, so this
fp32 reference leaves both out.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

Weights = dict[str, torch.Tensor]


class ReferenceV32:
    @staticmethod
    def load(ckpt: Path) -> ReferenceV32:
        """config.json and every `*.safetensors` file of a checkpoint directory; FP8
        tensors are decoded with their `weight_scale_inv` blocks."""
        from safetensors.torch import load_file

        cfg = json.loads((ckpt / "config.json").read_text())
        raw: Weights = {}
        for f in sorted(ckpt.glob("*.safetensors")):
            raw.update(load_file(str(f)))
        block = (cfg.get("quantization_config") or {}).get("weight_block_size")
        weights = {}
        for name, t in raw.items():
            if name.endswith("_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:
                t = _decode_fp8(t, raw[f"{name}_scale_inv"], block)
            weights[name] = t
        return ReferenceV32(cfg, weights)

    def __init__(self, cfg: dict, weights: Weights) -> None:
        self.cfg, self.w = cfg, {k: v.float() for k, v in weights.items()}
        self.freqs = _yarn_freqs(cfg)  # [rope / 2]
        nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        self.scale = (nope + rope) ** -0.5
        rs = cfg.get("rope_scaling") or {}
        if rs.get("type", rs.get("rope_type")) == "yarn":
            m = 0.1 * rs.get("mscale_all_dim", 1.0) * math.log(rs["factor"]) + 1.0
            self.scale *= m * m
        self.cut_queries = 0  # queries whose causal span the top-k selection cut

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt) :]

    def logits(self, ids: list[int]) -> torch.Tensor:  # [S, vocab]
        return self._final_hidden(ids) @ self.w["lm_head.weight"].t()

    def mtp_logits(self, ids: list[int]) -> torch.Tensor:  # [S - 1, vocab]
        """The MTP layer `model.layers.{L}` at positions 0 .. S - 2: position i reads the
        final-normed hidden state at i and the token ids[i + 1], and scores ids[i + 2].

        x = eh_proj [enorm(embed ids[i+1]) | hnorm(h_i)]; a decoder layer (its own
        indexer, over the MTP layer's own positions); shared_head.norm; shared_head.head."""
        w, n = self.w, self.cfg["num_hidden_layers"]
        p = f"model.layers.{n}."
        h = self._final_hidden(ids)[:-1]
        e = w["model.embed_tokens.weight"][torch.tensor(ids[1:])]
        x = torch.cat([_rms(e, w[p + "enorm.weight"]), _rms(h, w[p + "hnorm.weight"])], dim=-1)
        x = self._layer(n, x @ w[p + "eh_proj.weight"].t())
        return _rms(x, w[p + "shared_head.norm.weight"]) @ w[p + "shared_head.head.weight"].t()

    def _final_hidden(self, ids: list[int]) -> torch.Tensor:  # [S, H] after model.norm
        h = self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        for i in range(self.cfg["num_hidden_layers"]):
            h = self._layer(i, h)
        return _rms(h, self.w["model.norm.weight"])

    def _layer(self, i: int, h: torch.Tensor) -> torch.Tensor:  # the residual stream after
        w, p = self.w, f"model.layers.{i}."
        h = h + self._attention(p + "self_attn.", _rms(h, w[p + "input_layernorm.weight"]))
        x = _rms(h, w[p + "post_attention_layernorm.weight"])
        dense = i < self.cfg["first_k_dense_replace"]
        return h + (_mlp(w, p + "mlp.", x) if dense else self._moe(p + "mlp.", x))

    def _attention(self, a: str, x: torch.Tensor) -> torch.Tensor:
        w, cfg = self.w, self.cfg
        s, heads = x.shape[0], cfg["num_attention_heads"]
        nope, rope, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
        vdim = cfg["v_head_dim"]
        qr = _rms(x @ w[a + "q_a_proj.weight"].t(), w[a + "q_a_layernorm.weight"])
        q = (qr @ w[a + "q_b_proj.weight"].t()).view(s, heads, nope + rope)
        q = torch.cat([q[..., :nope], self._rotate(q[..., nope:], True)], dim=-1)
        kv = x @ w[a + "kv_a_proj_with_mqa.weight"].t()
        c = _rms(kv[:, :r], w[a + "kv_a_layernorm.weight"])
        pe = self._rotate(kv[:, None, r:], True)  # [S, 1, rope]
        kvb = (c @ w[a + "kv_b_proj.weight"].t()).view(s, heads, nope + vdim)
        k = torch.cat([kvb[..., :nope], pe.expand(s, heads, rope)], dim=-1)
        scores = torch.einsum("shd,thd->sht", q, k) * self.scale
        causal = torch.full((s, s), float("-inf")).triu(1)
        keep = torch.full((s, s), float("-inf")).scatter(1, self._indexer(a, x, qr, causal), 0)
        probs = (scores + (keep + causal)[:, None, :]).softmax(dim=-1)
        out = torch.einsum("sht,thd->shd", probs, kvb[..., nope:])
        return out.reshape(s, heads * vdim) @ w[a + "o_proj.weight"].t()

    def _indexer(
        self, a: str, x: torch.Tensor, qr: torch.Tensor, causal: torch.Tensor
    ) -> torch.Tensor:  # [S, min(topk, S)] the positions each query keeps
        w, cfg = self.w, self.cfg
        s, hi, di = x.shape[0], cfg["index_n_heads"], cfg["index_head_dim"]
        rope, topk = cfg["qk_rope_head_dim"], cfg["index_topk"]
        n = a + "indexer."
        q = (qr @ w[n + "wq_b.weight"].t()).view(s, hi, di)
        q = torch.cat([self._rotate(q[..., :rope], False), q[..., rope:]], dim=-1)
        k = F.layer_norm(
            x @ w[n + "wk.weight"].t(), (di,), w[n + "k_norm.weight"], w[n + "k_norm.bias"], 1e-6
        )
        k = torch.cat([self._rotate(k[:, None, :rope], False)[:, 0], k[:, rope:]], dim=-1)
        weights = (x @ w[n + "weights_proj.weight"].t()) * hi**-0.5  # [S, Hi]
        per_head = torch.einsum("shd,td->sht", q, k).relu() * di**-0.5
        score = torch.einsum("sh,sht->st", weights, per_head) + causal
        self.cut_queries += int((torch.arange(s) >= topk).sum())
        return score.topk(min(topk, s), dim=-1).indices

    def _rotate(self, x: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """x [S, heads, rope] rotated at positions 0 .. S - 1: pairs (2i, 2i + 1) when
        interleaved, (i, i + rope / 2) otherwise."""
        s, half = x.shape[0], x.shape[-1] // 2
        angle = torch.arange(s, dtype=torch.float32)[:, None] * self.freqs[None, :]
        cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
        a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
        ra, rb = a * cos - b * sin, a * sin + b * cos
        if interleaved:
            return torch.stack([ra, rb], dim=-1).flatten(-2)
        return torch.cat([ra, rb], dim=-1)

    def _moe(self, m: str, x: torch.Tensor) -> torch.Tensor:
        w, cfg = self.w, self.cfg
        scores = (x @ w[m + "gate.weight"].t()).sigmoid()  # [S, E]
        biased = scores + w[m + "gate.e_score_correction_bias"]
        groups = biased.view(x.shape[0], cfg["n_group"], -1)
        group_score = groups.topk(2, dim=-1).values.sum(-1)
        chosen = group_score.topk(cfg["topk_group"], dim=-1).indices
        drop = torch.ones_like(group_score, dtype=torch.bool).scatter(1, chosen, False)
        biased = groups.masked_fill(drop[..., None], float("-inf")).flatten(1)
        experts = biased.topk(cfg["num_experts_per_tok"], dim=-1).indices  # [S, k]
        gates = scores.gather(1, experts)
        gates = gates / gates.sum(-1, keepdim=True) * cfg["routed_scaling_factor"]
        out = _mlp(w, m + "shared_experts.", x)
        for t in range(x.shape[0]):
            for e, g in zip(experts[t].tolist(), gates[t], strict=True):
                out[t] += g * _mlp(w, f"{m}experts.{e}.", x[t : t + 1])[0]
        return out


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _mlp(w: Weights, m: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ w[m + "gate_proj.weight"].t(), x @ w[m + "up_proj.weight"].t()
    return (F.silu(gate) * up) @ w[m + "down_proj.weight"].t()


def _decode_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """W = q * scale_inv of its [block[0] x block[1]] block (edge blocks may be partial)."""
    rows, cols = q.shape
    out = q.float()
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            r = slice(bi * block[0], min(rows, (bi + 1) * block[0]))
            c = slice(bj * block[1], min(cols, (bj + 1) * block[1]))
            out[r, c] *= scale_inv[bi, bj].float()
    return out


def _yarn_freqs(cfg: dict) -> torch.Tensor:
    """The rope frequencies of DeepSeek's reference: yarn interpolation between the
    `beta_fast` and `beta_slow` correction dims when config.json asks for yarn."""
    dim, base = cfg["qk_rope_head_dim"], float(cfg["rope_theta"])
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rs = cfg.get("rope_scaling") or {}
    if rs.get("type", rs.get("rope_type")) != "yarn":
        return freqs
    orig, factor = rs["original_max_position_embeddings"], rs["factor"]

    def correction(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction(rs["beta_fast"])), 0)
    high = min(math.ceil(correction(rs["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / factor * (1 - smooth) + freqs * smooth
