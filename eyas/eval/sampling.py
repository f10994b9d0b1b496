"""Lossless speculative sampling, every row of a batch at once on the device (no host sync, so a round that
samples can be one CUDA graph).

Every rule here keeps the target's output distribution exactly:

- chain: standard speculative sampling (Leviathan et al., Chen et al.): accept d_j with probability
  min(1, p_j(d_j) / q_j(d_j)); at the first rejection sample from norm(max(0, p_j - q_j)); if all are
  accepted, sample the bonus token from p_{K+1}.
- tree: the children of a node are distinct tokens picked deterministically (top-k of the draft), so each
  is a point-mass proposal. Try them in order: accept child c with probability p'(c), where p' is p with
  the children tried before zeroed and renormalised; if none is accepted sample from that residual. This
  is the EAGLE rule (recursive rejection sampling), and it samples exactly from p.

Greedy decoding (temperature 0) needs none of this: the batched decoder matches argmaxes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature and nucleus (top-p) filtering.

    This *is* the distribution speculative sampling preserves: the target's own sampling distribution.
    """
    if temperature <= 0:
        raise ValueError("target_probs needs temperature > 0 (temperature 0 is greedy decoding)")
    logits = logits.float() / temperature
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # keep a token when the mass strictly before it is below top_p (the top token is always kept)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[..., V] -> [...] one draw per row: the exponential race (argmax p / E, E ~ Exp(1)), which has no
    host sync and a fixed shape, unlike torch.multinomial."""
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-30)
    return (probs / race).argmax(-1)


@dataclass
class Sampling:
    """Temperature and top-p of the target's sampling distribution, and the device generator every draw of a
    decoder takes its randomness from."""

    temperature: float
    top_p: float
    generator: torch.Generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return target_probs(logits, self.temperature, self.top_p)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        return draw(probs, self.generator)


def accept_chain(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of B chains. drafts [B, K] (target ids drawn from q), q [B, K, V] the draft's
    distributions over the target's vocabulary, p [B, K+1, V] the target's. -> accepted counts [B] and the
    next token [B] (from the residual at the first rejection, else from p at K)."""
    B, K = drafts.shape
    if q.shape[-1] < p.shape[-1]:  # a target whose head is wider than its vocabulary (padded rows)
        q = torch.nn.functional.pad(q, (0, p.shape[-1] - q.shape[-1]))
    p_d = p[:, :K].gather(2, drafts[..., None])[..., 0]
    q_d = q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(B, K, device=p.device, generator=generator)
    acc = (u * q_d < p_d).long().cumprod(1).sum(1)  # u < p/q; q_d > 0 for sampled tokens
    at = acc[:, None, None].expand(-1, 1, p.shape[-1])
    p_at = p.gather(1, at)[:, 0]
    q_at = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1).gather(1, at)[:, 0]  # nothing drafted past K
    return acc, draw(_renormalised((p_at - q_at).clamp_min(0), p_at), generator)


def accept_tree(ids: torch.Tensor, parents: torch.Tensor, p: torch.Tensor, max_depth: int,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling down B trees of point-mass proposals (the EAGLE rule).

    ids [B, N+1] (the root first), parents [B, N] in 0..N (0 = the root), p [B, N+1, V] the target's
    distributions at every node. Children are tried in index order. -> accepted counts [B], the path
    [B, max_depth+1] (the root first; entries past the count are the root) and the next token [B]."""
    B, N1 = ids.shape
    V, dev = p.shape[-1], p.device
    parent_all = torch.cat([torch.full_like(parents[:, :1], -1), parents], dim=1)  # the root is no child
    pc = p.reshape(B, N1 * V).gather(1, parent_all.clamp_min(0) * V + ids)  # p(node's token) at its parent
    u = torch.rand(B, N1, device=dev, generator=generator)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    path = torch.zeros(B, max_depth + 1, dtype=torch.long, device=dev)
    for d in range(1, max_depth + 1):
        child = parent_all == cur[:, None]  # [B, N+1]
        tried = torch.where(child, pc, 0)
        removed = tried.cumsum(1) - tried  # the mass of the siblings tried before
        ok = child & (u * (1 - removed).clamp_min(0) < pc)
        hit = alive & ok.any(1)
        cur = torch.where(hit, ok.int().argmax(1), cur)
        path[:, d] = torch.where(hit, cur, 0)
        alive &= hit
    acc = (path[:, 1:] > 0).sum(1)
    p_cur = p.gather(1, cur[:, None, None].expand(-1, 1, V))[:, 0]
    # every child of the last accepted node was tried and rejected (a leaf has none): zero their tokens
    rejected = torch.where(parent_all == cur[:, None], ids, V)
    keep = torch.ones(B, V + 1, device=dev).scatter_(1, rejected, 0)[:, :V]
    return acc, path, draw(_renormalised(p_cur * keep, p_cur), generator)


def _renormalised(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """residual [B, V] normalised; where it holds no mass (p <= q everywhere means p == q, where rejection has
    probability 0: only rounding gets here) the fallback."""
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(1e-30), fallback)
