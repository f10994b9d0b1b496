"""Training-time test (EAGLE-3): the draft is unrolled for `steps` steps on every batch, each step
fed the draft's own previous output, exactly as it runs at inference.

One packed row of N tokens (several documents side by side, `document_ids` telling them apart):

    step 0:  row t sees token x[t+1] and the target's fused aux state at t   -> predicts p_target(t+1)
    step j:  row t sees token x[t+1+j] and the draft's step j-1 output at t  -> predicts p_target(t+1+j)
             at rotary position pos[t] + j, attending to the step-0 keys of its document up to t
             and to its own keys of steps 1..j (eyas.model.attention.TTTAttention)

The target distribution is computed once per batch (eyas.train.loss.target_distribution) and
shifted by one row per step; the loss is the step-weighted (0.8^j) soft cross-entropy (or an LK loss,
eyas.train.loss.LossSpec), summed over valid rows (optionally weighted up at the start of each reply:
eyas.train.loss.reply_start_weights).
The caller divides by the number of valid step-0 rows of the whole global batch (eyas.train.trainer),
so the loss of a batch does not depend on how it is split over micro-batches and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.model.attention import TTTAttention
from eyas.model.eagle3 import Eagle3Draft
from eyas.train.compiling import Background, CompiledOrEager
from eyas.train.loss import (
    LossSpec,
    TargetDist,
    fused_draft_ce,
    loss_chunk_fn,
    reference_draft_ce,
    reply_start_weights,
    step_validity,
    step_weights,
    tau_sim,
)


@dataclass
class TTTConfig:
    steps: int = 7
    decay: float = 0.8
    attention: str = "auto"  # math | flex | auto (flex on CUDA)
    compile: bool = False  # torch.compile the layer's two halves and the loss chunk (CUDA)
    compile_in_background: bool = False  # with compile: eager first steps while a thread compiles the parts
    loss_chunk_elems: int = 1 << 25  # draft logits computed this many elements at a time
    fused_loss: bool = True  # False: plain autograd over full logits (reference, tests)
    reply_start_weight: float = 1.0  # loss weight of a reply's first `reply_start_tokens` tokens (1 = EAGLE-3's)
    reply_start_tokens: int = 64
    loss: LossSpec = LossSpec()  # the per-row loss: soft CE (EAGLE-3's) or an LK loss


def compile_draft_layers(draft: Eagle3Draft, background: Background | None = None) -> None:
    """Compile each decoder layer's halves around the attention call and the final norm (static
    shapes, no Python state): fused elementwise work, and cheap intermediates recomputed in the
    backward pass instead of kept. `background`: they run eagerly until it has compiled them."""

    def wrap(fn: Any, name: str) -> CompiledOrEager:
        part = CompiledOrEager(fn, name, deferred=background is not None)
        return background.add(part) if background is not None else part

    for i, layer in enumerate(draft.layers):
        if not isinstance(layer.attention_inputs, CompiledOrEager):
            layer.attention_inputs = wrap(layer.attention_inputs, f"layers.{i}.attention_inputs")
            layer.finish = wrap(layer.finish, f"layers.{i}.finish")
    if not isinstance(draft.norm.forward, CompiledOrEager):
        draft.norm.forward = wrap(draft.norm.forward, "norm")


def shift_left(x: torch.Tensor, n: int, value: int = 0) -> torch.Tensor:
    """[B, T] -> [B, T]: x[:, n:] followed by n copies of `value`."""
    return F.pad(x[:, n:], (0, n), value=value)


class TTTModel(nn.Module):
    """The draft unrolled for TTT; one forward = all steps + the loss, so DDP/FSDP wrap it whole."""

    def __init__(self, draft: Eagle3Draft, cfg: TTTConfig) -> None:
        super().__init__()
        self.draft = draft
        self.cfg = cfg
        self.weights = step_weights(cfg.steps, cfg.decay)
        self.background = Background() if cfg.compile and cfg.compile_in_background else None
        self.loss_chunk: Any = cfg.compile  # the fused loss' chunk: compiled (True), eager, or a deferred part
        if cfg.compile:
            compile_draft_layers(draft, self.background)
        if self.background is not None:
            self.loss_chunk = self.background.add(CompiledOrEager(loss_chunk_fn(cfg.loss), "loss", deferred=True))

    def _step_weights(self, device: torch.device) -> torch.Tensor:
        """[S] fp32 on `device`, made once (a pageable host->device copy would sync the stream)."""
        w = getattr(self, "_w", None)
        if w is None or w.device != device:
            w = self._w = torch.tensor(self.weights, dtype=torch.float32).to(device)
        return w

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, position_ids: torch.Tensor,
                loss_mask: torch.Tensor, target_probs: torch.Tensor, target_ids: torch.Tensor,
                document_ids: torch.Tensor | None = None, input_embeds: torch.Tensor | None = None,
                block_mask: Any = None, target_mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, position_ids, loss_mask [B, T]; aux_hidden [B, T, k*H_t]; target_probs
        [B*T + pad, V_d] and target_ids [B*T + pad] (TargetDist, pad >= steps); document_ids [B, T]
        with ids unique across rows, or None (one document per row; padding at the end of a row
        needs no id of its own: causal attention never looks forward); input_embeds [B, T, H]: the
        frozen embeddings of input_ids, when the trainer keeps the table off the device;
        block_mask: flex attention's mask of document_ids, when the caller built it (CUDA graphs);
        target_mass [B*T + pad]: TargetDist.mass, which the LK losses need.

        Returns (loss: step-weighted CE summed over valid rows, fp32 scalar; stats [steps, 3] fp32:
        per step CE sum, correct count, valid count)."""
        B, T = input_ids.shape
        S = self.cfg.steps
        draft = self.draft
        docs = document_ids
        if docs is None:
            docs = torch.arange(B, device=input_ids.device)[:, None].expand(B, T)
        valid = step_validity(loss_mask.reshape(-1), docs.reshape(-1), target_ids, S)  # [S, B*T]
        wvalid = valid.float() * self._step_weights(input_ids.device)[:, None]
        if self.cfg.reply_start_weight != 1.0:
            wvalid = wvalid * reply_start_weights(loss_mask.reshape(-1), docs.reshape(-1), S,
                                                  self.cfg.reply_start_weight, self.cfg.reply_start_tokens)
        attend = TTTAttention(self.cfg.attention, document_ids=document_ids, block_mask=block_mask,
                              window=draft.config.sliding_window)
        hidden = draft.fuse(aux_hidden)  # [B, T, H]
        outs = []
        for j in range(S):
            emb = None if input_embeds is None else F.pad(input_embeds[:, 1 + j:], (0, 0, 0, 1 + j))
            hidden = draft(shift_left(input_ids, 1 + j), hidden, position_ids + j, attend, emb)  # [B, T, H]
            outs.append(draft.head_input(hidden).reshape(B * T, -1))
        target = TargetDist(target_probs, target_ids, target_mass)
        if self.cfg.fused_loss:
            return fused_draft_ce(draft.lm_head.weight, outs, target, wvalid, self.cfg.loss_chunk_elems,
                                  compiled=self.loss_chunk, loss=self.cfg.loss)
        return reference_draft_ce(draft.lm_head.weight, outs, target, wvalid, loss=self.cfg.loss)


def summarize(stats: torch.Tensor | list, weights: list[float]) -> dict[str, Any]:
    """stats [S, 3] summed over a window (CE sum, correct, count per step) -> loggable metrics.

    loss = sum_j w_j CE_sum_j / count_0 (what is optimized); loss_j = CE_sum_j / count_j."""
    rows = stats.tolist() if isinstance(stats, torch.Tensor) else stats
    n0 = max(rows[0][2], 1.0)
    acc = [r[1] / r[2] if r[2] else 0.0 for r in rows]
    return {
        "loss": sum(w * r[0] for w, r in zip(weights, rows, strict=True)) / n0,
        "step_loss": [r[0] / r[2] if r[2] else 0.0 for r in rows],
        "acc": acc,
        "tau_sim": tau_sim(acc),
        "valid_tokens": int(rows[0][2]),
    }
