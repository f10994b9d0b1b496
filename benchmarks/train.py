"""EAGLE-3 draft training speed and memory: eyas against the bf16 matmul ceiling and, in the same run,
against SpecForge's own training step run from its source (`--peer-src`, benchmarks/specforge_peer.py).

    python3 benchmarks/train.py            # GPU: eyas alone, 2048 and 8192 tokens; ~5-8 minutes
    python3 benchmarks/train.py --smoke --peer-src DIR   # CPU: tiny shapes, the peer's sdpa path; ~1 minute

Same-run peer baselines on one GPU, both SpecForge versions (each tree needs only its `specforge/` package:
a checkout of sgl-project/SpecForge at its latest head, and the 0.2.0 wheel unzipped):

    mkdir -p peers/head peers/v0.2.0
    git -C SPECFORGE_CHECKOUT archive HEAD specforge version.txt | tar -x -C peers/head
    pip download --no-deps specforge==0.2.0 -d /tmp/w && python3 -m zipfile -e /tmp/w/specforge-0.2.0-*.whl peers/v0.2.0
    PYTHONPATH=. python3 benchmarks/train.py --shapes llama8b,smol --tokens 2048 --variants graphed,compiled \\
        --peer-src head=peers/head --peer-src v0.2.0=peers/v0.2.0

That takes ~10-15 minutes on an H100: 4 eyas and 12 peer cases (flex, sdpa, flex+compact per shape and
version), ~40 s each, most of it torch.compile. Where one command may run at most 10 minutes, give one
--peer-src per call (add --no-check to the second): each call reruns eyas beside that peer (~6-8 minutes),
so every ratio stays same-run.

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
   (eyas / peer: tok/s, and peak bytes allocated and reserved, the CUDA graph's pool included) and the
   goal: >= 1.25x the fastest peer case on the 8B shape with no more memory by reserved bytes.
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
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import matmul_ceiling, sync  # noqa: E402
from specforge_peer import PeerInputs, PeerUnusable, SpecForge, one_process_group  # noqa: E402

from eyas.engines.head import TargetHead  # noqa: E402
from eyas.model.config import DraftConfig  # noqa: E402
from eyas.model.draft import Eagle3Draft  # noqa: E402
from eyas.model.vocab import build_draft_vocab, draft_to_target_ids, target_to_draft_ids  # noqa: E402
from eyas.train.config import TrainConfig  # noqa: E402
from eyas.train.distributed import DistInfo  # noqa: E402
from eyas.train.loss import target_distribution  # noqa: E402
from eyas.train.trainer import Trainer  # noqa: E402
from eyas.train.ttt import TTTConfig, TTTModel  # noqa: E402

GOAL = 1.25  # x the fastest peer case's tok/s on the 8B shape, with no more reserved memory


@dataclass
class Shape:
    name: str
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_vocab: int
    rope_theta: float


SHAPES = {
    "smol": Shape("smol", 576, 1536, 9, 3, 64, 49152, 32000, 100000.0),
    "llama8b": Shape("llama8b", 4096, 14336, 32, 8, 128, 128256, 32000, 500000.0),
    "tiny": Shape("tiny", 64, 128, 4, 2, 16, 1000, 500, 10000.0),
}


def draft_config(s: Shape) -> DraftConfig:
    return DraftConfig(hidden_size=s.hidden, intermediate_size=s.inter, num_attention_heads=s.heads,
                       num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab,
                       draft_vocab_size=s.draft_vocab, target_hidden_size=s.hidden, aux_layer_ids=[2, 15, 27],
                       rope_theta=s.rope_theta, max_position_embeddings=max(8192, 2 * 8192))


def draft_flops_per_token(cfg: DraftConfig, T: int, steps: int) -> float:
    """Training FLOPs per token of the draft: matmuls and attention, backward = 2x forward (fc: 1x,
    its input needs no gradient). Attention at step j: causal over the step-0 keys (avg (T+1)/2)
    plus j same-row keys. The target head's logits are not counted (they are not the draft's)."""
    H, inter, nh, nkv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.head_dim
    fc = 2 * cfg.num_aux_layers * cfg.target_hidden_size * H
    proj = 2 * 2 * H * (nh + 2 * nkv) * hd + 2 * nh * hd * H + 2 * 3 * H * inter + 2 * H * cfg.draft_vocab_size
    attn = sum(4 * nh * hd * ((T + 1) / 2 + j) for j in range(steps))
    return 3 * (steps * proj + attn) + 2 * fc


def random_target(shape: Shape, dev: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's lm_head and the draft vocabulary (d2t, t2d), drawn from `seed`: eyas and the peer get
    the same ones."""
    g = torch.Generator(device=dev).manual_seed(seed)
    lm_head = torch.randn(shape.vocab, shape.hidden, generator=g, device=dev) * 0.05
    counts = torch.randint(0, 10**6, (shape.vocab,), generator=torch.Generator().manual_seed(seed))
    d2t, t2d = build_draft_vocab(counts, shape.draft_vocab)
    return lm_head.to(torch.bfloat16 if dev.type == "cuda" else torch.float32), d2t, t2d


def random_setup(shape: Shape, dev: torch.device, seed: int = 0) -> tuple[Eagle3Draft, TargetHead]:
    torch.manual_seed(seed)
    lm_head, d2t, t2d = random_target(shape, dev, seed)
    with torch.device(dev):
        draft = Eagle3Draft(draft_config(shape))
        head = TargetHead(torch.empty(0), torch.ones(shape.hidden), lm_head, 1e-5)
    draft.set_vocab(d2t, t2d)
    return draft, head


def random_batch(shape: Shape, T: int, docs: int, pin: bool, seed: int = 0) -> dict:
    """One packed row as eyas.train.data.collate_pack makes it (random ids and stored states)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [T // docs] * (docs - 1) + [T - (T // docs) * (docs - 1)]
    pos = torch.cat([torch.arange(n) for n in lengths])
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    mask = torch.ones(T, dtype=torch.bool)
    mask[pos < 8] = False  # a short "prompt" per document
    b = {"input_ids": torch.randint(0, shape.vocab, (T,), generator=g), "loss_mask": mask, "position_ids": pos,
         "document_ids": doc, "aux_hidden": torch.randn(T, 3 * shape.hidden, generator=g).to(torch.bfloat16),
         "final_hidden": (4 * torch.randn(T, shape.hidden, generator=g)).to(torch.bfloat16)}
    if pin:
        b = {k: v.pin_memory() for k, v in b.items()}
    b.update(multi_doc=docs > 1, num_tokens=T, lengths=lengths)
    return b


# -------------------------------------------------------------------------------------------------
# GPU correctness: flex (compiled, with backward) against math
# -------------------------------------------------------------------------------------------------


def check_flex_vs_math(dev: torch.device) -> list[str]:
    """fp32 and bf16 TTT loss + gradients, flex vs math, on packed documents."""
    lines = []
    shape = Shape("check", 256, 512, 4, 2, 64, 2000, 1000, 10000.0)
    for dtype in (torch.float32, torch.bfloat16):
        torch.backends.cuda.matmul.allow_tf32 = False
        draft, head = random_setup(shape, dev, seed=1)
        draft = draft.to(dtype) if dtype == torch.bfloat16 else draft
        for p in draft.parameters():
            if p.requires_grad:
                p.data.normal_(0, 0.05)
        b = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v)
             for k, v in random_batch(shape, 768, 3, False).items()}
        tgt = target_distribution(head, b["final_hidden"].to(dtype), draft_to_target_ids(draft.d2t).to(dev),
                                  target_to_draft_ids(draft.t2d), pad_rows=8, dtype=dtype)
        res = {}
        for att in ("math", "flex"):
            model = TTTModel(draft, TTTConfig(steps=4, attention=att))
            draft.zero_grad()
            loss, stats = model(b["input_ids"][None], b["aux_hidden"][None].to(dtype), b["position_ids"][None],
                                b["loss_mask"][None], tgt.probs, tgt.ids, b["document_ids"][None])
            loss.backward()
            res[att] = (loss.detach().float(), {n: p.grad.float().clone() for n, p in draft.named_parameters()
                                                if p.grad is not None})
        lm, gm = res["math"]
        lf, gf = res["flex"]
        worst = max(((gf[n] - gm[n]).norm() / gm[n].norm().clamp_min(1e-20)).item() for n in gm)
        lrel = (abs(lf - lm) / lm).item()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        ok = lrel < tol and worst < 10 * tol
        lines.append(f"flex vs math, {str(dtype).split('.')[-1]:8s}: loss rel err {lrel:.1e}, worst grad rel err "
                     f"{worst:.1e} -> {'PASS' if ok else 'FAIL'}")
        del draft, head, res
        torch.backends.cuda.matmul.allow_tf32 = True
    return lines


def check_graph_vs_eager(dev: torch.device, steps: int = 8) -> str:
    """The same optimizer steps (bf16, compiled, packed documents) with and without CUDA graphs:
    per-step losses and the final weights must agree (the graph replays the very same kernels)."""
    shape = Shape("check", 256, 512, 4, 2, 64, 2000, 1000, 10000.0)
    batches = [random_batch(shape, 1024, 3, pin=True, seed=i) for i in range(3)]
    runs = {}
    for graphed in (False, True):
        draft, head = random_setup(shape, dev, seed=2)
        cfg = TrainConfig(ttt_steps=4, token_budget=1024, dtype="bf16", compile=True, cuda_graph=graphed, lr=1e-3,
                          warmup_steps=2)
        trainer = Trainer(cfg, draft, head, DistInfo(device=dev), total_steps=steps)
        losses = [trainer.train_step([batches[i % 3]])[:, 0].sum().item() for i in range(steps)]
        state = {k: v.float() for k, v in trainer.draft_state().items()}
        runs[graphed] = (losses, state, trainer.graphed is not None and trainer.graphed.graph is not None)
        del trainer
    (le, se, _), (lg, sg, captured) = runs[False], runs[True]
    dl = max(abs(a - b) / max(abs(a), 1e-9) for a, b in zip(le, lg, strict=True))
    dw = max(((sg[k] - se[k]).norm() / se[k].norm().clamp_min(1e-20)).item() for k in se)
    ok = captured and dl < 1e-3 and dw < 1e-3
    return (f"CUDA graph vs eager, {steps} steps: {'captured' if captured else 'NOT captured'}, max loss rel diff "
            f"{dl:.1e}, weights rel diff {dw:.1e} -> {'PASS' if ok else 'FAIL'}")


# -------------------------------------------------------------------------------------------------
# throughput: eyas and the peers, measured alike
# -------------------------------------------------------------------------------------------------


def measure(step, finite, dev: torch.device, tokens: int, steps: int, warmup: int) -> dict:
    """`warmup` steps (compilation, graph capture: counted in the peaks), then `steps` timed ones. Peaks
    count from the first step on: setup leftovers are released and the peak counters reset first."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync(dev)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step()
    sync(dev)
    dt = time.perf_counter() - t0
    cuda = dev.type == "cuda"
    return {"tok_s": tokens * steps / dt, "warmup_s": warmup_s, "finite": finite(out),
            "peak": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else float("nan"),
            "reserved": torch.cuda.max_memory_reserved(dev) / 2**30 if cuda else float("nan")}


def release(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def eyas_case(shape: Shape, T: int, variant: str, dev: torch.device, steps: int, warmup: int, ttt: int,
              docs: int) -> dict:
    graphed = variant.startswith("graphed")
    cuda = dev.type == "cuda"
    attention = "flex" if cuda and not variant.endswith("math") else "math"
    draft, head = random_setup(shape, dev)
    cfg = TrainConfig(ttt_steps=ttt, token_budget=T, dtype="bf16" if cuda else "fp32",
                      compile=graphed or variant.startswith("compiled"), cuda_graph=graphed and cuda,
                      attention=attention, lr=1e-4, warmup_steps=1)
    trainer = Trainer(cfg, draft, head, DistInfo(device=dev), total_steps=10**6)
    del draft, head
    batches = [random_batch(shape, T, docs, pin=cuda, seed=i) for i in range(2)]
    if trainer.embed_table is not None:  # what the DataLoader workers add to each batch
        for b in batches:
            e = trainer.embed_table.index_select(0, b["input_ids"])
            b["input_embeds"] = e.pin_memory() if cuda else e
    turn = itertools.cycle(batches)
    r = measure(lambda: trainer.train_step([next(turn)]), lambda stats: bool(torch.isfinite(stats).all()),
                dev, T, steps, warmup)
    r["tflops"] = draft_flops_per_token(draft_config(shape), T // docs, ttt) * r["tok_s"] / 1e12
    return r


def peer_case(shape: Shape, T: int, variant: str, dev: torch.device, steps: int, warmup: int, ttt: int,
              peer: SpecForge, wrap: str) -> dict:
    """The peer's own step from the same states, target head and draft vocabulary as eyas' case."""
    lm_head, d2t, t2d = random_target(shape, dev)
    inputs = PeerInputs([random_batch(shape, T, 1, pin=False, seed=i) for i in range(2)], lm_head.cpu(), d2t, t2d)
    del lm_head
    step, finite = peer.build_step(shape, variant, inputs, dev, ttt, wrap)
    del inputs
    return measure(step, finite, dev, T, steps, warmup)


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
          + (f"{row['tok_s']:,.0f} tok/s, peak {gib(row, 'peak')} GiB allocated ({gib(row, 'reserved')} reserved), "
             f"warmup {row['warmup_s']:.0f}s" if not row["error"] else row["error"]), flush=True)
    return row


def run_peers(specs: list[str], shapes: list[str], tokens: list[int], variants: list[str], dev: torch.device,
              args: argparse.Namespace) -> list[dict]:
    rows = []
    wrap = args.peer_wrap if dev.type == "cuda" else "none"
    with contextlib.ExitStack() as stack:
        if specs and wrap == "fsdp":
            try:
                stack.enter_context(one_process_group())
            except Exception as e:
                print(f"peers: no process group for FSDP ({type(e).__name__}: {e}); try --peer-wrap none")
                return rows
        for spec in specs:
            peer = SpecForge(spec)
            try:
                with peer.imported(dev):
                    print(f"peer {peer.label}: SpecForge {peer.version()} from {peer.path}; wrap {wrap}"
                          + ("" if peer.has_compact else "; no compact teacher"), flush=True)
                    for s, T, v in itertools.product(shapes, tokens, variants):
                        rows.append(timed_row(peer_case, peer.label, s, T, v, dev, args.steps, args.warmup, args.ttt,
                                              peer, wrap))
            except PeerUnusable as e:
                print(f"peer {peer.label}: cannot be driven ({e})", flush=True)
    return rows


# -------------------------------------------------------------------------------------------------
# report
# -------------------------------------------------------------------------------------------------


def gib(row: dict, key: str) -> str:
    return "n/a" if math.isnan(row[key]) else f"{row[key]:.2f}"


def trains(row: dict) -> str:
    return "yes" if row["finite"] else "NaN"


def ratio(a: float, b: float) -> str:
    return "n/a" if math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"


def print_tables(eyas: list[dict], peers: list[dict], ceiling: float, dev: torch.device) -> None:
    cpu = dev.type != "cuda"
    print("\n| shape | tokens | eyas variant | tok/s | GiB allocated (reserved) | draft TFLOP/s | MFU | trains |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for r in eyas:
        if r["error"]:
            print(f"| {r['shape']} | {r['tokens']} | {r['variant']} | {r['error']} | | | | |")
            continue
        tf = f"{r['tflops'] * 1e3:.2f} G" if cpu else f"{r['tflops']:.0f}"
        print(f"| {r['shape']} | {r['tokens']} | {r['variant']} | {r['tok_s']:,.0f} | {gib(r, 'peak')} "
              f"({gib(r, 'reserved')}) | {tf} | {r['tflops'] * 1e12 / ceiling:.0%} | {trains(r)} |")
    if not peers:
        return
    print("\n| shape | tokens | peer | peer variant | tok/s | GiB allocated (reserved) | trains |")
    print("|---|---|---|---|---:|---:|---|")
    for p in peers:
        cells = (f"{p['tok_s']:,.0f} | {gib(p, 'peak')} ({gib(p, 'reserved')}) | {trains(p)}"
                 if not p["error"] else f"{p['error']} | |")
        print(f"| {p['shape']} | {p['tokens']} | {p['who']} | {p['variant']} | {cells} |")
    print("\nSame-run ratios, eyas / peer: speed by tok/s; memory by peak bytes (below 1: eyas holds less)")
    print("| shape | tokens | eyas variant | peer | peer variant | speed | allocated | reserved |")
    print("|---|---|---|---|---|---:|---:|---:|")
    for r, p in itertools.product(eyas, peers):
        if not r["error"] and not p["error"] and (r["shape"], r["tokens"]) == (p["shape"], p["tokens"]):
            print(f"| {r['shape']} | {r['tokens']} | {r['variant']} | {p['who']} | {p['variant']} | "
                  f"{r['tok_s'] / p['tok_s']:.2f}x | {ratio(r['peak'], p['peak'])} | "
                  f"{ratio(r['reserved'], p['reserved'])} |")


def print_goal(eyas: list[dict], peers: list[dict], shape: str) -> None:
    print(f"\nGoal on the {shape} shape: >= {GOAL}x the fastest peer case, with no more memory by reserved bytes")
    for T in sorted({r["tokens"] for r in eyas if r["shape"] == shape}):
        ran = [p for p in peers if not p["error"] and (p["shape"], p["tokens"]) == (shape, T)]
        if not ran:
            print(f"  {T} tokens: no peer ran (--peer-src), not judged")
            continue
        best = max(ran, key=lambda p: p["tok_s"])
        print(f"  {T} tokens: fastest peer {best['who']} {best['variant']}, {best['tok_s']:,.0f} tok/s, "
              f"{gib(best, 'reserved')} GiB reserved")
        for r in (r for r in eyas if (r["shape"], r["tokens"]) == (shape, T) and not r["error"]):
            speed = r["tok_s"] / best["tok_s"]
            fits = math.isnan(r["reserved"]) or r["reserved"] <= best["reserved"]
            print(f"    eyas {r['variant']}: {speed:.2f}x, {gib(r, 'reserved')} GiB reserved -> "
                  f"{'met' if speed >= GOAL and fits else 'not met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: check that the script runs")
    ap.add_argument("--shapes", default="smol,llama8b")
    ap.add_argument("--tokens", default="2048,8192")
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
    ap.add_argument("--peer-wrap", choices=("fsdp", "none"), default="fsdp",
                    help="fsdp: as the peer's trainer runs on one GPU (one-process group); none: the bare module")
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per case")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--docs", type=int, default=1, help="documents packed per row in eyas' batches (1 = one "
                    "sequence, as the peer trains)")
    ap.add_argument("--no-check", action="store_true", help="skip the flex-vs-math and CUDA-graph-vs-eager checks")
    args = ap.parse_args()

    if args.smoke:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
        shapes, tokens, variants, peer_tokens = ["tiny"], [256], ["eager"], [256]
        peer_variants = ["sdpa", "sdpa+compact"]  # flex has no backward on CPU
        args.steps, args.warmup = 3, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke on CPU")
        dev = torch.device("cuda")
        shapes, tokens = args.shapes.split(","), [int(t) for t in args.tokens.split(",")]
        variants, peer_variants = args.variants.split(","), args.peer_variants.split(",")
        peer_tokens = [int(t) for t in args.peer_tokens.split(",") if int(t) in tokens]

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}; TTT {args.ttt}; {args.docs} document(s) per eyas row")
    if dev.type == "cuda":
        ceiling = matmul_ceiling(dev, 8192, 50, torch.bfloat16)
        print(f"bf16 matmul ceiling (8192^3): {ceiling / 1e12:.0f} TFLOP/s")
        if not args.no_check:
            try:
                for line in check_flex_vs_math(dev):
                    print(line)
                print(check_graph_vs_eager(dev))
            except Exception:
                print("flex vs math check FAILED to run:\n" + traceback.format_exc())
    else:
        ceiling = matmul_ceiling(dev, 1024, 5, torch.float32)
        print(f"fp32 matmul ceiling (1024^3, CPU): {ceiling / 1e9:.1f} GFLOP/s")

    eyas = [timed_row(eyas_case, "eyas", s, T, v, dev, args.steps, args.warmup, args.ttt, args.docs)
            for s, T, v in itertools.product(shapes, tokens, variants)]
    peers = run_peers(args.peer_src, shapes, peer_tokens, peer_variants, dev, args)
    print_tables(eyas, peers, ceiling, dev)
    print_goal(eyas, peers, "tiny" if args.smoke else "llama8b")
    print("MFU = draft training FLOPs (matmuls + attention, backward 2x) per second / measured matmul ceiling.")


if __name__ == "__main__":
    main()
