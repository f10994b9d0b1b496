"""EAGLE-3 draft training speed and memory: eyas against the bf16 matmul ceiling and, in the same run,
against SpecForge's own training step run from its source (`--peer-src`, benchmarks/specforge_peer.py).

    python3 benchmarks/train.py            # GPU: eyas alone, 2048 and 8192 tokens; ~5-8 minutes
    python3 benchmarks/train.py --smoke --peer-src DIR   # CPU: tiny shapes, the peer's sdpa path; ~1 minute

Same-run peer baselines on one GPU: the v0.2.0 tag's tree (the fastest SpecForge version measured;
`git archive 73e6f808 specforge version.txt`), bare and wrapped in FSDP as its trainer runs it; 8B shape,
2048 and 8192 tokens, and eyas alone at 32,768:

    PYTHONPATH=. python3 benchmarks/train.py --shapes llama8b --tokens 2048,8192,32768 --variants graphed \
        --peer-src v0.2.0-tag=peers/v0.2.0-git --peer-tokens 2048,8192 --peer-variants flex --steps 10

Every case runs --repeats times (default 3), interleaved, and every figure is the median of its draws with
their range; a ratio is taken per round and meets its goal only when its whole range does
(benchmarks/common.py). Most of a case's first draw is torch.compile; later draws reuse this process'
compile caches.

How the peer is imported from its tree and driven through its own API, and what is stubbed (nothing on
CUDA; on CPU a stand-in for its `import triton`, and its reference loss in place of its Triton kernel), is
written in benchmarks/specforge_peer.py.

One run measures:
1. the bf16 matmul ceiling (8192^3 GEMM), the denominator of MFU;
2. GPU correctness of the paths the CPU tests cannot run (flex attention has no backward on CPU):
   TTT loss and gradients with flex (document masks + log-sum-exp merge, compiled) vs math, and
   optimizer steps replayed as CUDA graphs vs the same steps run eagerly;
3. full optimizer steps of eyas' trainer (eyas.train.trainer.Trainer: target distribution from
   the stored final state through the target's norm + lm_head, 7 TTT steps, fused loss, backward,
   clipping, AdamW on fp32 master weights) for (a) the SmolLM2-135M draft and (b) a
   Llama-3.1-8B-shaped draft, at 2048 and 8192 tokens, in variants (graphed, compiled, eager,
   compiled-math), with random stored states; tok/s, peak memory allocated and reserved, draft TFLOP/s, MFU;
4. with --peer-src, the same for each SpecForge version's own EAGLE-3 TTT step (--peer-variants: its flex
   and sdpa attention, and its compact teacher), from the same random states, target head and draft
   vocabulary, one sequence per row, pinned host batches on both sides; then same-run ratios
   (eyas / peer: tok/s per round, and peak bytes reserved, the CUDA graph's pool included) and the goal:
   >= 1.25x the fastest peer case (bare or wrapped, named) on the 8B shape with no more reserved memory;
5. the time to the first step: from building the trainer to the end of its first optimizer step (the
   run's first case is what a fresh process pays, given the compile caches it finds on disk);
6. with --profile VARIANT, where one eyas step's time goes (torch.profiler: the top kernels).
Memory peaks count from the first step on, after both sides' setup (cache emptied, peaks reset).
A peer version whose API cannot be driven gets one line saying why; the rest still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Spread, interleaved, matmul_ceiling, paired_ratio, spread, sync, verdict  # noqa: E402
from specforge_peer import PeerInputs, PeerUnusable, SpecForge, one_process_group  # noqa: E402
from train_inputs import (  # noqa: E402
    SHAPES,
    Shape,
    draft_config,
    draft_flops_per_token,
    random_batch,
    random_setup,
    random_target,
)

from eyas.train.config import TrainConfig  # noqa: E402
from eyas.train.distributed import DistInfo  # noqa: E402
from eyas.train.trainer import Trainer  # noqa: E402

GOAL = 1.25  # x the fastest peer case's tok/s on the 8B shape, with no more reserved memory


# -------------------------------------------------------------------------------------------------
# throughput: eyas and the peers, measured alike
# -------------------------------------------------------------------------------------------------


def measure(step, finite, dev: torch.device, tokens: int, steps: int, warmup: int, since: float | None = None) -> dict:
    """`warmup` steps (compilation, graph capture: counted in the peaks), then `steps` timed ones. Peaks
    count from the first step on: setup leftovers are released and the peak counters reset first.
    first_s: seconds from `since` (default: the first step's start) until the first step is done."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    first_s = float("nan")
    for i in range(warmup):
        step()
        if i == 0:
            sync(dev)
            first_s = time.perf_counter() - (t0 if since is None else since)
    sync(dev)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step()
    sync(dev)
    dt = time.perf_counter() - t0
    cuda = dev.type == "cuda"
    return {"tok_s": tokens * steps / dt, "warmup_s": warmup_s, "first_s": first_s, "finite": finite(out),
            "peak": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else float("nan"),
            "reserved": torch.cuda.max_memory_reserved(dev) / 2**30 if cuda else float("nan")}


def release(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def eyas_step(shape: Shape, T: int, variant: str, dev: torch.device, ttt: int, docs: int):
    """(step, start): one optimizer step of eyas' trainer on random states, per call; `start` is when the
    trainer began to be built (compiling and capturing happen in its first steps)."""
    graphed = variant.startswith("graphed")
    cuda = dev.type == "cuda"
    attention = "flex" if cuda and not variant.endswith("math") else "math"
    batches = [random_batch(shape, T, docs, pin=cuda, seed=i) for i in range(2)]
    draft, head = random_setup(shape, dev)
    cfg = TrainConfig(ttt_steps=ttt, token_budget=T, dtype="bf16" if cuda else "fp32",
                      compile=graphed or variant.startswith("compiled"), cuda_graph=graphed and cuda,
                      attention=attention, lr=1e-4, warmup_steps=1)
    start = time.perf_counter()
    trainer = Trainer(cfg, draft, head, DistInfo(device=dev), total_steps=10**6)
    del draft, head
    if trainer.embed_table is not None:  # what the DataLoader workers add to each batch
        for b in batches:
            e = trainer.embed_table.index_select(0, b["input_ids"])
            b["input_embeds"] = e.pin_memory() if cuda else e
    turn = itertools.cycle(batches)
    return (lambda: trainer.train_step([next(turn)])), start


def eyas_case(shape: Shape, T: int, variant: str, dev: torch.device, steps: int, warmup: int, ttt: int,
              docs: int) -> dict:
    """eyas' trainer on random states; first_s counts from building the trainer (compiling and capturing
    included) to the end of its first optimizer step."""
    step, start = eyas_step(shape, T, variant, dev, ttt, docs)
    r = measure(step, lambda stats: bool(torch.isfinite(stats).all()), dev, T, steps, warmup, since=start)
    r["tflops"] = draft_flops_per_token(draft_config(shape), T // docs, ttt) * r["tok_s"] / 1e12
    return r


def print_profile(shape: str, T: int, variant: str, dev: torch.device, args: argparse.Namespace) -> None:
    """Where one eyas step's time goes: torch.profiler over 3 steps after the warmup, the top 15 kernels (GPU)
    or operators (CPU) by their own time."""
    from torch.profiler import ProfilerActivity, profile

    step, _ = eyas_step(SHAPES[shape], T, variant, dev, args.ttt, args.docs)
    for _ in range(args.warmup):
        step()
    sync(dev)
    cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        for _ in range(3):
            step()
        sync(dev)
    print(f"\nProfile: eyas {shape} {T} {variant}, 3 steps, top 15 by self {'CUDA' if cuda else 'CPU'} time")
    print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                    row_limit=15, max_name_column_width=60))


def peer_case(shape: Shape, T: int, variant: str, dev: torch.device, steps: int, warmup: int, ttt: int,
              peer: SpecForge) -> dict:
    """The peer's own step from the same states, target head and draft vocabulary as eyas' case;
    variant 'BACKEND[+compact], WRAP'."""
    backend, wrap = variant.split(", ")
    lm_head, d2t, t2d = random_target(shape, dev)
    inputs = PeerInputs([random_batch(shape, T, 1, pin=False, seed=i) for i in range(2)], lm_head.cpu(), d2t, t2d)
    del lm_head
    start = time.perf_counter()
    step, finite = peer.build_step(shape, backend, inputs, dev, ttt, "none" if wrap == "bare" else wrap)
    del inputs
    return measure(step, finite, dev, T, steps, warmup, since=start)


def timed_row(case, who: str, shape: str, T: int, variant: str, dev: torch.device, *args) -> dict:
    """One case as a row: the figures of `case(SHAPES[shape], T, variant, dev, *args)`, or why it has none."""
    release(dev)
    t = time.perf_counter()
    try:
        row = case(SHAPES[shape], T, variant, dev, *args)
        row["error"] = ""
    except torch.OutOfMemoryError:
        row = {"error": "out of memory"}
    except PeerUnusable as e:
        row = {"error": str(e)}
    except Exception as e:
        traceback.print_exc()
        row = {"error": f"{type(e).__name__}: {str(e)[:80]}"}
    row.update(who=who, shape=shape, tokens=T, variant=variant, wall=time.perf_counter() - t)
    print(f"  {row['who']} {row['shape']} {row['tokens']} {row['variant']}: "
          + (f"{row['tok_s']:,.0f} tok/s, peak {gib(row['peak'])} GiB allocated ({gib(row['reserved'])} reserved), "
             f"first step after {row['first_s']:.1f}s" if not row["error"] else row["error"]), flush=True)
    return row


def peer_block(spec: str, cases: list[tuple], dev: torch.device, args: argparse.Namespace) -> list[dict]:
    """One round of every peer case of one SpecForge tree (imported for the round, then forgotten)."""
    peer = SpecForge(spec)
    try:
        with peer.imported(dev):
            print(f"peer {peer.label}: SpecForge {peer.version()} from {peer.path}"
                  + ("" if peer.has_compact else "; no compact teacher"), flush=True)
            return [timed_row(peer_case, peer.label, s, T, v, dev, args.steps, args.warmup, args.ttt, peer)
                    for s, T, v in cases]
    except PeerUnusable as e:
        print(f"peer {peer.label}: cannot be driven ({e})", flush=True)
        return []


def run_rounds(eyas_cases: list[tuple], peer_cases: list[tuple], dev: torch.device,
               args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Every case --repeats times, interleaved (benchmarks/common.py): eyas' cases are one block, each
    peer tree's another. Each row carries its round."""
    def eyas_block() -> list[dict]:
        return [timed_row(eyas_case, "eyas", s, T, v, dev, args.steps, args.warmup, args.ttt, args.docs)
                for s, T, v in eyas_cases]

    blocks = [eyas_block] + [lambda spec=spec: peer_block(spec, peer_cases, dev, args)
                             for spec in (args.peer_src if peer_cases else [])]
    with contextlib.ExitStack() as stack:
        if len(blocks) > 1 and any(v.endswith(", fsdp") for _, _, v in peer_cases):
            try:
                stack.enter_context(one_process_group())
            except Exception as e:
                print(f"peers: no process group for FSDP ({type(e).__name__}: {e}); try --peer-wrap none")
                blocks = blocks[:1]
        results = interleaved(blocks, args.repeats)
    for per_round in results:
        for r, rows in enumerate(per_round):
            for row in rows:
                row["round"] = r
    return [row for rows in results[0] for row in rows], [row for b in results[1:] for rows in b for row in rows]


# -------------------------------------------------------------------------------------------------
# report: medians and ranges over the rounds
# -------------------------------------------------------------------------------------------------


def gib(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}"


def case_groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(who, shape, tokens, variant) -> the case's rows that ran, in round order."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["who"], r["shape"], r["tokens"], r["variant"]), []).append(r)
    return groups


def case_cells(rows: list[dict]) -> str:
    """tok/s median (range) | GiB allocated (reserved), the largest draw | trains; or why it did not run."""
    ran = [r for r in rows if not r["error"]]
    if not ran:
        return f"{rows[0]['error']} | | "
    speed = spread([r["tok_s"] for r in ran]).show()
    peak, reserved = max(r["peak"] for r in ran), max(r["reserved"] for r in ran)
    trains = "yes" if all(r["finite"] for r in ran) else "NaN"
    failed = len(rows) - len(ran)
    return f"{speed}{f'; {failed} failed' if failed else ''} | {gib(peak)} ({gib(reserved)}) | {trains}"


def paired(ours: list[dict], theirs: list[dict], key: str = "tok_s") -> Spread | None:
    """Per-round ratio of two cases over the rounds where both ran; None when no round had both."""
    a = {r["round"]: r[key] for r in ours if not r["error"]}
    b = {r["round"]: r[key] for r in theirs if not r["error"]}
    both = sorted(a.keys() & b.keys())
    return paired_ratio([a[k] for k in both], [b[k] for k in both]) if both else None


def print_tables(eyas: list[dict], peers: list[dict], ceiling: float, dev: torch.device) -> None:
    unit, scale = ("GFLOP/s", 1e3) if dev.type != "cuda" else ("TFLOP/s", 1.0)
    print(f"\n| shape | tokens | eyas variant | tok/s, median (range) | GiB allocated (reserved) | trains | draft "
          f"{unit} | MFU, median (range) | first step s, median (range) |")
    print("|---|---|---|---:|---:|---|---:|---:|---:|")
    for (_, s, T, v), rows in case_groups(eyas).items():
        ran = [r for r in rows if not r["error"]]
        flops = spread([r["tflops"] for r in ran]) if ran else None
        extra = (f" | {flops.median * scale:,.1f} | {spread([r['tflops'] * 1e12 / ceiling for r in ran]).show('.0%')}"
                 f" | {spread([r['first_s'] for r in ran]).show('.1f')}") if flops else " | | |"
        print(f"| {s} | {T} | {v} | {case_cells(rows)}{extra} |")
    if not peers:
        return
    print("\n| shape | tokens | peer | peer variant | tok/s, median (range) | GiB allocated (reserved) | trains |")
    print("|---|---|---|---|---:|---:|---|")
    for (who, s, T, v), rows in case_groups(peers).items():
        print(f"| {s} | {T} | {who} | {v} | {case_cells(rows)} |")
    print("\nSame-run ratios, eyas / peer, per round then median (range): speed by tok/s; reserved memory by the "
          "largest draw (below 1: eyas holds less)")
    print("| shape | tokens | eyas variant | peer | peer variant | speed | reserved |")
    print("|---|---|---|---|---|---:|---:|")
    for (_, s, T, v), ours in case_groups(eyas).items():
        for (who, ps, pT, pv), theirs in case_groups(peers).items():
            if (s, T) == (ps, pT) and (speed := paired(ours, theirs)):
                mem = max_reserved(ours) / max_reserved(theirs)
                print(f"| {s} | {T} | {v} | {who} | {pv} | {speed.show('.2f', 'x')} | "
                      f"{'n/a' if math.isnan(mem) else f'{mem:.2f}x'} |")


def max_reserved(rows: list[dict]) -> float:
    return max((r["reserved"] for r in rows if not r["error"]), default=float("nan"))


def print_goal(eyas: list[dict], peers: list[dict], shape: str) -> None:
    """Against the fastest peer case (by median tok/s, bare or wrapped): met only when the per-round ratio's
    whole range is >= GOAL and eyas reserves no more memory."""
    print(f"\nGoal on the {shape} shape: >= {GOAL}x the fastest peer case (by median; per-round ratios, their "
          "whole range), with no more memory by reserved bytes")
    peer_groups = case_groups(peers)
    for T in sorted({r["tokens"] for r in eyas if r["shape"] == shape}):
        ran = {k: [r for r in v if not r["error"]] for k, v in peer_groups.items() if k[1:3] == (shape, T)}
        ran = {k: v for k, v in ran.items() if v}
        if not ran:
            print(f"  {T} tokens: no peer ran (--peer-src), not judged")
            continue
        best = max(ran, key=lambda k: spread([r["tok_s"] for r in ran[k]]).median)
        print(f"  {T} tokens: fastest peer case {best[0]} {best[3]}, "
              f"{spread([r['tok_s'] for r in ran[best]]).show(suffix=' tok/s')}, "
              f"{gib(max_reserved(ran[best]))} GiB reserved")
        for key, ours in case_groups(eyas).items():
            if key[1:3] != (shape, T) or not (speed := paired(ours, ran[best])):
                continue
            fits = math.isnan(max_reserved(ours)) or max_reserved(ours) <= max_reserved(ran[best])
            judged = verdict(speed, GOAL) if fits else "not met (more reserved memory)"
            print(f"    eyas {key[3]}: {speed.show('.2f', 'x')}, {gib(max_reserved(ours))} GiB reserved -> {judged}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: check that the script runs")
    ap.add_argument("--shapes", default="smol,llama8b")
    ap.add_argument("--tokens", "--seq-len", dest="tokens", default="2048,8192",
                    help="tokens per sequence (one sequence per optimizer step), comma-separated")
    ap.add_argument("--variants", default="graphed,compiled", help="graphed: compiled, and each optimizer step "
                    "replayed as one CUDA graph (the default on one GPU); compiled: torch.compile of the layer "
                    "halves, final norm and loss chunk (+ compiled flex); eager: only flex compiled; "
                    "compiled-math: attention with the scores written out (no flex)")
    ap.add_argument("--peer-src", action="append", default=[], metavar="[LABEL=]PATH",
                    help="a SpecForge source tree (holding its specforge/ package) whose own EAGLE-3 step runs "
                         "beside eyas' in this process; repeatable")
    ap.add_argument("--peer-variants", default="flex,sdpa,flex+compact",
                    help="the peer's attention backend (flex, sdpa), +compact for its compact teacher")
    ap.add_argument("--peer-tokens", default="2048", help="sequence lengths the peer runs (of --tokens)")
    ap.add_argument("--peer-wrap", default="fsdp,none",
                    help="comma-separated: fsdp: as the peer's trainer runs on one GPU (one-process group); "
                         "none: the bare module")
    ap.add_argument("--repeats", type=int, default=3, help="draws of every case, interleaved (medians, ranges)")
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per case")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--docs", type=int, default=1, help="documents packed per row in eyas' batches (1 = one "
                    "sequence, as the peer trains)")
    ap.add_argument("--profile", metavar="VARIANT", help="also profile one eyas step of this variant (the first "
                    "shape and sequence length): its top kernels")
    ap.add_argument("--no-check", action="store_true", help="skip the flex-vs-math and CUDA-graph-vs-eager checks")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.smoke:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
        shapes, tokens, variants, peer_tokens = ["tiny"], [256], ["eager"], [256]
        peer_variants, wraps = ["sdpa", "sdpa+compact"], ["bare"]  # flex has no backward on CPU; FSDP needs a GPU
        args.steps, args.warmup = 3, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke on CPU")
        dev = torch.device("cuda")
        shapes, tokens = args.shapes.split(","), [int(t) for t in args.tokens.split(",")]
        variants, peer_variants = args.variants.split(","), args.peer_variants.split(",")
        peer_tokens = [int(t) for t in args.peer_tokens.split(",") if int(t) in tokens]
        wraps = ["bare" if w == "none" else w for w in args.peer_wrap.split(",")]

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}; TTT {args.ttt}; {args.docs} document(s) per eyas row; "
          f"{args.repeats} interleaved draws of every case", flush=True)
    if dev.type == "cuda":
        ceiling = matmul_ceiling(dev, 8192, 50, torch.bfloat16)
        print(f"bf16 matmul ceiling (8192^3): {ceiling / 1e12:.0f} TFLOP/s")
        if not args.no_check:
            from train_checks import check_flex_vs_math, check_graph_vs_eager

            try:
                for line in check_flex_vs_math(dev):
                    print(line)
                print(check_graph_vs_eager(dev))
            except Exception:
                print("flex vs math check FAILED to run:\n" + traceback.format_exc())
    else:
        ceiling = matmul_ceiling(dev, 1024, 5, torch.float32)
        print(f"fp32 matmul ceiling (1024^3, CPU): {ceiling / 1e9:.1f} GFLOP/s")

    eyas_cases = list(itertools.product(shapes, tokens, variants))
    peer_cases = [(s, T, f"{v}, {w}") for s, T, v, w in itertools.product(shapes, peer_tokens, peer_variants, wraps)]
    eyas, peers = run_rounds(eyas_cases, peer_cases, dev, args)
    print_tables(eyas, peers, ceiling, dev)
    if args.profile:
        release(dev)
        print_profile(shapes[0], tokens[0], args.profile, dev, args)
    print_goal(eyas, peers, "tiny" if args.smoke else "llama8b")
    if eyas and not eyas[0]["error"]:
        print(f"Time to the first step: {eyas[0]['first_s']:.1f}s in the run's first case ({eyas[0]['shape']}, "
              f"{eyas[0]['tokens']}, {eyas[0]['variant']}: building the trainer, compiling, capturing, one step), "
              "with the compile caches this process found at its start.")
    print("MFU = draft training FLOPs (matmuls + attention, backward 2x) per second / measured matmul ceiling.")


if __name__ == "__main__":
    main()
