"""Shared by the one-forward drafters' test helpers (_dflash_utils, _peagle_utils): a draft shaped for a
transformers target, the target's states captured, a quick training loop on them, and the plain-torch
rms norm and rotary embedding their independent reference forwards are written with."""

from __future__ import annotations

from collections.abc import Callable

import torch

from eyas.model.config import DraftConfig, DraftOptions
from eyas.model.draft import DraftModel
from eyas.model.vocab import build_draft_vocab
from eyas.train.loss import TargetDist


def draft_for_target(cls: type[DraftModel], target, aux_ids: list[int], opts: DraftOptions,
                     seqs: list[list[int]] | None, seed: int) -> DraftModel:
    """A `cls` draft shaped for `target` (a transformers causal LM): its embedding the target's, its head
    started from the target's, its vocabulary the ids most frequent in `seqs` (the first ones without)."""
    torch.manual_seed(seed)
    cfg = DraftConfig.from_target_config(target.config, aux_ids, options=opts)
    draft = cls(cfg)
    draft.load_target_embedding(target.get_input_embeddings().weight.detach())
    counts = torch.zeros(cfg.vocab_size, dtype=torch.long)
    if seqs is not None:
        counts = torch.bincount(torch.tensor(sum(seqs, [])), minlength=cfg.vocab_size)
    draft.set_vocab(*build_draft_vocab(counts, cfg.draft_vocab_size))
    draft.init_lm_head_from_target(target.lm_head.weight.detach(), target.model.norm.weight.detach())
    return draft.eval()


@torch.no_grad()
def capture(target, seqs: list[list[int]], aux_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(ids [T], aux [T, k*H], logits [T, V]) per sequence, through output_hidden_states."""
    out = []
    for s in seqs:
        o = target(torch.tensor([s]), output_hidden_states=True)
        out.append((torch.tensor(s), torch.cat([o.hidden_states[i][0] for i in aux_ids], -1), o.logits[0].float()))
    return out


def padded_dist(probs: torch.Tensor, ids: torch.Tensor, pad: int, mass: torch.Tensor | None = None) -> TargetDist:
    """probs [T, V_d], ids [T] (and mass [T]) + `pad` empty rows: the rows past the end train nothing."""
    return TargetDist(torch.cat([probs, torch.zeros(pad, probs.shape[1])]),
                      torch.cat([ids, torch.full((pad,), -1, dtype=torch.long)]),
                      None if mass is None else torch.cat([mass, torch.zeros(pad)]))


def train_on(draft: DraftModel, objective, dist: Callable[[torch.Tensor], TargetDist], data, steps: int,
             lr: float) -> list[float]:
    """`objective` on whole sequences (one document each), one per step, `dist(logits)` the target's; returns
    the per-step loss / the count of its first stats row (the family's normalisation)."""
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    draft.train()
    losses = []
    for step in range(steps):
        ids, aux, logits = data[step % len(data)]
        T = ids.numel()
        loss, stats = objective(ids, aux, torch.arange(T), torch.ones(T, dtype=torch.bool),
                                torch.zeros(T, dtype=torch.long), dist(logits), seed=step)
        loss = loss / stats[0, 2].clamp(min=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    draft.eval()
    return losses


# -- plain-torch pieces of the independent reference forwards --------------------------------------------------


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):  # x [n, heads, d], neox (rotate-half) layout
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()
    return x * cos[:, None] + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin[:, None]
