"""Speed of `eyas prepare` on every recoverable ShareGPT conversation with SmolLM2's tokenizer.

Measured side by side in one run:
  eyas (N workers)   the real stage end to end: read + clean, render, mask, tokenize, write shards
  tokenize only      a floor: render each conversation once and batch-tokenize it, no mask, nothing written
  per-turn baseline  the common way to build the mask: apply_chat_template(tokenize=True) on each turn's
                     prefixes, mask by token counts; run on a subset and its rate reported

    PYTHONPATH=. python3 benchmarks/prepare.py                 # all ShareGPT, workers 1 and all cores
    PYTHONPATH=. python3 benchmarks/prepare.py --workers 2 --baseline-subset 500
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("EYAS_NO_PROGRESS", "1")

from eyas.assets import smollm2_dir  # noqa: E402
from eyas.data.readers import SkipLog, read_conversations  # noqa: E402
from eyas.recipes.prepare import PrepareOptions, default_workers, load_tokenizer, prepare  # noqa: E402
from eyas.utils.io import read_json  # noqa: E402


def cpu_seconds() -> float:
    """User + system CPU of this process and its finished children (the workers)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def timed(fn, *args) -> dict:
    c0, t0 = cpu_seconds(), time.perf_counter()
    row = fn(*args)
    row["seconds"], row["cpu"] = time.perf_counter() - t0, cpu_seconds() - c0
    return row


def run_eyas(workers: int, max_length: int, out_root: Path) -> dict:
    out = out_root / f"w{workers}"
    prepare(PrepareOptions(inputs=["sharegpt"], model=str(smollm2_dir()), out=out, max_length=max_length,
                          num_workers=workers, force=True))  # fmt: skip
    m = read_json(out / "manifest.json")
    shutil.rmtree(out)
    return {"name": f"eyas prepare ({workers} worker{'s' * (workers > 1)})", "convs": m["num_samples"],
            "tokens": m["num_tokens"], "note": f"{sum(m['skipped'].values())} skipped"}  # fmt: skip


def run_tokenize_only(convs: list, tok) -> dict:
    texts = [tok.apply_chat_template(c, tokenize=False) for c in convs]
    encs = tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    n = sum(len(e.ids) for e in encs)
    return {"name": "tokenize only (floor, no mask)", "convs": len(convs), "tokens": n,
            "note": "untruncated, 1 process"}  # fmt: skip


def run_per_turn(convs: list, tok, max_length: int) -> dict:
    """The usual loop: tokenize every prefix ending at an assistant turn, mask the new tokens."""
    n = 0
    for c in convs:
        mask, ids = [], []
        for i, m in enumerate(c):
            if m["role"] != "assistant":
                continue
            prompt = tok.apply_chat_template(c[:i], tokenize=True, add_generation_prompt=True, return_dict=False)
            ids = tok.apply_chat_template(c[: i + 1], tokenize=True, return_dict=False)
            mask = mask + [0] * (len(prompt) - len(mask))
            mask = mask + [1] * (len(ids) - len(mask))
        n += min(len(ids), max_length)
    return {"name": "per-turn apply_chat_template", "convs": len(convs), "tokens": n,
            "note": f"subset of {len(convs):,}"}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default=f"1,{default_workers()}", help="comma-separated worker counts")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--baseline-subset", type=int, default=1000, help="conversations for the per-turn baseline")
    args = ap.parse_args()

    tok, _ = load_tokenizer(str(smollm2_dir()))
    log = SkipLog()
    t0 = time.perf_counter()
    convs = read_conversations("sharegpt", log)
    read_s = time.perf_counter() - t0
    print(f"ShareGPT: {len(convs):,} usable conversations read in {read_s:.1f} s; skipped {dict(log.counts)}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs ({default_workers()} usable), "
          f"python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}")  # fmt: skip

    rows = []
    out_root = Path(tempfile.mkdtemp(prefix="eyas-bench-prepare-"))
    try:
        for w in sorted({int(x) for x in args.workers.split(",")}):
            rows.append(timed(run_eyas, w, args.max_length, out_root))
    finally:
        shutil.rmtree(out_root, ignore_errors=True)
    rows.append(timed(run_tokenize_only, convs, tok))
    rows.append(timed(run_per_turn, convs[: args.baseline_subset], tok, args.max_length))

    best = min((r for r in rows if r["name"].startswith("eyas")), key=lambda r: r["seconds"])
    best_rate = best["convs"] / best["seconds"]
    print()
    print(f"| {'method':<34} | {'convs':>7} | {'wall s':>7} | {'CPU s':>6} | {'conv/s':>7} | {'tokens/s':>9} | "
          f"{'eyas ÷ this (conv/s)':>20} | note")  # fmt: skip
    print(f"|{'-' * 36}|{'-' * 9}|{'-' * 9}|{'-' * 8}|{'-' * 9}|{'-' * 11}|{'-' * 22}|------")
    for r in rows:
        rate = r["convs"] / r["seconds"]
        print(f"| {r['name']:<34} | {r['convs']:>7,} | {r['seconds']:>7.1f} | {r['cpu']:>6.1f} | {rate:>7,.0f} | "
              f"{r['tokens'] / r['seconds']:>9,.0f} | {best_rate / rate:>20.2f} | {r['note']}")  # fmt: skip
    goal = "met" if best["seconds"] < 60 else "NOT met"
    print(f"\nall ShareGPT in {best['seconds']:.1f} s with {best['name']}: goal (< 60 s) {goal}; "
          f"load average now {os.getloadavg()[0]:.1f} (other jobs on the machine slow every row alike)")  # fmt: skip


if __name__ == "__main__":
    main()
