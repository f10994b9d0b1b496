"""GPU correctness checks of benchmarks/train.py, for the paths CPU tests cannot run (flex attention has
no backward on CPU; CUDA graphs need a GPU): flex TTT attention against the math path, and optimizer steps
replayed as CUDA graphs against the same steps run eagerly."""

from __future__ import annotations

import torch
from train_inputs import Shape, random_batch, random_setup

from eyas.model.vocab import draft_to_target_ids, target_to_draft_ids
from eyas.train.config import TrainConfig
from eyas.train.distributed import DistInfo
from eyas.train.loss import target_distribution
from eyas.train.trainer import Trainer
from eyas.train.ttt import TTTConfig, TTTModel


def check_flex_vs_math(dev: torch.device) -> list[str]:
    """fp32 and bf16 TTT loss + gradients, flex vs math, on packed documents; and fp32 with a sliding window
    (--draft-window: one block mask per step) shorter than the documents."""
    lines = []
    shape = Shape("check", 256, 512, 4, 2, 64, 2000, 1000, 10000.0)
    for dtype, window in ((torch.float32, 0), (torch.bfloat16, 0), (torch.float32, 100)):
        torch.backends.cuda.matmul.allow_tf32 = False
        draft, head = random_setup(shape, dev, seed=1)
        draft.config.sliding_window = window
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
        name = str(dtype).split(".")[-1] + (f", window {window}" if window else "")
        lines.append(f"flex vs math, {name:8s}: loss rel err {lrel:.1e}, worst grad rel err "
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
