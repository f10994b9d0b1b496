"""Shared by the P-EAGLE tests: a P-EAGLE draft for a transformers target, a quick training loop on the
target's own states (the objective of eyas.train.peagle), and a plain-torch P-EAGLE forward written from
the description in NOTES (vLLM's parallel drafting over llama_eagle3.py), independent of eyas.model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _draft_utils import capture, draft_for_target, padded_dist, rms, rope, train_on

from eyas.model.config import DraftOptions
from eyas.model.peagle import PEagleDraft
from eyas.model.vocab import draft_to_target_ids, target_to_draft_ids
from eyas.train.loss import TargetDist
from eyas.train.peagle import ParallelConfig, ParallelObjective

__all__ = ["capture", "make_peagle", "reference_parallel_logits", "target_dist", "train_peagle"]


def make_peagle(target, aux_ids: list[int], draft_vocab: int, mask_token_id: int,
                seqs: list[list[int]] | None = None, layers: int = 1, seed: int = 0) -> PEagleDraft:
    """A P-EAGLE draft shaped for `target` (a transformers causal LM), its embedding the target's and its
    head started from the target's."""
    opts = DraftOptions(family="peagle", draft_vocab_size=draft_vocab, mask_token_id=mask_token_id,
                        draft_layers=layers)
    return draft_for_target(PEagleDraft, target, aux_ids, opts, seqs, seed)


def target_dist(draft: PEagleDraft, logits: torch.Tensor, pad: int) -> TargetDist:
    """The target's distribution over the draft vocabulary from its logits [T, V] (+ `pad` empty rows), with
    the draft vocabulary's mass (the LK losses read it)."""
    full = torch.softmax(logits.float(), -1)
    vocab = draft_to_target_ids(draft.d2t)
    mass = full[:, vocab].sum(-1)
    return padded_dist(full[:, vocab] / mass[:, None], target_to_draft_ids(draft.t2d)[logits.argmax(-1)], pad, mass)


def train_peagle(draft: PEagleDraft, data, steps: int, depths: int = 4, lr: float = 3e-3) -> list[float]:
    """The P-EAGLE objective on whole sequences, one per step; returns the per-step loss / valid depth-0 count."""
    objective = ParallelObjective(draft, ParallelConfig(depths=depths, attention="math"))
    return train_on(draft, objective, lambda logits: target_dist(draft, logits, depths + 1), data, steps, lr)


# -- an independent P-EAGLE forward: plain tensors, no eyas model code --------------------------------------


@torch.no_grad()
def reference_parallel_logits(draft: PEagleDraft, aux: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                              slots: int) -> torch.Tensor:
    """aux [n, k*H_t] the target's states at the verified positions, tokens [n] the token after each (the
    last: the newest), positions [n] -> logits [1 + slots, V_d] at the newest position and `slots` mask
    slots after it: one causal forward, inputs (token, fc(aux)) then (mask embedding, fc(mask_hidden)),
    the first layer over [norm(embedding) ; norm(hidden)] with the hidden state as its residual."""
    w = {k: v.float() for k, v in draft.state_dict().items()}
    c = draft.config
    nh, nkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    n = tokens.numel()
    emb = torch.cat([w["embed_tokens.weight"][tokens], w["mask_embed"][None].expand(slots, -1)])
    hidden = torch.cat([aux.float(), w["mask_hidden"].expand(slots, -1)]) @ w["fc.weight"].T
    pos = torch.cat([positions, positions[-1] + 1 + torch.arange(slots)])
    T = n + slots
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = hidden
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        if i == 0:
            h = torch.cat([rms(emb, w[p + "input_layernorm.weight"], eps), rms(x, w[p + "hidden_norm.weight"], eps)],
                          -1)
        else:
            h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, hd), pos, c.rope_theta)
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd), pos, c.rope_theta)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
        att = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
        hh = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(hh @ w[p + "mlp.gate_proj.weight"].T) * (hh @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return (rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T)[n - 1:]

