"""DeepSeek's multi-head latent attention (MLA) as the attention of an EAGLE-3 draft layer.

A draft for an MLA target (DeepSeek-V3, Kimi-K2.5) can use the target's own kind of attention
(`eyas train --draft-attention mla`), which vLLM serves as `Eagle3DeepseekV3ForCausalLM` and SGLang
as its Kimi-K2.5 draft (`Eagle3DeepseekV2ForCausalLM`). The layer around it is EAGLE-3's (norms,
[embedding ; hidden] input, MLP, residual); only the attention changes:

    q          = q_b_proj(q_a_layernorm(q_a_proj(x)))    [nh, nope + rope]   (q_proj(x) without q_lora_rank)
    latent, kr = kv_a_proj_with_mqa(x)                    [kv_lora_rank], [rope]: one rope key for all heads
    kn, v      = kv_b_proj(kv_a_layernorm(latent))        [nh, nope], [nh, v_head_dim]
    rope on q's last `rope` channels and on kr, as pairs (2i, 2i+1) (the engines' GPT-J style rope)
    attention of q over k = [kn ; kr], scale (nope + rope)^-1/2 (times yarn's mscale^2), values v

In the first layer x is [embedding ; hidden] (2H): only the two down projections read 2H.

The layer hands `attend(q, k, v)` the expanded form (per-head keys and values), so training-time
test, the KV cache and flex attention run it unchanged. The engines absorb kv_b_proj into q and the
output at decode time, which computes the same attention over a smaller cache; for training over
whole sequences the expanded form is the cheaper one (scores over nope + rope channels per head,
not kv_lora_rank + rope).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from eyas.model.config import MLA_DIMS, DraftConfig
from eyas.model.layers import DraftAttention, RMSNorm, apply_rope
from eyas.utils.io import EyasError

MLA_ARCHITECTURES = {"vllm": "Eagle3DeepseekV3ForCausalLM", "sglang": "Eagle3DeepseekV2ForCausalLM"}


def pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """[..., r] with rope pairs (2i, 2i+1) -> pairs (i, i + r/2), the layout `apply_rope` rotates. The same
    rotation of the same pairs; q and k are reordered alike, so every q . k is unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def yarn_softmax_factor(rope_scaling: dict | None) -> float:
    """DeepSeek's yarn also scales the softmax: by mscale(factor, mscale_all_dim)^2 (vLLM, SGLang and
    transformers agree); 1 without rope scaling."""
    if not rope_scaling:
        return 1.0
    factor = float(rope_scaling.get("factor") or 1.0)
    if factor <= 1.0:
        return 1.0
    mscale = 0.1 * float(rope_scaling.get("mscale_all_dim") or 0.0) * math.log(factor) + 1.0
    return mscale * mscale


class MLAAttention(nn.Module):
    """The attention of an MLA draft layer: `project` gives attend() q [B, nh, T, nope + rope] and
    k, v [B, nh, T, *] (v_head_dim wide), `output` applies o_proj (DraftAttention's)."""

    def __init__(self, cfg: DraftConfig, in_dim: int) -> None:
        super().__init__()
        nh, eps = cfg.num_attention_heads, cfg.rms_norm_eps
        self.num_heads, self.q_lora = nh, cfg.q_lora_rank > 0
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if self.q_lora:
            self.q_a_proj = nn.Linear(in_dim, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * qk, bias=False)
        else:
            self.q_proj = nn.Linear(in_dim, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_dim, self.latent + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.latent, eps)
        self.kv_b_proj = nn.Linear(self.latent, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, cfg.hidden_size, bias=False)
        # attend() scales by (nope + rope)^-1/2; yarn's extra factor goes into q
        self.q_scale = yarn_softmax_factor(cfg.rope_scaling)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, in_dim]; cos, sin [B, T, rope] -> q, k [B, nh, T, nope + rope], v [B, nh, T, v_head_dim]."""
        B, T, _ = x.shape
        nh = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_rope = q.view(B, T, nh, -1).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, nh, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(pairs_to_halves(q_rope), cos, sin)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k_rope = apply_rope(pairs_to_halves(k_rope[:, None]), cos, sin)  # [B, 1, T, rope]: shared by the heads
        k = torch.cat([k_nope, k_rope.expand(B, nh, T, self.rope)], dim=-1)
        return q, k, v

    output = DraftAttention.output  # o_proj over the heads, as in the Llama-style layer
    forward = DraftAttention.forward


# -- how the engines' configs spell it (written by eyas.export.writers, read by eyas.model.checkpoints) ----


def deepseek_layer_config(cfg: DraftConfig, dtype: str) -> dict[str, Any]:
    """The decoder layer as a transformers DeepseekV2Config, which vLLM and SGLang both build their MLA
    draft from. model_type deepseek_v2, not deepseek_v3: vLLM turns a deepseek_v3 draft into its MTP model."""
    return {
        "model_type": "deepseek_v2",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank or None,  # null: a plain q_proj
        **{name: getattr(cfg, name) for name in MLA_DIMS[1:]},
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,  # SGLang would tie lm_head to the embedding
        "torch_dtype": dtype,
    }


def mla_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The DraftConfig fields of an engine's MLA draft config (none for a Llama-style layer's)."""
    if config.get("kv_lora_rank") is None:
        return {}
    missing = [name for name in MLA_DIMS if name not in config]
    if missing:  # the engines would take DeepseekV2Config's defaults, sized for DeepSeek-V2
        raise EyasError(f"{where}/config.json: an MLA draft config without {missing}: add them")
    dims = {name: int(config[name] or 0) for name in MLA_DIMS}
    return {"attention": "mla", **dims, "num_key_value_heads": int(config["num_attention_heads"]),
            "head_dim": dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]}
