"""EAGLE-3 draft training speed and memory, against the bf16 matmul ceiling and a peer's figures.

    python3 benchmarks/train.py            # GPU (H200): ~5-8 minutes, most of it torch.compile
    python3 benchmarks/train.py --smoke    # CPU: tiny shapes, checks the script end to end

One run measures:
1. the bf16 matmul ceiling (8192^3 GEMM), the denominator of MFU;
2. GPU correctness of the paths the CPU tests cannot run (flex attention has no backward on CPU):
   TTT loss and gradients with flex (document masks + log-sum-exp merge, compiled) vs math;
3. full optimizer steps of eyas' trainer (eyas.train.trainer.Trainer: target distribution from
   the stored final state through the target's norm + lm_head, 7 TTT steps, fused loss, backward,
   clipping, AdamW on fp32 master weights) for (a) the SmolLM2-135M draft and (b) a
   Llama-3.1-8B-shaped draft, at 2048 and 8192 tokens, in variants (torch.compile of the layer and
   loss on/off), with random stored states; tok/s, peak memory, draft TFLOP/s and MFU, and ratios
   to SpecForge 0.2.0's figures on an H200 (2048 tokens, TTT 7).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import matmul_ceiling, sync  # noqa: E402

from eyas.engines.head import TargetHead  # noqa: E402
from eyas.model.config import DraftConfig  # noqa: E402
from eyas.model.draft import Eagle3Draft  # noqa: E402
from eyas.model.vocab import build_draft_vocab, draft_to_target_ids, target_to_draft_ids  # noqa: E402
from eyas.train.config import TrainConfig  # noqa: E402
from eyas.train.distributed import DistInfo  # noqa: E402
from eyas.train.loss import target_distribution  # noqa: E402
from eyas.train.trainer import Trainer  # noqa: E402
from eyas.train.ttt import TTTConfig, TTTModel  # noqa: E402

# SpecForge 0.2.0 on one H200, 2048 tokens, TTT 7 (tok/s, peak GiB); None = not published
PEER = {("llama8b", 2048): (20700, 11.4), ("smol", 2048): (46400, None)}
PEER_SDPA = {("llama8b", 2048): (16500, 16.6)}
GOAL = 1.25


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





def random_setup(shape: Shape, dev: torch.device, seed: int = 0) -> tuple[Eagle3Draft, TargetHead]:
    torch.manual_seed(seed)
    cfg = draft_config(shape)
    with torch.device(dev):
        draft = Eagle3Draft(cfg)
        head = TargetHead(torch.empty(0), torch.ones(shape.hidden),
                          (torch.randn(shape.vocab, shape.hidden) * 0.05).to(torch.bfloat16 if dev.type == "cuda"
                                                                               else torch.float32), 1e-5)
    draft.set_vocab(*build_draft_vocab(torch.randint(0, 10**6, (shape.vocab,)), shape.draft_vocab))
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
# throughput
# -------------------------------------------------------------------------------------------------


def run_case(shape: Shape, T: int, variant: str, dev: torch.device, steps: int, warmup: int, ttt: int,
             docs: int) -> dict:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    graphed = variant.startswith("graphed")
    compile_ = graphed or variant.startswith("compiled")
    cuda = dev.type == "cuda"
    attention = "flex" if cuda and not variant.endswith("math") else "math"
    draft, head = random_setup(shape, dev)
    cfg = TrainConfig(ttt_steps=ttt, token_budget=T, dtype="bf16" if cuda else "fp32", compile=compile_,
                      cuda_graph=graphed and cuda, attention=attention, lr=1e-4, warmup_steps=1)
    trainer = Trainer(cfg, draft, head, DistInfo(device=dev), total_steps=10**6)
    del draft, head
    batches = [random_batch(shape, T, docs, pin=cuda, seed=i) for i in range(2)]
    if trainer.embed_table is not None:  # what the DataLoader workers add to each batch
        for b in batches:
            e = trainer.embed_table.index_select(0, b["input_ids"])
            b["input_embeds"] = e.pin_memory() if cuda else e
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for i in range(warmup):  # graphed: eager steps, then the capture (counted in the peak: it holds the step)
        trainer.train_step([batches[i % 2]])
    sync(dev)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        stats = trainer.train_step([batches[i % 2]])
    sync(dev)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else float("nan")
    reserved = torch.cuda.max_memory_reserved(dev) / 2**30 if cuda else float("nan")
    finite = bool(torch.isfinite(stats).all())
    tok_s = T * steps / dt
    flops = draft_flops_per_token(trainer.draft.config, T // docs, ttt) * tok_s
    del trainer, batches
    return {"tok_s": tok_s, "peak": peak, "reserved": reserved, "tflops": flops / 1e12, "warmup_s": compile_s,
            "finite": finite}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: check that the script runs")
    ap.add_argument("--shapes", default="smol,llama8b")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--variants", default="graphed,compiled", help="graphed: compiled, and each optimizer step "
                    "replayed as one CUDA graph (the default on one GPU); compiled: torch.compile of the layer "
                    "halves, final norm and loss chunk (+ compiled flex); eager: only flex compiled; "
                    "compiled-math: attention with the scores written out (no flex; compare with the peer's SDPA "
                    "figure)")
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per case")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--docs", type=int, default=1, help="documents packed per row (1 = one sequence, as the peer)")
    ap.add_argument("--no-check", action="store_true", help="skip the flex-vs-math and CUDA-graph-vs-eager checks")
    args = ap.parse_args()

    if args.smoke:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
        shapes, tokens, variants = ["tiny"], [256], ["eager"]
        args.steps, args.warmup = 3, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke on CPU")
        dev = torch.device("cuda")
        shapes, tokens = args.shapes.split(","), [int(t) for t in args.tokens.split(",")]
        variants = args.variants.split(",")

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}; TTT {args.ttt}; {args.docs} document(s) per row")
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

    rows = []
    for s in shapes:
        for T in tokens:
            for v in variants:
                t = time.perf_counter()
                try:
                    r = run_case(SHAPES[s], T, v, dev, args.steps, args.warmup, args.ttt, args.docs)
                    r["error"] = ""
                except torch.OutOfMemoryError:
                    r = {"error": "out of memory"}
                except Exception as e:
                    traceback.print_exc()
                    r = {"error": f"{type(e).__name__}: {str(e)[:80]}"}
                r.update(shape=s, tokens=T, variant=v, wall=time.perf_counter() - t)
                rows.append(r)
                print(f"  {s} {T} {v}: " + (f"{r['tok_s']:,.0f} tok/s, peak {r['peak']:.2f} GiB allocated "
                                            f"({r['reserved']:.2f} reserved), warmup {r['warmup_s']:.0f}s"
                                            if not r["error"] else r["error"]), flush=True)

    print()
    hdr = (f"| shape | tokens | variant | tok/s | peak GiB | draft TFLOP/s | MFU | peer tok/s | speed vs peer | "
           f"mem vs peer | goal (>= {GOAL}x, <= mem) |")
    print(hdr)
    print("|---" * (hdr.count("|") - 1) + "|")
    for r in rows:
        if r["error"]:
            print(f"| {r['shape']} | {r['tokens']} | {r['variant']} | {r['error']} | | | | | | | |")
            continue
        peer = (PEER_SDPA if r["variant"].endswith("math") else PEER).get((r["shape"], r["tokens"]))
        mfu = r["tflops"] * 1e12 / ceiling
        if peer:
            speed = r["tok_s"] / peer[0]
            mem = f"{r['peak'] / peer[1]:.2f}x" if peer[1] else "n/a"
            goal = "yes" if speed >= GOAL and (not peer[1] or r["peak"] <= peer[1]) else "no"
            peer_s, speed_s = f"{peer[0]:,}", f"{speed:.2f}x"
        else:
            peer_s = speed_s = mem = "-"
            goal = "trains" if r["finite"] else "NaN"
        tf = r["tflops"] if dev.type == "cuda" else r["tflops"] * 1e3
        print(f"| {r['shape']} | {r['tokens']} | {r['variant']} | {r['tok_s']:,.0f} | {r['peak']:.2f} | "
              f"{tf:.{0 if dev.type == 'cuda' else 2}f}{'' if dev.type == 'cuda' else ' G'} | {mfu:.0%} | {peer_s} | "
              f"{speed_s} | {mem} | {goal} |")
    print()
    for (s, T), (tok, mem) in PEER_SDPA.items():
        print(f"peer with SDPA instead of flex ({s}, {T}): {tok:,} tok/s, {mem} GiB")
    print("MFU = draft training FLOPs (matmuls + attention, backward 2x) per second / measured matmul ceiling.")


if __name__ == "__main__":
    main()
