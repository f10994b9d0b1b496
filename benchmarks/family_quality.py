"""Draft families and losses side by side at equal wall-clock on one target: which drafts best in the same time.

Every variant trains online (the target in the loop), or from one store with --store, on the same data for
the same wall-clock budget (`eyas train --max-time`, counted from the command's start: start-up spends it
too), with the same held-out samples; then `eyas eval` measures it on MT-Bench at temperature 0 with the
target alone beside it at batch sizes 1 and 16 (the serving table; --batch-sizes). One table: the steps each variant got
in its budget, held-out tau_sim, tokens per target forward (tau), and the batch-1 and batch-16 speedups;
then the goal: the best block drafter's batch-1 speedup against EAGLE-3's.

    python benchmarks/family_quality.py --out OUT --data sharegpt --budget-s 900 --prompts 10
    python benchmarks/family_quality.py --out OUT --variants eagle3,dflash,dspark   # a subset
    python benchmarks/family_quality.py --out OUT --store STORE --train-args "--ttt-steps 3"  # offline

A killed run resumes: finished trainings and evals are kept (each variant's folder holds its own), so
running the same command again does only what is left. Variants:
  eagle3            EAGLE-3, soft cross-entropy (the default)
  eagle3-lk-alpha   EAGLE-3 with --loss lk-alpha;  eagle3-lk-lambda: --loss lk-lambda
  dflash            the block drafter (blocks of 16), chain 15 at eval
  dspark            DFlash's block forward with a Markov head (blocks of 16), chain 15 at eval
  peagle            P-EAGLE (parallel drafting, 7 depths)
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

# name -> (family, more eyas train options, chain length at eval, whether it is a block drafter)
VARIANTS = {
    "eagle3": ("eagle3", [], "7", False),
    "eagle3-lk-alpha": ("eagle3", ["--loss", "lk-alpha"], "7", False),
    "eagle3-lk-lambda": ("eagle3", ["--loss", "lk-lambda"], "7", False),
    "dflash": ("dflash", [], "15", True),
    "dspark": ("dspark", [], "15", True),
    "peagle": ("peagle", [], "7", False),
}
GOAL = 1.3  # the best block drafter's batch-1 speedup over EAGLE-3's


def eyas(*args: str) -> None:
    cmd = [sys.executable, "-m", "eyas.cli", *args]
    print("+ eyas " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def train(args: argparse.Namespace, name: str, family: str, extra: list[str]) -> dict:
    """Train one variant for the budget unless done: its wall seconds (around the command, start-up
    included) and the optimizer steps it got, kept in the variant's folder."""
    out = args.out / name
    timing = out / "train_seconds.json"
    if timing.is_file() and (out / "draft" / "config.json").is_file():
        return json.loads(timing.read_text())
    source = ["--store", str(args.store)] if args.store else ["--online", "--prepared", str(args.out / "prepared")]
    t0 = time.perf_counter()
    eyas("train", *source, "--model", args.model, "--out", str(out), "--max-time", f"{args.budget_s:g}",
         "--epochs", str(args.epochs), "--val-samples", str(args.val_samples), "--val-every", "0", "--save-every",
         "0", "--log-every", "10", "--family", family, *shlex.split(args.train_args), *extra)
    done = {"seconds": time.perf_counter() - t0, "steps": json.loads((out / "manifest.json").read_text())["steps"]}
    timing.write_text(json.dumps(done) + "\n")
    return done


def held_out(out: Path) -> dict:
    """The last held-out record of a training run's metrics.jsonl."""
    vals = [r["val"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val" in r]
    return vals[-1]


def evaluate(args: argparse.Namespace, name: str, family: str, chain: str) -> dict:
    """The variant's chain at batch 1 (report.json results) with its speedup at each of --batch-sizes (the
    serving table), all from one `eyas eval` with the target alone beside it."""
    out = args.out / name / "eval"
    if not (out / "report.json").is_file():
        eyas("eval", "--draft", str(args.out / name / "draft"), "--model", args.model, "--prompts", args.prompts,
             "--max-prompts", str(args.max_prompts), "--chain", chain, "--tree", "none", "--dtype", args.eval_dtype,
             "--max-new-tokens", str(args.max_new_tokens), "--batch-size", ",".join(map(str, args.batch_sizes)),
             "--out", str(out))
    report = json.loads((out / "report.json").read_text())
    method = f"chain-{chain}"
    speedups = {r["batch_size"]: r["speedup"] for r in report["serving"] if r["method"] == method}
    return {**report["results"]["all"][method], "speedups": speedups}


def goal_line(rows: list[tuple], block: dict[str, bool]) -> str:
    """The best block drafter's batch-1 speedup over EAGLE-3's, judged against GOAL, and why: a speedup is tau
    over the cost of a verify step (in target-alone forwards), so the ratio splits into those two."""
    base = next((r for r in rows if r[0] == "eagle3"), None)
    blocks = [r for r in rows if block[r[0]]]
    if base is None or not blocks:
        return f"goal (best block drafter >= {GOAL}x EAGLE-3's batch-1 speedup): not judged, run eagle3 and a " \
               "block drafter"
    best = max(blocks, key=lambda r: r[4]["speedups"][1])
    ours, theirs = best[4], base[4]
    ratio = ours["speedups"][1] / theirs["speedups"][1]
    tau = ours["tokens_per_target_forward"] / theirs["tokens_per_target_forward"]
    return (f"goal: best block drafter {best[0]} at {ratio:.2f}x EAGLE-3's batch-1 speedup (>= {GOAL}x): "
            + ("met" if ratio >= GOAL else "not met")
            + f"; = {tau:.2f}x its tau / {tau / ratio:.2f}x its cost per verify step (draft forwards included)")


def print_table(args: argparse.Namespace, rows: list[tuple], block: dict[str, bool]) -> None:
    print(f"\n{args.budget_s:g}s of training each (start-up included), {args.model}; {args.prompts}: first "
          f"{args.max_prompts}, temperature 0, {args.max_new_tokens} new tokens, {args.eval_dtype}")
    print("| variant | steps | train wall s | held-out tau_sim | chain | tokens / target forward | "
          + " | ".join(f"speedup batch {b}" for b in args.batch_sizes) + " | greedy identical |")
    print("| --- " * (7 + len(args.batch_sizes)) + "|")
    for name, timing, tau_sim, _, r in rows:
        same = f"{r['identical']}/{r['compared']}" if r.get("compared") else "-"
        speedups = " | ".join(f"{r['speedups'][b]:.2f}x" if b in r["speedups"] else "-"
                              for b in args.batch_sizes)
        print(f"| {name} | {timing['steps']} | {timing['seconds']:.0f} | {tau_sim:.2f} | {r['method']} "
              f"| {r['tokens_per_target_forward']:.2f} | {speedups} | {same} |")
    print(goal_line(rows, block))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", default="sharegpt", help="chat data for eyas prepare")
    ap.add_argument("--store", type=Path, help="train offline from this store (from eyas extract) instead")
    ap.add_argument("--train-args", default="", help="more eyas train options for every variant")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--budget-s", type=float, default=900, help="training wall-clock of every variant, seconds")
    ap.add_argument("--epochs", type=int, default=1, help="each schedule's length; a run ends there or at the budget")
    ap.add_argument("--val-samples", type=int, default=200)
    ap.add_argument("--prompts", default="mtbench", help="eval prompt set")
    ap.add_argument("--max-prompts", type=int, default=10, help="conversations of the set (MT-Bench: both turns)")
    ap.add_argument("--eval-dtype", default="float32", help="float32: greedy output comparable token for token")
    ap.add_argument("--variants", default="eagle3,dflash,peagle,dspark")
    ap.add_argument("--batch-sizes", default="1,16", help="the serving table's batch sizes (1 is the goal's)")
    args = ap.parse_args()
    args.batch_sizes = sorted({1, *map(int, args.batch_sizes.split(","))})
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if not args.store:
        eyas("prepare", args.data, "--model", args.model, "--out", str(args.out / "prepared"),
             "--max-samples", str(args.samples), "--max-length", str(args.max_length))
    rows = []
    for name in names:
        family, extra, chain, _ = VARIANTS[name]
        timing = train(args, name, family, extra)
        rows.append((name, timing, held_out(args.out / name)["tau_sim"], chain, evaluate(args, name, family, chain)))
    print_table(args, rows, {name: VARIANTS[name][3] for name in names})


if __name__ == "__main__":
    main()
