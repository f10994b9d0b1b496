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
        run_extract(ExtractOptions(prepared=prepared, out=store, model=str(target), engine="hf", aux_layer_ids=AUX,
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


class StoreRounded:
    """A target engine whose states and head come out in bf16, as `eyas extract` stores them: an online
    run then trains on the very numbers an offline run from the store reads."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def capture_flat(self, seqs):
        from eyas.engines.base import FlatCapture

        cap = self.engine.capture_flat(seqs)
        return FlatCapture(cap.aux.bfloat16(), cap.final.bfloat16(), cap.cu_seqlens)

    def target_head(self):
        from eyas.engines.head import TargetHead

        h = self.engine.target_head()
        return TargetHead(h.embed_tokens.bfloat16(), h.norm_weight.bfloat16(), h.lm_head.bfloat16(), h.norm_eps,
                          h.norm_offset, h.embed_scale)


def train_store(root: Path) -> tuple[Path, Path, Path]:
    """make_store under `root`, built on one thread (the CPU is shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return make_store(root)
    finally:
        torch.set_num_threads(n)


TINY_EAGLE3 = dict(draft_vocab_size=48, ttt_steps=3, token_budget=256, num_workers=0, report_to="none", log_every=1,
                   save_every=0, lr=3e-3)  # a small EAGLE-3 draft: vocab 48, TTT 3, 256-token packs, a row per step


def train_quietly(out: Path, target_engine=None, **opts) -> dict:
    """`run_train` of TrainOptions(out=out, **opts), its log dropped; `stop_after=N` stops the run after N steps
    as a kill would; `target_engine` is an online run's target engine object (else the run starts its own)."""
    from eyas.recipes.train import TrainOptions, run_train

    stop_after = opts.pop("stop_after", 0)
    return run_train(TrainOptions(out=out, **opts), engine=target_engine, log=lambda m: None, stop_after=stop_after)


def run_tiny_train(out: Path, store: Path | None, **kw) -> dict:
    """train_quietly with TINY_EAGLE3's options, `kw` overriding any of them."""
    return train_quietly(out, store=store, **{**TINY_EAGLE3, **kw})


def metric_rows(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def same_curve(a: list[dict], b: list[dict], tol: float) -> None:
    """Two metrics.jsonl logs with the same steps, losses within `tol` (relative), the same valid tokens."""
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) > 4
    for x, y in zip(a, b, strict=True):
        x, y = x.get("val", x), y.get("val", y)
        assert abs(x["loss"] - y["loss"]) <= tol * x["loss"], (x, y)
        assert x["valid_tokens"] == y["valid_tokens"]


def without_rates(rows: list[dict]) -> list[dict]:
    """metrics.jsonl rows without the wall-clock rate, which no two runs share."""
    return [{k: v for k, v in r.items() if k != "tok_per_s"} for r in rows]
