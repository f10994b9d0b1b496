"""Shared by the DFlash tests: a DFlash draft for a transformers target, a quick training loop on the
target's own states (the objective of eyas.train.dflash), and a plain-torch DFlash forward written
from the description in NOTES / vLLM's qwen3_dflash.py, independent of eyas.model.dflash."""

from __future__ import annotations

import torch
from _draft_utils import capture, draft_for_target, padded_dist, rms, rope, train_on

from eyas.model.config import DraftOptions
from eyas.model.dflash import DFlashDraft
from eyas.model.vocab import draft_to_target_ids, target_to_draft_ids
from eyas.train.dflash import BlockConfig, BlockObjective
from eyas.train.loss import TargetDist

__all__ = ["capture", "make_dflash", "reference_block_logits", "target_dist", "train_dflash"]


def make_dflash(target, aux_ids: list[int], draft_vocab: int, block_size: int, mask_token_id: int,
                seqs: list[list[int]] | None = None, layers: int = 1, seed: int = 0) -> DFlashDraft:
    """A DFlash draft shaped for `target` (a transformers causal LM), its embedding and head the target's."""
    opts = DraftOptions(family="dflash", draft_vocab_size=draft_vocab, block_size=block_size,
                        mask_token_id=mask_token_id, draft_layers=layers)
    return draft_for_target(DFlashDraft, target, aux_ids, opts, seqs, seed)


def target_dist(draft: DFlashDraft, logits: torch.Tensor, pad: int) -> TargetDist:
    """The target's distribution over the draft vocabulary from its logits [T, V] (+ `pad` empty rows)."""
    probs = torch.softmax(logits[:, draft_to_target_ids(draft.d2t)], -1)
    return padded_dist(probs, target_to_draft_ids(draft.t2d)[logits.argmax(-1)], pad)


def train_dflash(draft: DFlashDraft, data, steps: int, anchors: int = 16, lr: float = 3e-3) -> list[float]:
    """The DFlash objective on whole sequences, one per step; returns the per-step loss / valid slot-1 count."""
    B = draft.config.block_size
    objective = BlockObjective(draft, BlockConfig(block_size=B, gamma=4.0, anchors=anchors, attention="math"))
    return train_on(draft, objective, lambda logits: target_dist(draft, logits, B), data, steps, lr)


# -- an independent DFlash forward: plain tensors, no eyas model code --------------------------------------


@torch.no_grad()
def reference_block_logits(draft: DFlashDraft, aux: torch.Tensor, context_pos: torch.Tensor, block: torch.Tensor,
                           block_pos: torch.Tensor) -> torch.Tensor:
    """aux [C, k*H_t] the target's states of the context, block [Q] token ids -> logits [Q, V_d]: the
    context's keys in every layer (hidden_norm(fc(aux)), no input_layernorm), q/k norms per head, rope
    at absolute positions, no mask at all (the block sees the whole context and itself)."""
    w = {k: v.float() for k, v in draft.state_dict().items()}
    c = draft.config
    nh, nkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    ctx = rms(aux.float() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = w["embed_tokens.weight"][block]
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = rope(rms((h @ w[p + "self_attn.q_proj.weight"].T).view(-1, nh, hd), w[p + "self_attn.q_norm.weight"],
                       eps), block_pos, c.rope_theta)
        kv_in = torch.cat([ctx, h])
        k = rope(rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd),
                       w[p + "self_attn.k_norm.weight"], eps), torch.cat([context_pos, block_pos]), c.rope_theta)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5, -1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(len(block), -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T
