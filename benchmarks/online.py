"""Online training with the target in the loop: eyas against the same work done one step after the other,
and SpecForge's own online EAGLE-3 loop, in one run on one GPU.

    PYTHONPATH=. python3 benchmarks/online.py --peer-src peers/v0.2.0-git   # one H100/H200: ~10 minutes
    PYTHONPATH=. python3 benchmarks/online.py --smoke                       # CPU, tiny shapes: the script runs

A random-weight target of Llama-3.1-8B's shape (32 layers, hidden 4096, FFN 14,336, 32/8 heads, vocab
128,256; bf16), an EAGLE-3 draft of its width (draft vocabulary 32,000, TTT 7), sequences of --tokens
random tokens with the loss on their last three quarters, one sequence per optimizer step. Rows, all on
the same target module and the same draft trainer:

1. serial: per step the bare target forward (the decoder alone, nothing captured) and then eyas' draft
   optimizer step (Trainer.train_step on states captured before timing), one after the other;
2. eyas online: what `eyas train --online` runs: eyas.train.online.TargetFeed (a producer thread on a
   CUDA stream of its own capturing with the hf engine, a bounded queue of --prefetch steps, token
   batches read by DataLoader workers from a prepared dataset) feeding the same Trainer.
   Goal: >= 0.9x serial;
3. peer (--peer-src): SpecForge's in-process online loop (benchmarks/specforge_legacy_peer.py: its HF
   target backend with full-vocabulary logits, OnlineEagle3Model under FSDP, BF16Optimizer) on the same
   target and batches. Goal: eyas online >= 2x its tok/s.

Each row runs --warmup steps (torch.compile, CUDA graph capture) before --steps timed ones; tok/s counts
the sequences' tokens. Every row is drawn --repeats times (default 3), interleaved; a figure is the median
of its draws with their range, a ratio is taken per round, and a goal is met only by the ratio's whole
range (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Spread,
    interleaved,
    paired_ratio,
    random_llama,
    random_prepared,
    spread,
    sync,
    verdict,
)

from eyas.engines.hf import HFEngine  # noqa: E402
from eyas.model.config import DraftConfig, DraftOptions  # noqa: E402
from eyas.model.eagle3 import Eagle3Draft  # noqa: E402
from eyas.model.vocab import build_draft_vocab  # noqa: E402
from eyas.train.config import TrainConfig  # noqa: E402
from eyas.train.data import PackDataset, PackSchedule, SampleSource, fill_states  # noqa: E402
from eyas.train.distributed import DistInfo  # noqa: E402
from eyas.train.online import Layout, StateSpec, TargetFeed  # noqa: E402
from eyas.train.trainer import Trainer  # noqa: E402

SHAPES = {  # hidden, FFN, layers, heads, kv heads, vocab, draft vocab
    "llama8b": (4096, 14336, 32, 32, 8, 128256, 32000),
    "tiny": (64, 128, 4, 4, 2, 512, 256),
}
GOAL_SERIAL, GOAL_PEER = 0.9, 2.0


def make_target(shape: str, dev: torch.device, dtype: torch.dtype, tokens: int) -> torch.nn.Module:
    """A random-weight Llama of `shape`, built in `dtype` on `dev`."""
    return random_llama(SHAPES[shape][:6], tokens, dev, dtype, rope_theta=500000.0, tie=False)


def make_prepared(folder: Path, n: int, tokens: int, vocab: int) -> Path:
    """`n` random sequences of `tokens` tokens, the loss on their last three quarters."""
    return random_prepared(folder, [tokens] * n, vocab, tokens, f"bench-{n}-{tokens}")


def make_trainer(engine: HFEngine, shape: str, dev: torch.device, ttt: int, tokens: int,
                 counts: torch.Tensor) -> Trainer:
    """eyas' trainer with its defaults for this device (GPU: bf16, compiled, one CUDA graph per step)."""
    head = engine.target_head()
    dcfg = DraftConfig.from_target_config(engine.config, engine.aux_layer_ids,
                                          options=DraftOptions(draft_vocab_size=SHAPES[shape][6]))
    torch.manual_seed(0)
    draft = Eagle3Draft(dcfg)
    draft.set_vocab(*build_draft_vocab(counts, dcfg.draft_vocab_size))
    draft.load_target_embedding(head.embed_tokens, head.embed_scale)
    cfg = TrainConfig(ttt_steps=ttt, token_budget=tokens)
    return Trainer(cfg, draft, head, DistInfo(device=dev), total_steps=10**6)


def timed(run_step, steps: int, warmup: int, tokens: int, dev: torch.device) -> float:
    """tok/s of `steps` calls of run_step() after `warmup` untimed ones."""
    for _ in range(warmup):
        run_step()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        run_step()
    sync(dev)
    return steps * tokens / (time.perf_counter() - t0)


def serial(engine: HFEngine, trainer: Trainer, rows: list[dict], args, dev: torch.device) -> float:
    """The bare target forward, then the draft's step on states captured before timing."""
    ready = [fill_states(r, engine) for r in rows]
    turn = iter(range(10**9))

    def step() -> None:
        k = next(turn) % len(rows)
        with torch.inference_mode():
            engine.text_model(input_ids=rows[k]["input_ids"].to(dev)[None], use_cache=False)
        trainer.train_step([ready[k]])

    return timed(step, args.steps, args.warmup, args.tokens, dev)


def online(engine: HFEngine, trainer: Trainer, prepared: Path, args, dev: torch.device) -> float:
    """`eyas train --online`'s data path feeding the same trainer."""
    lengths = np.full(args.steps + args.warmup + 4, args.tokens)
    plan = PackSchedule(lengths, args.tokens, seed=0, world=1, grad_accum=1)
    feed = TargetFeed(engine, Layout(0, 0, [0]), StateSpec.probe(engine), dev, depth=args.prefetch)
    batches = feed.batches(SampleSource(prepared, "prepared"), plan, 0, 0, args.steps + args.warmup,
                           num_workers=args.workers, pin=dev.type == "cuda", pad_to=args.tokens,
                           embed_table=trainer.embed_table)
    try:
        return timed(lambda: trainer.train_step(next(batches)[2]), args.steps, args.warmup, args.tokens, dev)
    finally:
        feed.close()


class Peer:
    """SpecForge's online loop on the same target, rows and draft vocabulary, built on its first call and kept
    (imported, in its process group) until close(): each call is one draw of its tok/s, or why it cannot run."""

    def __init__(self, path: str, engine: HFEngine, vocab: tuple[torch.Tensor, torch.Tensor], rows: list[dict],
                 args, dev: torch.device) -> None:
        self.path, self.engine, self.vocab, self.rows, self.args, self.dev = path, engine, vocab, rows, args, dev
        self.stack = contextlib.ExitStack()
        self.step: Callable[[], None] | None = None

    def __call__(self) -> str | float:
        import specforge_legacy_peer as sf

        if self.dev.type != "cuda":
            return "not run: its loop wraps the draft in FSDP and needs a GPU"
        try:
            if self.step is None:
                self.step = self._build(sf)
            return timed(self.step, self.args.steps, self.args.warmup, self.args.tokens, self.dev)
        except sf.PeerUnusable as e:
            return f"cannot be driven ({e})"

    def _build(self, sf) -> Callable[[], None]:
        from specforge_peer import one_process_group

        api = self.stack.enter_context(sf.imported(Path(self.path).expanduser().resolve()))
        self.stack.enter_context(one_process_group())
        d2t, t2d = self.vocab
        engine, args = self.engine, self.args
        step = sf.build_step(api, engine.model, engine.aux_layer_ids, d2t.to(self.dev), t2d.to(self.dev), args.ttt,
                             args.peer_attention)
        turn = iter(range(10**9))

        def one() -> None:
            r = self.rows[next(turn) % len(self.rows)]
            step(r["input_ids"][: args.tokens], r["loss_mask"][: args.tokens])

        return one

    def close(self) -> None:
        self.step = None
        self.stack.close()


def report(draws: dict[str, list[str | float]]) -> dict[str, Spread]:
    """Medians (ranges) of each row, eyas online's ratio to each per round, and the goals judged on the whole
    range of that ratio (benchmarks/common.py). Returns the ratios."""
    o = draws["eyas online"]
    rows = [("serial", "serial: bare target forward, then the draft step", GOAL_SERIAL),
            ("eyas online", "eyas online (TargetFeed + Trainer)", None), ("peer", "SpecForge online loop", GOAL_PEER)]
    print("\n| row | tok/s, median (range) | eyas online ÷ this, per round | goal |")
    print("| --- | ---: | ---: | --- |")
    ratios = {}
    for key, label, goal in rows:
        got = draws.get(key)
        if got is None:
            continue
        if any(isinstance(g, str) for g in got):
            print(f"peer: {next(g for g in got if isinstance(g, str))}")
            continue
        ratios[key] = paired_ratio(o, got)
        judged = f">= {goal}x: {verdict(ratios[key], goal)}" if goal else ""
        print(f"| {label} | {spread(got).show()} | {ratios[key].show('.2f', 'x')} | {judged} |")
    return ratios


def main(argv: list[str] | None = None) -> dict[str, Spread]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, fp32: check that the script runs")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per sequence = per optimizer step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--prefetch", type=int, default=2, help="steps of states the feed computes ahead")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers of the feed")
    ap.add_argument("--peer-src", help="a SpecForge tree with its in-process online loop (the v0.2.0 tag)")
    ap.add_argument("--peer-attention", default="flex_attention", help="its draft attention: flex_attention, sdpa")
    ap.add_argument("--repeats", type=int, default=3, help="draws of every row, interleaved (medians, ranges)")
    ap.add_argument("--work-dir", help="where the prepared dataset of random tokens goes (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.steps, args.warmup, args.workers = min(args.tokens, 128), 3, 1, 0
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke on CPU")
    shape, dev = ("tiny", torch.device("cpu")) if args.smoke else ("llama8b", torch.device("cuda"))
    dtype = torch.float32 if args.smoke else torch.bfloat16
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"online benchmark: {shape} target ({dtype}) on {card}, torch {torch.__version__}, {args.tokens} tokens a "
          f"step, TTT {args.ttt}, {args.steps} timed steps after {args.warmup}, {args.repeats} interleaved draws of "
          "every row", flush=True)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        prepared = make_prepared(Path(tmp) / "prepared", args.steps + args.warmup + 4, args.tokens, SHAPES[shape][5])
        engine = HFEngine(make_target(shape, dev, dtype, args.tokens), dtype=dtype, device=dev)
        counts = torch.ones(SHAPES[shape][5], dtype=torch.int64)
        trainer = make_trainer(engine, shape, dev, args.ttt, args.tokens, counts)
        plan = PackSchedule(np.full(4, args.tokens), args.tokens, seed=0, world=1, grad_accum=1)
        rows = [PackDataset(SampleSource(prepared, "prepared"), plan.packs(0), args.tokens, args.tokens, False)[k]
                for k in range(4)]
        cases: dict[str, Callable[[], str | float]] = {
            "serial": lambda: serial(engine, trainer, rows, args, dev),
            "eyas online": lambda: online(engine, trainer, prepared, args, dev)}
        if args.peer_src:  # held beside eyas' trainer, so that every round runs all three
            vocab = trainer.draft.d2t.cpu(), trainer.draft.t2d.cpu()
            cases["peer"] = peer = Peer(args.peer_src, engine, vocab, rows, args, dev)
        try:
            draws = dict(zip(cases, interleaved([noted(k, f) for k, f in cases.items()], args.repeats), strict=True))
        finally:
            if args.peer_src:
                peer.close()
        return report(draws)


def noted(name: str, case: Callable[[], str | float]) -> Callable[[], str | float]:
    """`case`, printing each draw as it comes."""
    def run() -> str | float:
        got = case()
        print(f"{name}: " + (got if isinstance(got, str) else f"{got:,.0f} tok/s"), flush=True)
        return got
    return run


if __name__ == "__main__":
    main()
