"""The DFlash draft (block-parallel drafting), readable top to bottom.

One forward proposes a whole block. The block is the token the target just produced (the anchor,
at position a) followed by B-1 open slots holding a mask token; every slot is predicted at once,
with attention that is not causal inside the block. The draft sees the target through its context:
the target's aux-layer states of every position before the anchor, fused by `fc` and normed, are
projected to keys and values in EVERY layer (no input_layernorm on them):

    context  c = hidden_norm(fc([aux_1 ; ... ; aux_k]))          [C, H]  positions 0 .. a-1
    block    x = embed([x_a, MASK, ..., MASK])                   [B, H]  positions a .. a+B-1
    layer:   h = input_layernorm(x)
             q = rope(q_norm(q_proj(h)))                                  the block's queries only
             k = rope(k_norm(k_proj([c ; h]))),  v = v_proj([c ; h])      the context's keys, then the block's
             x = x + o_proj(attend(q, k, v))       a slot sees the whole context and its whole block
             x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))                    slot k (1..B-1) proposes token a+k

The embedding and lm_head are the target's (lm_head over the draft vocabulary), frozen: only fc,
hidden_norm, the layers and norm train. This is vLLM's `DFlashDraftModel` (qwen3_dflash.py) and
SGLang's; eyas.export.dflash writes it for them. Attention is an `attend(q, k, v)` callable, as in
eyas.model.draft: the training objective's block mask (eyas.train.dflash), or a KV cache of the
context when decoding (eyas.eval.proposers).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from eyas.model.aux_layers import stated_aux_layer_ids
from eyas.model.config import DraftConfig, target_config_sha256, target_rope, text_config
from eyas.model.draft import DraftModel
from eyas.model.layers import Attend, DraftMLP, RMSNorm, apply_rope
from eyas.model.vocab import draft_to_target_ids
from eyas.utils.io import EyasError

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [B, T, hd]


class DFlashAttention(nn.Module):
    """Qwen3 attention (an RMSNorm per head on q and k) whose keys and values are the context's, then the block's."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(H, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[B, T, n*hd] -> [B, n, T, hd]."""
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)

    def forward(self, h: torch.Tensor, context: torch.Tensor, rope_q: Rope, rope_kv: Rope, attend: Attend
                ) -> torch.Tensor:
        """h [B, Q, H] (the normed block), context [B, C, H] -> [B, Q, H]."""
        B, Q, _ = h.shape
        kv_in = torch.cat([context, h], dim=1)  # [B, C+Q, H]
        q = apply_rope(self.q_norm(self._heads(self.q_proj(h), self.num_heads)), *rope_q)  # [B, nh, Q, hd]
        k = apply_rope(self.k_norm(self._heads(self.k_proj(kv_in), self.num_kv_heads)), *rope_kv)  # [B, nkv, C+Q, hd]
        v = self._heads(self.v_proj(kv_in), self.num_kv_heads)  # [B, nkv, C+Q, hd]
        out = attend(q, k, v)  # [B, nh, Q, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, x: torch.Tensor, context: torch.Tensor, rope_q: Rope, rope_kv: Rope, attend: Attend
                ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, rope_q, rope_kv, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(DraftModel):
    head_from_target = True  # lm_head is the target's (over the draft vocabulary), frozen

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        check_dflash_config(cfg)
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's, frozen
        self._register_vocab_maps()
        self._init_rotary()
        self.reset_parameters()

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, C, k*H_t] the target's aux states -> [B, C, H] what every layer reads keys and values from."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def block_embeds(self, anchor_embeds: torch.Tensor, size: int, mask_embed: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """anchor_embeds [A, H] -> [A, size, H]: each anchor's embedding, then size-1 mask embeddings.
        `mask_embed` [H]: the mask token's row, when the caller keeps the embedding table elsewhere."""
        if mask_embed is None:
            mask_embed = self.embed_tokens.weight[self.config.mask_token_id]
        A, H = anchor_embeds.shape
        slots = mask_embed.to(anchor_embeds.dtype).expand(A, size - 1, H)
        return torch.cat([anchor_embeds[:, None], slots], dim=1)

    def forward(self, block: torch.Tensor, block_positions: torch.Tensor, context: torch.Tensor,
                context_positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """block [B, Q, H] (embedded blocks, side by side), context [B, C, H] (`context`), their rotary
        positions [B, Q] and [B, C] -> the block's hidden output [B, Q, H] (before the final norm).
        `attend` sees keys [context ; block]; a stateful one (KV cache) gives each layer its own keys
        through `attend.layer(i)`."""
        dtype = context.dtype
        rope_q = self.rotary(block_positions, dtype)
        rope_c = self.rotary(context_positions, dtype)
        rope_kv = (torch.cat([rope_c[0], rope_q[0]], dim=1), torch.cat([rope_c[1], rope_q[1]], dim=1))
        per_layer = getattr(attend, "layer", None)
        x = block.to(dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, context, rope_q, rope_kv, per_layer(i) if per_layer else attend)
        return x

    def head_input(self, hidden_out: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_out)

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V_d] draft-vocabulary logits."""
        return self.lm_head(self.norm(hidden_out))

    def init_lm_head_from_target(self, lm_head: torch.Tensor, norm_weight: torch.Tensor,
                                 norm_offset: float = 0.0) -> None:
        """lm_head = the target's rows for the draft vocabulary, as they are; the final norm starts as the
        target's. Nothing is folded: with the full vocabulary the head IS the target's, which is what
        SGLang (and vLLM, when the checkpoint has no lm_head) use. Call after set_vocab."""
        if tuple(lm_head.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise EyasError(f"target lm_head {tuple(lm_head.shape)} does not match the draft's vocabulary and width "
                            f"({self.config.vocab_size}, {self.config.hidden_size})")
        rows = draft_to_target_ids(self.d2t.cpu())  # [V_d] target ids
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head.detach().cpu().float()[rows])
            self.norm.weight.copy_(norm_weight.detach().cpu().float() + norm_offset)


def check_dflash_config(cfg: DraftConfig) -> None:
    if cfg.num_hidden_layers < 1:
        raise EyasError(f"a draft needs at least one decoder layer, got num_hidden_layers={cfg.num_hidden_layers}")
    if cfg.block_size < 2:
        raise EyasError(f"a dflash draft's block holds the anchor and at least one slot: block_size "
                        f"{cfg.block_size} < 2")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise EyasError(f"mask_token_id {cfg.mask_token_id} is not a token of the target's vocabulary [0, "
                        f"{cfg.vocab_size}): pass --mask-token-id")


def choose_mask_token(counts: torch.Tensor, pad_token_id: int | None) -> int:
    """The default mask token: an id the target never produces in the training data (`counts` [V]: how
    often each id is trained on). The target's pad token if it is one, else the highest such id (a
    padded vocabulary's unused rows come last)."""
    never = torch.nonzero(counts == 0).flatten()
    if pad_token_id is not None and 0 <= pad_token_id < counts.numel() and counts[pad_token_id] == 0:
        return int(pad_token_id)
    if never.numel() == 0:
        raise EyasError("every token id of the vocabulary is trained on: pass --mask-token-id with an id the target "
                        "should never produce")
    return int(never[-1])

# -- reading vLLM's and SGLang's `DFlashDraftModel` (eyas.export.dflash writes it) ----------------------------


def dflash_config_from_foreign(c: dict[str, Any], where: str, target_config: Any, target: str) -> DraftConfig | None:
    """DraftConfig of a `DFlashDraftModel` config.json (eyas' export, SpecForge, z-lab); None for a config of
    another architecture. DFlash's other variants (DFlash2, Laguna, ...) are refused by name."""
    archs = c.get("architectures") or []
    named = any(str(a).startswith("DFlash") for a in archs)
    if not (named or (not archs and isinstance(c.get("dflash_config"), dict))):
        return None
    return block_draft_config(c, where, target_config, target, "dflash", "DFlashDraftModel")


def block_draft_config(c: dict[str, Any], where: str, target_config: Any, target: str, family: str,
                       architecture: str) -> DraftConfig:
    """DraftConfig from a DFlash-style config.json (a Qwen3 layer config with a `dflash_config`), refusing
    variants eyas' model does not compute."""
    block = c.get("eyas") if isinstance(c.get("eyas"), dict) else {}
    dflash = c.get("dflash_config") if isinstance(c.get("dflash_config"), dict) else {}
    archs = c.get("architectures") or [architecture]
    bad = [f"architectures={archs}"] if archs != [architecture] else []  # DFlash2, Laguna, ...: other layers
    bad += [k for k in ("attention_bias", "causal", "is_causal", "use_sliding_window") if c.get(k) or dflash.get(k)]
    bad += [f"layer_types={c['layer_types']}"] if any(t != "full_attention" for t in c.get("layer_types") or []) else []
    bad += [k for k in ("conv_kernel_size", "selector_rank", "attention_sink_bias", "projector_type") if dflash.get(k)]
    if c.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={c['hidden_act']}")
    if bad:
        raise EyasError(f"{where}: this {architecture} variant is not supported by eyas ({', '.join(bad)})")
    mask = dflash.get("mask_token_id", c.get("mask_token_id"))
    if mask is None:
        raise EyasError(f"{where}/config.json has no dflash_config.mask_token_id (SGLang would look its `<|MASK|>` "
                        "token up in the tokenizer): add the id of the mask token to dflash_config")
    target_layers = int(block.get("target_num_layers") or dflash.get("num_target_layers") or
                        c.get("num_target_layers") or 0)
    if target_config is not None:
        target_layers = int(text_config(target_config).num_hidden_layers)
    ids = stated_aux_layer_ids(c, "block", where)
    if not ids:
        raise EyasError(f"{where}: the checkpoint does not say which target layers it reads: add "
                        "dflash_config.target_layer_ids (outputs of decoder layers, 0-based)")
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    vocab = int(c["vocab_size"])
    theta, scaling = target_rope(SimpleNamespace(**{k: v for k, v in c.items()
                                                    if k in ("rope_theta", "rope_scaling", "rope_parameters")}))
    return DraftConfig(
        hidden_size=hidden,
        intermediate_size=int(c["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        vocab_size=vocab,
        draft_vocab_size=int(c.get("draft_vocab_size") or vocab),
        target_hidden_size=int(c.get("target_hidden_size") or hidden),
        aux_layer_ids=[int(i) for i in ids],
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        num_hidden_layers=int(c.get("num_hidden_layers", 1)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(c.get("max_position_embeddings") or 4096),
        family=family,
        block_size=int(dflash.get("block_size") or c.get("block_size") or 16),  # SGLang's default
        mask_token_id=int(mask),
        target=str(block.get("target") or target or ""),
        target_num_layers=target_layers,
        target_config_sha256=str(block.get("target_config_sha256") or
                                 (target_config_sha256(target_config) if target_config is not None else "")),
    )
