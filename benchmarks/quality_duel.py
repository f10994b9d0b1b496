"""eyas against SpecForge at equal wall-clock: the draft each trains in the same time, on the same tokens, and
how well it drafts.

    python benchmarks/quality_duel.py --out OUT --peer-src PATH --budget-s 300,900 --seeds 2

Both sides train an EAGLE-3 draft of SmolLM2 (--model) on one GPU from the same hidden-state store, extracted
once from the same prepared data (its time is no side's): eyas with `eyas train --store --max-time B` (its
budget counts from the command's start), SpecForge with its own training code from PATH, driven by
benchmarks/duel_peer.py with its defaults, its budget counted from that process's start. Start-up (imports
aside, which both pay alike) is spent from each side's budget; the wall seconds each run took, measured here
around its process, are printed beside its steps. Both drafts then go through the same `eyas eval` command
(MT-Bench, temperature 0, chain 7 and one EAGLE-2 tree); the peer's report overlays eyas' (--compare), so
OUT/B<budget>/s<seed>/peer/eval/report.md holds both side by side. Per budget: tau of each side (median over seeds, with
its range) and eyas' tau - 1 over the peer's, paired per seed, judged against --goals.

Runs go budget by budget, seed by seed, eyas first: each side's compile caches are cold at its first run and
warm after, alike for both.

A killed run resumes: finished trainings and evals are kept (OUT/B<budget>/s<seed>/{eyas,peer}), so running
the same command again does only what is left.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Spread, spread, verdict  # noqa: E402

SIDES = ("eyas", "peer")


def run(cmd: list[str]) -> float:
    """Run one command (a failure ends the benchmark with its output); its wall seconds."""
    print("+ " + shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def eyas(*args: str) -> float:
    return run([sys.executable, "-m", "eyas.cli", *args])


def prepare(args: argparse.Namespace) -> Path:
    """The shared store: prepared once, extracted once (kept across runs)."""
    store = args.out / "store"
    if not (store / "manifest.json").is_file():
        eyas("prepare", args.data, "--model", args.model, "--out", str(args.out / "prepared"), "--max-samples",
             str(args.samples), "--max-length", str(args.max_length))
        eyas("extract", "--prepared", str(args.out / "prepared"), "--model", args.model, "--out", str(store))
    return store


def train_side(args: argparse.Namespace, side: str, store: Path, budget: float, seed: int) -> dict:
    """One side's training for `budget` seconds unless done: its draft folder, wall seconds and steps."""
    out = args.out / f"B{budget:g}" / f"s{seed}" / side
    done = out / "duel_run.json"
    if done.is_file():
        return json.loads(done.read_text())
    if side == "eyas":
        wall = eyas("train", "--store", str(store), "--model", args.model, "--out", str(out), "--max-time",
                    f"{budget:g}", "--seed", str(seed), "--epochs", str(args.epochs), "--save-every", "0",
                    "--draft-vocab-size", str(args.draft_vocab), *shlex.split(args.train_args))
        steps, draft = json.loads((out / "manifest.json").read_text())["steps"], out / "draft"
    else:
        wall = run([sys.executable, str(Path(__file__).parent / "duel_peer.py"), "--peer-src", str(args.peer_src),
                    "--store", str(store), "--model", args.model, "--out", str(out / "draft"), "--budget-s",
                    f"{budget:g}", "--seed", str(seed), "--epochs", str(args.epochs), "--draft-vocab",
                    str(args.draft_vocab)])
        steps, draft = json.loads((out / "draft" / "peer_run.json").read_text())["steps"], out / "draft"
    result = {"draft": str(draft), "wall_s": wall, "steps": steps}
    done.write_text(json.dumps(result) + "\n")
    return result


def evaluate(args: argparse.Namespace, draft: Path, beside: Path | None = None) -> dict[str, float]:
    """tau of chain-7 and of the tree, from one `eyas eval` with the same options for every draft; `beside`:
    the other side's report, overlaid in this one's tables and plots (--compare)."""
    out = draft.parent / "eval"
    if not (out / "report.json").is_file():
        compare = ["--compare", str(beside)] if beside is not None else []
        eyas("eval", "--draft", str(draft), "--model", args.model, "--prompts", args.prompts, "--max-prompts",
             str(args.max_prompts), "--chain", "7", "--tree", args.tree, "--max-new-tokens", str(args.max_new_tokens),
             "--dtype", args.eval_dtype, "--no-baseline", "--label", draft.parent.name, "--out", str(out), *compare)
    results = json.loads((out / "report.json").read_text())["results"]["all"]
    return {"chain": results["chain-7"]["tau"], "tree": results[f"tree-{args.tree}"]["tau"]}


def gain_ratios(ours: list[float], theirs: list[float]) -> Spread | None:
    """eyas' tau - 1 over the peer's, per seed; None when a peer draft accepted nothing (no ratio exists)."""
    if min(t - 1 for t in theirs) <= 0:
        return None
    return spread([(a - 1) / (b - 1) for a, b in zip(ours, theirs, strict=True)])


def print_table(args: argparse.Namespace, rows: dict[float, dict[str, list[dict]]], goals: dict[float, float]) -> None:
    print(f"\n{args.model}, {args.data} ({args.samples} samples), one GPU, {len(args.seeds)} seed(s); eval: "
          f"{args.prompts} (first {args.max_prompts}), temperature 0, {args.max_new_tokens} new tokens")
    print("| budget s | method | eyas tau | SpecForge tau | eyas / SpecForge tau - 1 | goal | verdict |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for budget, sides in rows.items():
        for method, name in (("chain", "chain-7"), ("tree", f"tree-{args.tree}")):
            ours, theirs = ([r[method] for r in sides[s]] for s in SIDES)
            ratio, goal = gain_ratios(ours, theirs), goals.get(budget)
            shown = ratio.show(".2f", "x") if ratio else "no ratio: a SpecForge draft accepted nothing"
            judged = verdict(ratio, goal) if ratio and goal else "not judged"
            print(f"| {budget:g} | {name} | {spread(ours).show('.2f')} | {spread(theirs).show('.2f')} | {shown} "
                  f"| {f'>= {goal:g}x' if goal else '-'} | {judged} |")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--peer-src", type=Path, required=True, help="a SpecForge tree holding the specforge package")
    ap.add_argument("--budget-s", default="300,900", help="training budgets in seconds, comma-separated")
    ap.add_argument("--goals", default="300=3,900=2", help="BUDGET=RATIO: eyas' tau - 1 over the peer's to reach")
    ap.add_argument("--seeds", default="0,1", help="training seeds, comma-separated (medians over them)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", default="sharegpt", help="chat data for eyas prepare")
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=1, help="each side's schedule length; a run ends there or at "
                    "its budget")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--train-args", default="", help="more eyas train options")
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--max-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--tree", default="60:7:10")
    ap.add_argument("--eval-dtype", default="float32", help="float32, as the project's quality evals")
    args = ap.parse_args()
    args.budgets = [float(b) for b in args.budget_s.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    return args


def main() -> None:
    args = parse_args()
    goals = {float(b): float(g) for b, g in (item.split("=") for item in args.goals.split(",") if item)}
    store = prepare(args)
    rows: dict[float, dict[str, list[dict]]] = {}
    for budget in args.budgets:
        rows[budget] = {side: [] for side in SIDES}
        for seed in args.seeds:
            for side in SIDES:  # eyas first: the peer's report shows eyas' beside its own
                trained = train_side(args, side, store, budget, seed)
                beside = args.out / f"B{budget:g}" / f"s{seed}" / "eyas" / "eval" if side == "peer" else None
                taus = evaluate(args, Path(trained["draft"]), beside)
                rows[budget][side].append(taus)
                print(f"  {side} B={budget:g}s seed {seed}: {trained['steps']} steps, {trained['wall_s']:.1f}s wall "
                      f"(start-up included); tau chain-7 {taus['chain']:.2f}, tree {taus['tree']:.2f}", flush=True)
    print_table(args, rows, goals)


if __name__ == "__main__":
    main()
