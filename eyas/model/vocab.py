"""The draft vocabulary: the most frequent trained tokens, with maps to and from the target's ids."""

from __future__ import annotations

import torch


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the `draft_vocab_size` most frequent target tokens.

    token_counts: [V] counts over loss-masked tokens.
    Returns d2t [V_d] int64 in offset form (target_id = draft_id + d2t[draft_id]) and t2d [V] bool.
    Draft ids keep the target's id order. When fewer distinct tokens were seen than the draft
    vocabulary holds, the rest is filled with unseen ids, lowest first, so the size is always exact.
    """
    counts = token_counts.to(torch.int64).flatten()
    vocab = counts.numel()
    size = min(int(draft_vocab_size), vocab)
    # Stable order: by count descending, ties by lower id first.
    order = torch.argsort(-counts, stable=True)
    chosen = torch.sort(order[:size]).values  # [V_d] target ids, ascending
    d2t = chosen - torch.arange(size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[V_d] target id of each draft id."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def target_to_draft_ids(t2d: torch.Tensor) -> torch.Tensor:
    """[V] draft id of each target id, -1 where the target token is not in the draft vocabulary."""
    idx = torch.full(t2d.shape, -1, dtype=torch.int64, device=t2d.device)
    idx[t2d] = torch.arange(int(t2d.sum()), device=t2d.device)
    return idx
