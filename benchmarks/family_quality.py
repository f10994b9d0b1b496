"""Draft families and losses side by side at equal steps on one target: quality, and what it cost.

Every variant trains online (the target in the loop), or from one store with --store, on the same data
for the same number of optimizer steps, with the same held-out samples; then `eyas eval` measures it on
MT-Bench at temperature 0. One table: training seconds (same card, same run), held-out tau_sim, and
MT-Bench tokens per target forward with the draft forwards each verify step took.

    python benchmarks/family_quality.py --out OUT --data sharegpt --steps 600 --prompts 10
    python benchmarks/family_quality.py --out OUT --variants eagle3,eagle3-lk-alpha   # a subset
    python benchmarks/family_quality.py --out OUT --store STORE --train-args "--ttt-steps 3"  # offline, CPU-sized

A killed run resumes: finished trainings and evals are kept (each variant's folder holds its own), so
running the same command again does only what is left. Variants:
  eagle3            EAGLE-3, soft cross-entropy (the default)
  eagle3-lk-alpha   EAGLE-3 with --loss lk-alpha;  eagle3-lk-lambda: --loss lk-lambda
  dflash            the block drafter (blocks of 16), chain 15 at eval
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

VARIANTS = {
    "eagle3": ([], "7"),
    "eagle3-lk-alpha": (["--loss", "lk-alpha"], "7"),
    "eagle3-lk-lambda": (["--loss", "lk-lambda"], "7"),
    "dflash": (["--family", "dflash"], "15"),
    "peagle": (["--family", "peagle"], "7"),
}


def eyas(*args: str) -> None:
    cmd = [sys.executable, "-m", "eyas.cli", *args]
    print("+ eyas " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def train(args: argparse.Namespace, name: str, extra: list[str]) -> float:
    """Train one variant unless done; its training seconds (kept in the variant's folder)."""
    out = args.out / name
    timing = out / "train_seconds.json"
    if timing.is_file() and (out / "draft" / "config.json").is_file():
        return json.loads(timing.read_text())["seconds"]
    source = ["--store", str(args.store)] if args.store else ["--online", "--prepared", str(args.out / "prepared")]
    t0 = time.perf_counter()
    eyas("train", *source, "--model", args.model, "--out", str(out), "--max-steps", str(args.steps),
         "--val-samples", str(args.val_samples), "--val-every", "0", "--save-every", "0", "--log-every", "50",
         *shlex.split(args.train_args), *extra)
    seconds = time.perf_counter() - t0
    timing.write_text(json.dumps({"seconds": seconds}) + "\n")
    return seconds


def held_out(out: Path) -> dict:
    """The last held-out record of a training run's metrics.jsonl."""
    vals = [r["val"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val" in r]
    return vals[-1]


def evaluate(args: argparse.Namespace, name: str, chain: str) -> dict:
    out = args.out / name / "eval"
    if not (out / "report.json").is_file():
        eyas("eval", "--draft", str(args.out / name / "draft"), "--model", args.model, "--prompts", "mtbench",
             "--max-prompts", str(args.prompts), "--chain", chain, "--tree", "none", "--dtype", args.eval_dtype,
             "--max-new-tokens", str(args.max_new_tokens), "--no-baseline", "--out", str(out))
    report = json.loads((out / "report.json").read_text())
    return report["results"]["all"][f"chain-{chain}"]


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
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--val-samples", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=10, help="MT-Bench questions (both turns each)")
    ap.add_argument("--eval-dtype", default="float32")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if not args.store:
        eyas("prepare", args.data, "--model", args.model, "--out", str(args.out / "prepared"),
             "--max-samples", str(args.samples), "--max-length", str(args.max_length))
    rows = []
    for name in names:
        extra, chain = VARIANTS[name]
        seconds = train(args, name, extra)
        val, res = held_out(args.out / name), evaluate(args, name, chain)
        rows.append((name, seconds, val["tau_sim"], res))
    base = rows[0]
    print(f"\n{args.steps} steps each, {args.model}; MT-Bench: first {args.prompts} questions x 2 turns, "
          f"temperature 0, {args.max_new_tokens} new tokens, {args.eval_dtype}")
    print("| variant | train s | held-out tau_sim | MT-Bench chain | tokens / target forward | vs first "
          "| draft forwards / step | greedy identical |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, seconds, tau_sim, r in rows:
        same = f"{r['identical']}/{r['compared']}" if r.get("compared") else "-"
        print(f"| {name} | {seconds:.0f} | {tau_sim:.2f} | {r['method']} | {r['tokens_per_target_forward']:.2f} "
              f"| {r['tokens_per_target_forward'] / base[3]['tokens_per_target_forward']:.2f}x "
              f"| {r['draft_forwards_per_step']:.2f} | {same} |")


if __name__ == "__main__":
    main()
