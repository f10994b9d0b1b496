"""Does an MLA draft layer (`--draft-attention mla`) beat EAGLE-3's Llama-style layer on a Kimi-K2.5-shaped
target at equal steps? Both drafts train on the same store, seed, held-out set and steps; the script prints
each one's held-out tau_sim (all tokens and the replies' openings), its parameters and its seconds a step.

    PYTHONPATH=. python3 benchmarks/mla_layer.py --out /tmp/mla-layer            # the docs/experiments.md row
    PYTHONPATH=. python3 benchmarks/mla_layer.py --out /tmp/mla-smoke --smoke    # checks the script runs

The target is tests/_kimi.py's tiny random Kimi-K2.5 (a DeepSeek-V3 text model: MLA attention with the dims
vLLM's CPU backend runs, routed and shared experts; a byte-level tokenizer with Kimi's special tokens and
chat template), made less uniform (`make_target`). The data are ShareGPT's first conversations in that
template, the states the hf engine's in float32. A rerun reuses every stage that is up to date.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _kimi import build_kimi, kimi_tokenizer, save_kimi  # noqa: E402

from eyas.recipes.extract import ExtractOptions, run_extract  # noqa: E402
from eyas.recipes.prepare import PrepareOptions, run_prepare  # noqa: E402
from eyas.recipes.train import TrainOptions, run_train  # noqa: E402

AUX = [1, 2, 3]  # of 4 layers (the default [2, N//2, N-3] repeats a layer at N = 4)


def make_target(out: Path) -> None:
    """The tiny Kimi-K2.5 with embeddings of std 1 and its head x4: at random init one token is 58% of its
    greedy choices on ShareGPT and its next-token entropy 5.0 nats (near uniform); so, 20% and 1.7 nats."""
    import torch

    tok = kimi_tokenizer()
    model = build_kimi(tok)
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.mul_(4.0)
    save_kimi(model, tok, out)


def train(store: Path, out: Path, attention: str, args: argparse.Namespace) -> dict:
    """Train one draft; returns its last validation, parameter count and seconds a step."""
    import torch

    from eyas.model.checkpoints import import_draft

    torch.set_num_threads(args.threads)
    run_train(TrainOptions(store=store, out=out, draft_attention=attention, max_steps=args.steps, seed=args.seed,
                           val_samples=args.val_samples, val_every=max(args.steps // 4, 1), ttt_steps=args.ttt,
                           lr=args.lr, token_budget=args.token_budget, num_workers=0, save_every=0, log_every=10,
                           report_to="none", device="cpu"), log=lambda *a, **k: None)
    manifest = json.loads((out / "manifest.json").read_text())
    draft = import_draft(out / "draft")
    trained = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    curve = [json.loads(line)["val"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"val"' in line]
    return {"val": manifest["final"]["val"], "params": trained, "seconds_per_step": manifest["seconds"] / args.steps,
            "curve": [round(v["tau_sim"], 3) for v in curve]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--samples", type=int, default=600, help="ShareGPT conversations")
    p.add_argument("--max-length", type=int, default=768)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--val-samples", type=int, default=60)
    p.add_argument("--ttt", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.samples, args.steps, args.val_samples, args.max_length = 24, 4, 4, 256
    out = args.out
    target = out / "target"
    if not (target / "config.json").is_file():
        make_target(target)
    prepared = run_prepare(PrepareOptions(inputs=["sharegpt"], model=str(target), out=out / "prepared",
                                          max_samples=args.samples, max_length=args.max_length, num_workers=1))
    store = run_extract(ExtractOptions(prepared=prepared, out=out / "store", model=str(target), aux_layer_ids=AUX,
                                       dtype="float32", device="cpu"))
    results = {a: train(store, out / f"train-{a}", a, args) for a in ("llama", "mla")}
    print(f"tiny Kimi-K2.5 target, {args.samples} ShareGPT conversations <= {args.max_length} tokens, "
          f"{args.steps} steps of {args.token_budget} tokens, TTT {args.ttt}, lr {args.lr}, seed {args.seed}, "
          f"{args.val_samples} held-out samples")
    print("| draft layer | trained params | s/step | held-out tau_sim | opening tau_sim | step-0 acc | tau_sim curve |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        v = r["val"]
        print(f"| {name} | {r['params'] / 1e6:.2f}M | {r['seconds_per_step']:.2f} | {v['tau_sim']:.3f} | "
              f"{v['opening']['tau_sim']:.3f} | {v['acc'][0]:.3f} | {r['curve']} |")
    (out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                  "results": results}, indent=1))


if __name__ == "__main__":
    main()
