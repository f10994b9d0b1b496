"""Acceptance rules of speculative decoding: greedy matching and lossless rejection sampling.

Every rule here keeps the target's output distribution exactly (greedy: the target's argmax
sequence). They are small pure functions so that they can be tested statistically on their own.

- chain, greedy: accept draft tokens while they equal the target's argmax; the target's argmax at
  the first mismatch (or after the last draft token) is the bonus token.
- chain, sampling: standard speculative sampling (Leviathan et al., Chen et al.): accept d_j with
  probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection sample from norm(max(0, p_j - q_j));
  if all are accepted, sample the bonus token from p_{K+1}.
- tree, sampling: the children of a node are distinct tokens picked deterministically (top-k of the
  draft), so each is a point-mass proposal. Try them in order: accept child c with probability
  p'(c), where p' is p with the children tried before zeroed and renormalised; if none is accepted
  sample from that residual. This is the EAGLE rule, and it samples exactly from p.
"""

from __future__ import annotations

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


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[..., V] -> [...] one draw per row."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def verify_chain_greedy(draft_tokens: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """draft_tokens [K], target_argmax [K+1] (host lists) -> (accepted count, next token)."""
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def verify_chain_sampling(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                          generator: torch.Generator | None) -> tuple[int, int]:
    """Standard speculative sampling for one chain.

    draft_tokens [K] (target ids, sampled from q), q [K, V] the draft's distributions they were
    drawn from, p [K+1, V] the target's distributions. Returns (accepted count, next token).
    """
    K = draft_tokens.shape[0]
    rows = torch.arange(K, device=p.device)
    p_d, q_d = p[rows, draft_tokens], q[rows, draft_tokens]  # [K]
    u = torch.rand(K, device=p.device, generator=generator)
    accept = (u * q_d < p_d).int()  # u < p/q, q_d > 0 for sampled tokens
    n = int(accept.cumprod(0).sum())  # one host sync per step
    if n == K:
        return n, int(sample(p[K], generator))
    residual = (p[n] - q[n]).clamp_min(0)
    total = residual.sum()
    # p <= q everywhere means p == q, where rejection has probability 0: only rounding gets here
    dist = residual / total if float(total) > 0 else p[n]
    return n, int(sample(dist, generator))


def walk_tree_greedy(parents: list[int], tokens: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """Follow the target's argmax down the tree.

    parents [N+1] (parents[0] is the root's, ignored), tokens [N+1], target_argmax [N+1]; children of
    a node are tried in index order. Returns (accepted node indices, root excluded; next token).
    """
    children = _children(parents)
    cur, path = 0, []
    while True:
        want = target_argmax[cur]
        nxt = next((c for c in children[cur] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        cur = nxt


def walk_tree_sampling(parents: list[int], tokens: list[int], p: torch.Tensor,
                       generator: torch.Generator | None) -> tuple[list[int], int]:
    """Recursive rejection sampling over a tree of point-mass proposals (the EAGLE rule).

    p [N+1, V] target distributions at every tree node. Returns (accepted node indices, next token).
    """
    n = len(parents)
    children = _children(parents)
    # p(child token) at its parent, and one uniform per node: all fetched in a single host sync
    par = torch.tensor(parents[1:], device=p.device)
    tok = torch.tensor(tokens[1:], device=p.device)
    pc = torch.zeros(n, device=p.device)
    pc[1:] = p[par, tok]
    u = torch.rand(n, device=p.device, generator=generator)
    pc_l, u_l = torch.stack([pc, u]).tolist()
    cur, path = 0, []
    while True:
        removed, tried, accepted = 0.0, [], None
        for c in children[cur]:
            if u_l[c] * max(1.0 - removed, 0.0) < pc_l[c]:
                accepted = c
                break
            removed += pc_l[c]
            tried.append(c)
        if accepted is None:
            residual = p[cur].clone()
            if tried:
                residual[torch.tensor([tokens[c] for c in tried], device=p.device)] = 0
                total = residual.sum()
                residual = residual / total if float(total) > 0 else p[cur]
            return path, int(sample(residual, generator))
        path.append(accepted)
        cur = accepted


def _children(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        children[parents[i]].append(i)
    return children
