"""The inputs benchmarks/train.py (and families.py, train_checks.py) train on: draft shapes, random stored
states, target heads and draft vocabularies, the same for eyas and the peer, and the draft's FLOPs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.engines.head import TargetHead
from eyas.model.config import DraftConfig
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.vocab import build_draft_vocab


@dataclass
class Shape:
    name: str
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_vocab: int
    rope_theta: float


SHAPES = {
    "smol": Shape("smol", 576, 1536, 9, 3, 64, 49152, 32000, 100000.0),
    "llama8b": Shape("llama8b", 4096, 14336, 32, 8, 128, 128256, 32000, 500000.0),
    "tiny": Shape("tiny", 64, 128, 4, 2, 16, 1000, 500, 10000.0),
}


def draft_config(s: Shape) -> DraftConfig:
    return DraftConfig(hidden_size=s.hidden, intermediate_size=s.inter, num_attention_heads=s.heads,
                       num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab,
                       draft_vocab_size=s.draft_vocab, target_hidden_size=s.hidden, aux_layer_ids=[2, 15, 27],
                       rope_theta=s.rope_theta, max_position_embeddings=131072)


def draft_flops_per_token(cfg: DraftConfig, T: int, steps: int) -> float:
    """Training FLOPs per token of the draft: matmuls and attention, backward = 2x forward (fc: 1x,
    its input needs no gradient). Attention at step j: causal over the step-0 keys (avg (T+1)/2)
    plus j same-row keys. The target head's logits are not counted (they are not the draft's)."""
    H, inter, nh, nkv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.head_dim
    fc = 2 * cfg.num_aux_layers * cfg.target_hidden_size * H
    proj = 2 * 2 * H * (nh + 2 * nkv) * hd + 2 * nh * hd * H + 2 * 3 * H * inter + 2 * H * cfg.draft_vocab_size
    attn = sum(4 * nh * hd * ((T + 1) / 2 + j) for j in range(steps))
    return 3 * (steps * proj + attn) + 2 * fc


def random_target(shape: Shape, dev: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's lm_head and the draft vocabulary (d2t, t2d), drawn from `seed`: eyas and the peer get
    the same ones."""
    g = torch.Generator(device=dev).manual_seed(seed)
    lm_head = torch.randn(shape.vocab, shape.hidden, generator=g, device=dev) * 0.05
    counts = torch.randint(0, 10**6, (shape.vocab,), generator=torch.Generator().manual_seed(seed))
    d2t, t2d = build_draft_vocab(counts, shape.draft_vocab)
    return lm_head.to(torch.bfloat16 if dev.type == "cuda" else torch.float32), d2t, t2d


def random_setup(shape: Shape, dev: torch.device, seed: int = 0) -> tuple[Eagle3Draft, TargetHead]:
    torch.manual_seed(seed)
    lm_head, d2t, t2d = random_target(shape, dev, seed)
    with torch.device(dev):
        draft = Eagle3Draft(draft_config(shape))
        head = TargetHead(torch.empty(0), torch.ones(shape.hidden), lm_head, 1e-5)
    draft.set_vocab(d2t, t2d)
    return draft, head


def random_batch(shape: Shape, T: int, docs: int, pin: bool, seed: int = 0) -> dict:
    """One packed row as eyas.train.data.collate_pack makes it (random ids and stored states)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [T // docs] * (docs - 1) + [T - (T // docs) * (docs - 1)]
    pos = torch.cat([torch.arange(n) for n in lengths])
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    mask = torch.ones(T, dtype=torch.bool)
    mask[pos < 8] = False  # a short "prompt" per document
    b = {"input_ids": torch.randint(0, shape.vocab, (T,), generator=g), "loss_mask": mask, "position_ids": pos,
         "document_ids": doc, "aux_hidden": torch.randn(T, 3 * shape.hidden, generator=g).to(torch.bfloat16),
         "final_hidden": (4 * torch.randn(T, shape.hidden, generator=g)).to(torch.bfloat16)}
    if pin:
        b = {k: v.pin_memory() for k, v in b.items()}
    b.update(multi_doc=docs > 1, num_tokens=T, lengths=lengths)
    return b
