"""The training-time-test loss: target distribution over the draft vocabulary, per-step validity,
and a fused lm_head + soft cross-entropy that never keeps draft logits for the backward pass.

The per-row loss is soft cross-entropy (`LossSpec("ce")`, EAGLE-3's) or one of the LK losses
(arXiv 2602.23881), which aim at the acceptance rate itself: with q the draft's distribution and p
the target's, alpha = sum_v min(p_v, q_v) is the chance that verification accepts the draft's sample.
- lk-alpha:  -log alpha (with a one-hot p it is CE);
- lk-lambda: lam * KL(p || q) + (1 - lam) * (1 - alpha), lam = exp(-eta * alpha) per row, alpha not
  differentiated through lam: KL while the draft is poor, the acceptance rate once it is close.
alpha uses the target's probabilities over the FULL vocabulary (tokens outside the draft vocabulary can
never be accepted): p_full = mass * probs on the draft vocabulary, `TargetDist.mass` the row's share of
the target's probability inside it. KL uses the renormalised probs, as CE does.

Conventions (one packed row of N tokens, see eyas.train.ttt):
- target position p: the target's distribution at p (it predicts token p+1), from the stored final
  hidden state through the target's norm + lm_head, softmax over the draft vocabulary only;
- draft step j at row t predicts the target's distribution at p = t + 1 + j;
- it is trained when token p+1 is under the loss mask, rows t..p+1 are one document and the
  target's argmax at p lies inside the draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch

from eyas.engines.head import TargetHead


@dataclass
class TargetDist:
    """What the target says about one packed row, computed once per batch and shifted per step.

    probs: [N + pad, V_d]  softmax of the target's logits over the draft vocabulary (rows >= N are 0)
    ids:   [N + pad]       draft id of the target's argmax over its FULL vocabulary, -1 when that
                           token is not in the draft vocabulary (or the row is padding)
    mass:  [N + pad] fp32  the target's probability (over its full vocabulary) of the draft vocabulary,
                           the factor that undoes the renormalisation; None unless asked for (LK losses)
    """

    probs: torch.Tensor
    ids: torch.Tensor
    mass: torch.Tensor | None = None


LossKind = Literal["ce", "lk-alpha", "lk-lambda"]


@dataclass(frozen=True)
class LossSpec:
    """The per-row loss of the fused head: soft CE, or an LK loss (module docstring) with its eta."""

    kind: LossKind = "ce"
    eta: float = 3.0  # lk-lambda: lam = exp(-eta * alpha)

    @property
    def needs_mass(self) -> bool:
        return self.kind != "ce"


@torch.no_grad()
def target_distribution(head: TargetHead, final_hidden: torch.Tensor, vocab_ids: torch.Tensor | None,
                        target_to_draft: torch.Tensor, pad_rows: int = 0, dtype: torch.dtype = torch.float32,
                        chunk_elems: int = 1 << 27, label_temperature: float = 1.0, with_mass: bool = False
                        ) -> TargetDist:
    """final_hidden [N, H] -> TargetDist, `chunk_elems` full-vocabulary logits at a time.

    vocab_ids [V_d]: target id of each draft id (None when the draft vocabulary is the target's);
    target_to_draft [V]: draft id of each target id, -1 outside the draft vocabulary.
    label_temperature: the labels are softmax(logits / T); 1 = the target's own distribution, 0 = a
    one-hot on its argmax (what greedy verification accepts: near-ties count as a clear choice).
    with_mass: also the draft vocabulary's share of the target's probability per row (`TargetDist.mass`).
    """
    N = final_hidden.shape[0]
    V = head.vocab_size
    V_d = V if vocab_ids is None else vocab_ids.numel()
    dev = final_hidden.device
    probs = torch.empty(N + pad_rows, V_d, dtype=dtype, device=dev)
    probs[N:].zero_()
    ids = torch.full((N + pad_rows,), -1, dtype=torch.long, device=dev)
    mass = torch.zeros(N + pad_rows, dtype=torch.float32, device=dev) if with_mass else None
    rows = max(1, chunk_elems // V)
    for a in range(0, N, rows):
        b = min(N, a + rows)
        logits = head.logits(final_hidden[a:b])  # [c, V]
        ids[a:b] = target_to_draft[logits.argmax(-1)]
        if label_temperature == 0:
            hit = ids[a:b] >= 0
            probs[a:b] = torch.nn.functional.one_hot(ids[a:b].clamp(min=0), V_d).to(dtype) * hit[:, None]
            if mass is not None:
                mass[a:b] = hit.float()
            continue
        sub = logits if vocab_ids is None else logits.index_select(-1, vocab_ids)  # [c, V_d]
        scaled = sub.float() / label_temperature
        probs[a:b] = torch.softmax(scaled, dim=-1).to(dtype)
        if mass is not None:
            full = scaled if vocab_ids is None else logits.float() / label_temperature
            mass[a:b] = torch.exp(torch.logsumexp(scaled, -1) - torch.logsumexp(full, -1))
    return TargetDist(probs, ids, mass)


def step_validity(loss_mask: torch.Tensor, document_ids: torch.Tensor, target_ids: torch.Tensor,
                  steps: int) -> torch.Tensor:
    """[steps, N] bool: which rows each TTT step is trained on (module docstring).

    loss_mask [N] bool, document_ids [N] int (padding has an id of its own), target_ids [N + pad]
    from TargetDist.ids. Pure tensor ops: no host sync.
    """
    N = loss_mask.shape[0]
    pad = steps + 1
    lm = torch.nn.functional.pad(loss_mask.bool(), (0, pad), value=False)  # [N + pad]
    doc = torch.nn.functional.pad(document_ids.long(), (0, pad), value=-1)
    doc[N:] = doc.min() - 1 - torch.arange(pad, device=doc.device)  # never equal to anything else
    tid = torch.full((N + pad,), -1, dtype=torch.long, device=loss_mask.device)
    tid[: min(N + pad, target_ids.numel())] = target_ids[: N + pad]
    # target position p is usable: token p+1 trained, same document, argmax in the draft vocabulary
    usable = lm[1:] & (doc[1:] == doc[:-1]) & (tid[:-1] >= 0)  # [N + pad - 1]
    rows = torch.arange(N, device=loss_mask.device)
    out = []
    for j in range(steps):
        p = rows + 1 + j
        out.append(usable[p] & (doc[p] == doc[:N]))
    return torch.stack(out)


def reply_positions(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] long, [N] long): each trained token's index in its reply (a run of trained tokens inside one
    document; 0 = the reply's first token) and that reply's number in its document (1 = the first).
    Meaningless where loss_mask is False. Pure tensor ops: no host sync."""
    lm, doc = loss_mask.bool(), document_ids.long()
    idx = torch.arange(lm.shape[0], device=lm.device)
    new_doc = torch.ones_like(lm)
    new_doc[1:] = doc[1:] != doc[:-1]
    starts = lm.clone()
    starts[1:] &= ~(lm[:-1] & ~new_doc[1:])  # first token of each reply
    run_start = torch.where(starts, idx, 0).cummax(0).values
    count = starts.long().cumsum(0)  # replies begun so far, over the whole row
    before_doc = torch.where(new_doc, count - starts.long(), 0).cummax(0).values  # ... before this document
    return idx - run_start, count - before_doc


def opening_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """[N] bool: the first `tokens` trained tokens of each document's first reply. A prompt the draft has
    never seen (a benchmark question) starts there, and a greedy chain stops there most: the held-out
    figure over these tokens follows MT-Bench's acceptance, the one over all tokens overstates it."""
    pos, reply = reply_positions(loss_mask, document_ids)
    return loss_mask.bool() & (reply == 1) & (pos < tokens)


def reply_start_weights(loss_mask: torch.Tensor, document_ids: torch.Tensor, steps: int, weight: float,
                        tokens: int) -> torch.Tensor:
    """[steps, N] fp32: the loss weight of what each TTT step predicts at each row: `weight` when the
    predicted token (row t + 2 + j at step j) is among the first `tokens` of its reply (a run of
    trained tokens inside one document), else 1. Pure tensor ops: no host sync.

    Why: a greedy chain stops at its first miss, and misses crowd at the start of replies, where the
    target itself is least sure; the loss otherwise spends most of its weight on long replies' tails."""
    N = loss_mask.shape[0]
    early = loss_mask.bool() & (reply_positions(loss_mask, document_ids)[0] < tokens)  # [N]
    w = 1.0 + (weight - 1.0) * torch.nn.functional.pad(early.float(), (0, steps + 2))  # [N + steps + 2]
    return torch.stack([w[2 + j:N + 2 + j] for j in range(steps)])


def tau_sim(acc: list[float]) -> float:
    """Simulated acceptance length 1 + sum_k prod_{i<=k} acc_i from per-step accuracies."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


def step_weights(steps: int, decay: float = 0.8) -> list[float]:
    return [decay**j for j in range(steps)]


# -------------------------------------------------------------------------------------------------
# fused draft lm_head + per-row loss (soft cross-entropy or LK)
# -------------------------------------------------------------------------------------------------

ALPHA_FLOOR = 1e-6  # lk-alpha: -log alpha (and its gradient) stop growing below this acceptance rate


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the loss is computed in: fp32 for bf16/fp16/fp32 logits, fp64 for fp64 (the exactness tests)."""
    return torch.promote_types(dtype, torch.float32)


def _ce_chunk(z: torch.Tensor, p: torch.Tensor, m: torch.Tensor | None, tid: torch.Tensor, wv: torch.Tensor,
              grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of rows. z [c, V_d] draft logits, p [c, V_d] target probs, m: unused (CE needs no mass),
    tid [c] target argmax (draft ids), wv [c] fp32 row weight (step weight where valid, 0 elsewhere).

    Returns (ce [c] fp32 soft cross-entropy, correct [c] bool, grad wrt z [c, V_d] in grad_dtype,
    already multiplied by wv). d/dz of -sum_v p_v log softmax(z)_v is softmax(z) * sum(p) - p.
    """
    zf = z.to(accumulation_dtype(z.dtype))
    pf = p.to(zf.dtype)
    lse = torch.logsumexp(zf, dim=-1)  # [c]
    psum = pf.sum(-1)
    ce = psum * lse - (pf * zf).sum(-1)
    correct = zf.argmax(-1) == tid
    g = (torch.exp(zf - lse[:, None]) * psum[:, None] - pf) * wv[:, None]
    return ce, correct, g.to(grad_dtype)


def _lk_chunk(z: torch.Tensor, p: torch.Tensor, m: torch.Tensor, tid: torch.Tensor, wv: torch.Tensor,
              grad_dtype: torch.dtype, kind: str, eta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_ce_chunk` for the LK losses (module docstring); m [c] the rows' draft-vocabulary mass.

    With q = softmax(z), p_full = m * p and below = [q < p_full]: alpha = sum min(q, p_full) and
    d alpha / dz = q * (below - sum(q * below)); lk-alpha's gradient is -(1/alpha) of that, lk-lambda's
    lam * (q * sum(p) - p) - (1 - lam) * d alpha / dz (lam a constant of the row)."""
    zf = z.to(accumulation_dtype(z.dtype))
    pf = p.to(zf.dtype)
    logq = torch.log_softmax(zf, dim=-1)
    q = logq.exp()
    p_full = pf * m[:, None]
    below = (q < p_full).float()
    alpha = torch.minimum(q, p_full).sum(-1)  # [c]
    dalpha = q * (below - (q * below).sum(-1, keepdim=True))  # [c, V_d]
    if kind == "lk-alpha":
        floored = alpha.clamp_min(ALPHA_FLOOR)
        loss = -floored.log()
        g = dalpha * (-(alpha >= ALPHA_FLOOR).float() / floored)[:, None]
    else:
        lam = torch.exp(-eta * alpha)
        kl = torch.xlogy(pf, pf).sum(-1) - (pf * logq).sum(-1)
        loss = lam * kl + (1 - lam) * (1 - alpha)
        g = lam[:, None] * (q * pf.sum(-1, keepdim=True) - pf) - (1 - lam)[:, None] * dalpha
    correct = zf.argmax(-1) == tid
    return loss, correct, (g * wv[:, None]).to(grad_dtype)


_compiled: dict[str, Any] = {}


ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def loss_chunk_fn(spec: LossSpec) -> ChunkFn:
    """fn(z, p, m, tid, wv, grad_dtype): one chunk's per-row loss, correct flags and logit gradient, uncompiled."""
    return _ce_chunk if spec.kind == "ce" else partial(_lk_chunk, kind=spec.kind, eta=spec.eta)


def _loss_fn(spec: LossSpec, compiled: bool | ChunkFn) -> ChunkFn:
    """fn(z, p, m, tid, wv, grad_dtype) for the loss `spec` names, torch.compile'd when asked; `compiled` a
    callable: that function (a caller's own compiled chunk, eyas.train.compiling)."""
    if callable(compiled):
        return compiled
    fn = loss_chunk_fn(spec)
    if not compiled:
        return fn
    key = repr(spec)
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=False)
    return _compiled[key]


class _FusedDraftCE(torch.autograd.Function):
    """sum_j sum_rows w_j * valid_j * loss(p_target, softmax(h_j W^T)) for all TTT steps at once.
    Row i of step j is scored against target row i + 1 + j, or rows[j][i] when `rows` is given.

    The gradient wrt each chunk's logits is known in the forward pass (for CE softmax - p), so the
    forward computes grad wrt h_j and W right away, chunk by chunk, and keeps only those: the
    [N, V_d] logits of a step are never stored (eager autograd would keep ~3 of them per step).
    """

    @staticmethod
    def forward(ctx, weight: torch.Tensor, probs: torch.Tensor, tids: torch.Tensor, mass: torch.Tensor | None,
                wvalid: torch.Tensor | list[torch.Tensor], rows: torch.Tensor | list[torch.Tensor] | None, chunk: int,
                spec: LossSpec, compiled: bool | ChunkFn, *hiddens: torch.Tensor):
        # weight [V_d, H]; probs [M, V_d]; tids, mass [M]; wvalid [S, N] fp32 (or S x [N_j]); rows like wvalid
        # or None; hiddens S x [N_j, H]
        S = len(hiddens)
        cdtype = hiddens[0].dtype
        W = weight.to(cdtype)
        grad_w = None if not weight.requires_grad else \
            torch.zeros(weight.shape, dtype=torch.float32 if weight.dtype == torch.float32 else cdtype,
                        device=weight.device)
        grads_h = []
        acc = accumulation_dtype(cdtype)
        stats = torch.zeros(S, 3, dtype=acc, device=weight.device)  # loss sum, correct, count
        loss = torch.zeros((), dtype=acc, device=weight.device)
        fn = _loss_fn(spec, compiled)
        with torch.autocast(weight.device.type, enabled=False):
            for j, h in enumerate(hiddens):
                gh = torch.empty_like(h)
                for a in range(0, h.shape[0], chunk):
                    b = min(h.shape[0], a + chunk)
                    hc = h[a:b]
                    z = hc @ W.T  # [c, V_d]
                    wv = wvalid[j][a:b]
                    r = slice(a + 1 + j, b + 1 + j) if rows is None else rows[j][a:b]
                    ce, correct, g = fn(z, probs[r], None if mass is None else mass[r], tids[r], wv, cdtype)
                    valid = (wv > 0).float()
                    loss += (ce * wv).sum()
                    stats[j, 0] += (ce * valid).sum()
                    stats[j, 1] += (correct.float() * valid).sum()
                    stats[j, 2] += valid.sum()
                    torch.mm(g, W, out=gh[a:b])
                    if grad_w is None:  # a frozen head
                        continue
                    if grad_w.dtype == g.dtype:
                        grad_w.addmm_(g.T, hc)  # one GEMM, fp32 accumulation, no [V_d, H] temporary
                    else:
                        grad_w += (g.T @ hc).to(grad_w.dtype)
                grads_h.append(gh)
        ctx.save_for_backward(grad_w, *grads_h)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_stats: torch.Tensor):
        grad_w, *grads_h = ctx.saved_tensors
        # in place: a second [V_d, H] buffer here would sit on top of the backward's peak
        gw = None if grad_w is None else grad_w.mul_(grad_loss).to(ctx.weight_dtype)
        ghs = [g.mul_(grad_loss.to(g.dtype)) for g in grads_h]
        return (gw, None, None, None, None, None, None, None, None, *ghs)


def _mass_for(target: TargetDist, spec: LossSpec) -> torch.Tensor | None:
    if spec.needs_mass and target.mass is None:
        raise ValueError(f"the {spec.kind} loss needs the target's draft-vocabulary mass: "
                         "target_distribution(..., with_mass=True)")
    return target.mass if spec.needs_mass else None


def fused_draft_ce(weight: torch.Tensor, hiddens: list[torch.Tensor], target: TargetDist,
                   wvalid: torch.Tensor | list[torch.Tensor], chunk_elems: int = 1 << 25,
                   compiled: bool | ChunkFn = False, rows: torch.Tensor | list[torch.Tensor] | None = None,
                   loss: LossSpec = LossSpec()) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [V_d, H] (the draft's lm_head; no gradient computed when it is frozen), hiddens: per step
    the normed draft output [N, H], wvalid [S, N] = step weight * validity, rows [S, N]: the target row
    each step's row is scored against (None: row i + 1 + j, the TTT shift); steps of different lengths
    N_j give wvalid and rows as lists of [N_j]. `loss`: CE (EAGLE-3's) or an LK loss. Returns (loss:
    weighted per-row loss summed over rows and steps, stats [S, 3]: per step loss sum, correct count,
    valid count, all over valid rows only)."""
    N = max(h.shape[0] for h in hiddens)
    max_rows = max(16, chunk_elems // weight.shape[0])
    n_chunks = -(-N // max_rows)
    chunk = -(-N // n_chunks)  # equal chunks: one compiled shape when N divides evenly
    return _FusedDraftCE.apply(weight, target.probs, target.ids, _mass_for(target, loss), wvalid, rows, chunk, loss,
                               compiled, *hiddens)


def row_loss(logq: torch.Tensor, p: torch.Tensor, mass: torch.Tensor | None, spec: LossSpec) -> torch.Tensor:
    """The per-row loss written with plain autograd ops: logq [R, V_d] the draft's log-probabilities, p [R,
    V_d] the target's renormalised probs, mass [R] (LK) -> [R]. What the fused head's gradients must match."""
    if spec.kind == "ce":
        return -(p * logq).sum(-1)
    alpha = torch.minimum(logq.exp(), p * mass[:, None]).sum(-1)
    if spec.kind == "lk-alpha":
        return -alpha.clamp_min(ALPHA_FLOOR).log()
    lam = torch.exp(-spec.eta * alpha.detach())
    kl = torch.xlogy(p, p).sum(-1) - (p * logq).sum(-1)
    return lam * kl + (1 - lam) * (1 - alpha)


def reference_draft_ce(weight: torch.Tensor, hiddens: list[torch.Tensor], target: TargetDist,
                       wvalid: torch.Tensor | list[torch.Tensor], rows: torch.Tensor | list[torch.Tensor] | None = None,
                       loss: LossSpec = LossSpec()) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as fused_draft_ce with plain autograd (full logits): the test reference."""
    acc = accumulation_dtype(hiddens[0].dtype)
    total = torch.zeros((), dtype=acc, device=weight.device)
    mass = _mass_for(target, loss)
    stats = []
    for j, h in enumerate(hiddens):
        logq = torch.log_softmax((h @ weight.to(h.dtype).T).to(acc), dim=-1)  # [N, V_d]
        r = slice(1 + j, h.shape[0] + 1 + j) if rows is None else rows[j]
        ce = row_loss(logq, target.probs[r].to(acc), None if mass is None else mass[r], loss)
        valid = (wvalid[j] > 0).float()
        total = total + (ce * wvalid[j]).sum()
        correct = (logq.argmax(-1) == target.ids[r]).float()
        stats.append(torch.stack([(ce * valid).sum(), (correct * valid).sum(), valid.sum()]).detach())
    return total, torch.stack(stats)
