"""Shared by the trainer tests: a tiny random Llama target, a prepared dataset of random token
sequences, and a real hidden-state store extracted from them with the hf engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

VOCAB = 64
AUX = [1, 3, 4]


def make_target(folder: Path) -> Path:
    """A 6-layer random Llama (hidden 32) whose next-token distributions are sharp enough that its
    argmax is a learnable function of the context."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, rope_theta=10000.0,
                      tie_word_embeddings=False, initializer_range=0.15)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # logits of std ~7: a confident target, not a uniform one
    model.save_pretrained(folder)
    return folder


def make_prepared(folder: Path, n: int = 160, seed: int = 0, lo: int = 12, hi: int = 72) -> Path:
    from eyas.data.prepared import PreparedWriter

    rng = np.random.default_rng(seed)
    w = PreparedWriter(folder, vocab_size=VOCAB)
    for _ in range(n):
        T = int(rng.integers(lo, hi))
        ids = rng.integers(0, VOCAB, T)
        mask = np.zeros(T, dtype=np.uint8)
        mask[T // 4:] = 1  # a "prompt" quarter, then the trained "reply"
        w.add(ids, mask)
    w.finish(tokenizer="random", chat_template_sha256="", max_length=hi, skipped={}, truncated=0,
             options_sha256=f"test-{n}-{seed}", sources=[])
    return folder


def make_store(root: Path, n: int = 160) -> tuple[Path, Path, Path]:
    """(target folder, prepared folder, store folder) under `root`, built once per root."""
    from eyas.recipes.extract import ExtractOptions, run_extract

    target, prepared, store = root / "target", root / "prepared", root / "store"
    if not (store / "manifest.json").is_file():
        make_target(target)
        make_prepared(prepared, n=n)
        run_extract(ExtractOptions(prepared=prepared, out=store, model=str(target), engine="hf", aux_layers=AUX,
                                   dtype="float32", device="cpu", token_budget=4096))
    return target, prepared, store


def plain_reply_positions(mask: list[bool], docs: list[int]) -> list[tuple[int, int]]:
    """The plain way, per token: (its index in its reply, that reply's number in its document), a reply
    being a run of trained tokens inside one document; (-1, 0) for untrained tokens."""
    out, replies, run = [], {}, 0
    for q, (m, d) in enumerate(zip(mask, docs, strict=True)):
        if m and (q == 0 or not mask[q - 1] or docs[q - 1] != d):
            replies[d], run = replies.get(d, 0) + 1, 0
        elif m:
            run += 1
        out.append((run, replies[d]) if m else (-1, 0))
    return out


def first_reply_openings(mask: list[bool], docs: list[int], tokens: int) -> list[bool]:
    """Is each token among the first `tokens` of its document's first reply?"""
    return [reply == 1 and pos < tokens for pos, reply in plain_reply_positions(mask, docs)]
