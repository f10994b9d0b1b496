"""Draft families side by side on one GPU: each family's training step, and its GPU attention path checked.

    PYTHONPATH=. python3 benchmarks/families.py             # one H100/H200: ~3-4 minutes
    PYTHONPATH=. python3 benchmarks/families.py --smoke     # CPU, tiny shapes: the script runs

For each family (eagle3: TTT; dflash: blocks from sampled anchors; peagle: one forward over sampled depths)
and shape (a SmolLM2-shaped and a Llama-3.1-8B-shaped draft, one decoder layer each, draft vocabulary
32,000), from the same random stored states and target head:
1. on a GPU, the family's objective with flex attention against the math path (the dense mask written
   out): loss and gradients, fp32 and bf16, fresh random inputs per check;
2. full optimizer steps of eyas' Trainer (bf16, compiled; CUDA graphs where the family allows them),
   tok/s and peak memory, and each family's rate as a ratio to EAGLE-3's in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train import measure, release  # noqa: E402
from train_inputs import SHAPES, draft_config, random_batch, random_target  # noqa: E402

from eyas.engines.head import TargetHead  # noqa: E402
from eyas.model.families import build_draft  # noqa: E402
from eyas.train.config import TrainConfig  # noqa: E402
from eyas.train.distributed import DistInfo  # noqa: E402
from eyas.train.trainer import Trainer  # noqa: E402

FAMILIES = {"eagle3": {}, "dflash": {"block_size": 16, "mask_token_id": 0}, "peagle": {"mask_token_id": 0}}


def trainer_for(family: str, shape_name: str, T: int, dev: torch.device, dtype: str, attention: str,
                compiled: bool, graphed: bool) -> Trainer:
    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    lm_head, d2t, t2d = random_target(shape, dev)
    cfg = dataclasses.replace(draft_config(shape), family=family, **FAMILIES[family])
    with torch.device(dev):
        draft = build_draft(cfg)
        head = TargetHead(torch.empty(0), torch.ones(shape.hidden), lm_head.float(), 1e-5)
    draft.set_vocab(d2t, t2d)
    train = TrainConfig(ttt_steps=7, token_budget=T, dtype=dtype, compile=compiled, cuda_graph=graphed,
                        attention=attention, lr=1e-4, warmup_steps=1)
    return Trainer(train, draft, head, DistInfo(device=dev), total_steps=10**6)


def batches(shape_name: str, T: int, dev: torch.device, trainer: Trainer, seeds: range) -> list[dict]:
    out = []
    for i in seeds:
        b = random_batch(SHAPES[shape_name], T, 4, pin=dev.type == "cuda", seed=i)
        b["samples"] = [i, i + 1, i + 2, i + 3]  # the anchor seed of dflash / depth sampling of peagle
        if trainer.embed_table is not None:
            b["input_embeds"] = trainer.embed_table.index_select(0, b["input_ids"])
        out.append(b)
    return out


def check_flex(family: str, dev: torch.device, seed: int) -> str:
    """One forward + backward with flex and with math attention on the same draft and batch."""
    lines = []
    for dtype in ("fp32", "bf16"):
        results = []
        for attention in ("flex", "math"):
            tr = trainer_for(family, "smol", 1024, dev, dtype, attention, compiled=False, graphed=False)
            torch.backends.cuda.matmul.allow_tf32 = False  # the trainer turns TF32 on: a strict fp32 check
            b = batches("smol", 1024, dev, tr, range(seed, seed + 1))[0]
            loss, _ = tr.forward_batch(b)
            loss.backward()
            grads = torch.cat([p.grad.float().flatten() for p in tr.draft.parameters() if p.grad is not None])
            results.append((loss.detach().float(), grads))
        (lf, gf), (lm, gm) = results
        lerr = ((lf - lm).abs() / lm.abs()).item()
        gerr = ((gf - gm).norm() / gm.norm()).item()
        ok = lerr < (1e-5 if dtype == "fp32" else 1e-2) and gerr < (1e-4 if dtype == "fp32" else 5e-2)
        lines.append(f"{family} flex vs math, {dtype}: loss rel err {lerr:.1e}, grad rel err {gerr:.1e} -> "
                     f"{'PASS' if ok else 'FAIL'}")
    return "\n".join(lines)


def step_rate(family: str, shape_name: str, T: int, dev: torch.device, steps: int, warmup: int) -> dict:
    cuda = dev.type == "cuda"
    tr = trainer_for(family, shape_name, T, dev, "bf16" if cuda else "fp32", "auto", compiled=cuda, graphed=cuda)
    turn = itertools.cycle(batches(shape_name, T, dev, tr, range(2)))
    r = measure(lambda: tr.train_step([next(turn)]), lambda stats: bool(torch.isfinite(stats).all()),
                dev, T, steps, warmup)
    release(dev)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: check that the script runs")
    ap.add_argument("--families", default="eagle3,dflash,peagle")
    ap.add_argument("--shapes", default="smol,llama8b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--check-only", action="store_true", help="only the flex-vs-math checks")
    args = ap.parse_args()
    families = args.families.split(",")
    if args.smoke:
        dev, shapes, T, steps, warmup = torch.device("cpu"), ["tiny"], 256, 2, 1
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke on CPU")
        dev, shapes, T, steps, warmup = torch.device("cuda"), args.shapes.split(","), args.tokens, args.steps, 3
        print(f"device: {torch.cuda.get_device_name(dev)}; torch {torch.__version__}")
        for i, f in enumerate(families):
            print(check_flex(f, dev, seed=100 + i))
        if args.check_only:
            return
    rows = []
    for shape, family in itertools.product(shapes, families):
        try:
            r = step_rate(family, shape, T, dev, steps, warmup)
        except Exception as e:  # one family failing must not hide the others' figures
            r = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
        rows.append({"shape": shape, "family": family, **r})
    print("\n| shape | family | tok/s | GiB allocated (reserved) | vs eagle3 (same run) | finite |")
    print("|---|---|---:|---:|---:|---|")
    base = {r["shape"]: r.get("tok_s") for r in rows if r["family"] == "eagle3"}
    for r in rows:
        if r.get("error"):
            print(f"| {r['shape']} | {r['family']} | - | - | - | {r['error']} |")
            continue
        ratio = f"{r['tok_s'] / base[r['shape']]:.2f}x" if base.get(r["shape"]) else "-"
        mem = f"{r['peak']:.2f} ({r['reserved']:.2f})" if dev.type == "cuda" else "n/a"
        print(f"| {r['shape']} | {r['family']} | {r['tok_s']:,.0f} | {mem} | {ratio} | {r['finite']} |")


if __name__ == "__main__":
    main()
