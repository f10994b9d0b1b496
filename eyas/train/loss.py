"""The training-time-test loss: target distribution over the draft vocabulary, per-step validity,
and a fused lm_head + soft cross-entropy that never keeps draft logits for the backward pass.

Conventions (one packed row of N tokens, see eyas.train.ttt):
- target position p: the target's distribution at p (it predicts token p+1), from the stored final
  hidden state through the target's norm + lm_head, softmax over the draft vocabulary only;
- draft step j at row t predicts the target's distribution at p = t + 1 + j;
- it is trained when token p+1 is under the loss mask, rows t..p+1 are one document and the
  target's argmax at p lies inside the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.engines.head import TargetHead


@dataclass
class TargetDist:
    """What the target says about one packed row, computed once per batch and shifted per step.

    probs: [N + pad, V_d]  softmax of the target's logits over the draft vocabulary (rows >= N are 0)
    ids:   [N + pad]       draft id of the target's argmax over its FULL vocabulary, -1 when that
                           token is not in the draft vocabulary (or the row is padding)
    """

    probs: torch.Tensor
    ids: torch.Tensor


@torch.no_grad()
def target_distribution(head: TargetHead, final_hidden: torch.Tensor, vocab_ids: torch.Tensor | None,
                        target_to_draft: torch.Tensor, pad_rows: int = 0, dtype: torch.dtype = torch.float32,
                        chunk_elems: int = 1 << 27, label_temperature: float = 1.0) -> TargetDist:
    """final_hidden [N, H] -> TargetDist, `chunk_elems` full-vocabulary logits at a time.

    vocab_ids [V_d]: target id of each draft id (None when the draft vocabulary is the target's);
    target_to_draft [V]: draft id of each target id, -1 outside the draft vocabulary.
    label_temperature: the labels are softmax(logits / T); 1 = the target's own distribution, 0 = a
    one-hot on its argmax (what greedy verification accepts: near-ties count as a clear choice).
    """
    N = final_hidden.shape[0]
    V = head.vocab_size
    V_d = V if vocab_ids is None else vocab_ids.numel()
    dev = final_hidden.device
    probs = torch.empty(N + pad_rows, V_d, dtype=dtype, device=dev)
    probs[N:].zero_()
    ids = torch.full((N + pad_rows,), -1, dtype=torch.long, device=dev)
    rows = max(1, chunk_elems // V)
    for a in range(0, N, rows):
        b = min(N, a + rows)
        logits = head.logits(final_hidden[a:b])  # [c, V]
        ids[a:b] = target_to_draft[logits.argmax(-1)]
        if label_temperature == 0:
            hit = ids[a:b] >= 0
            probs[a:b] = torch.nn.functional.one_hot(ids[a:b].clamp(min=0), V_d).to(dtype) * hit[:, None]
            continue
        sub = logits if vocab_ids is None else logits.index_select(-1, vocab_ids)  # [c, V_d]
        probs[a:b] = torch.softmax(sub.float() / label_temperature, dim=-1).to(dtype)
    return TargetDist(probs, ids)


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
# fused draft lm_head + soft cross-entropy
# -------------------------------------------------------------------------------------------------


def _ce_chunk(z: torch.Tensor, p: torch.Tensor, tid: torch.Tensor, wv: torch.Tensor, grad_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of rows. z [c, V_d] draft logits, p [c, V_d] target probs, tid [c] target argmax
    (draft ids), wv [c] fp32 row weight (step weight where valid, 0 elsewhere).

    Returns (ce [c] fp32 soft cross-entropy, correct [c] bool, grad wrt z [c, V_d] in grad_dtype,
    already multiplied by wv). d/dz of -sum_v p_v log softmax(z)_v is softmax(z) * sum(p) - p.
    """
    zf = z.float()
    pf = p.float()
    lse = torch.logsumexp(zf, dim=-1)  # [c]
    psum = pf.sum(-1)
    ce = psum * lse - (pf * zf).sum(-1)
    correct = zf.argmax(-1) == tid
    g = (torch.exp(zf - lse[:, None]) * psum[:, None] - pf) * wv[:, None]
    return ce, correct, g.to(grad_dtype)


_compiled_ce = None


def _ce_fn(compiled: bool):
    global _compiled_ce
    if not compiled:
        return _ce_chunk
    if _compiled_ce is None:
        _compiled_ce = torch.compile(_ce_chunk, dynamic=False)
    return _compiled_ce


class _FusedDraftCE(torch.autograd.Function):
    """sum_j sum_rows w_j * valid_j * CE(p_target, softmax(h_j W^T)) for all TTT steps at once.

    The gradient wrt each chunk's logits is known in the forward pass (softmax - p), so the
    forward computes grad wrt h_j and W right away, chunk by chunk, and keeps only those: the
    [N, V_d] logits of a step are never stored (eager autograd would keep ~3 of them per step).
    """

    @staticmethod
    def forward(ctx, weight: torch.Tensor, probs: torch.Tensor, tids: torch.Tensor, wvalid: torch.Tensor,
                chunk: int, compiled: bool, *hiddens: torch.Tensor):
        # weight [V_d, H]; probs [N + pad, V_d]; tids [N + pad]; wvalid [S, N] fp32; hiddens S x [N, H]
        S, N = wvalid.shape
        cdtype = hiddens[0].dtype
        W = weight.to(cdtype)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32 if weight.dtype == torch.float32 else cdtype,
                             device=weight.device)
        grads_h = []
        stats = torch.zeros(S, 3, dtype=torch.float32, device=weight.device)  # ce_sum, correct, count
        loss = torch.zeros((), dtype=torch.float32, device=weight.device)
        fn = _ce_fn(compiled)
        with torch.autocast(weight.device.type, enabled=False):
            for j, h in enumerate(hiddens):
                gh = torch.empty_like(h)
                for a in range(0, N, chunk):
                    b = min(N, a + chunk)
                    hc = h[a:b]
                    z = hc @ W.T  # [c, V_d]
                    wv = wvalid[j, a:b]
                    ce, correct, g = fn(z, probs[a + 1 + j:b + 1 + j], tids[a + 1 + j:b + 1 + j], wv, cdtype)
                    valid = (wv > 0).float()
                    loss += (ce * wv).sum()
                    stats[j, 0] += (ce * valid).sum()
                    stats[j, 1] += (correct.float() * valid).sum()
                    stats[j, 2] += valid.sum()
                    torch.mm(g, W, out=gh[a:b])
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
        gw = grad_w.mul_(grad_loss).to(ctx.weight_dtype)
        ghs = [g.mul_(grad_loss.to(g.dtype)) for g in grads_h]
        return (gw, None, None, None, None, None, *ghs)


def fused_draft_ce(weight: torch.Tensor, hiddens: list[torch.Tensor], target: TargetDist, wvalid: torch.Tensor,
                   chunk_elems: int = 1 << 25, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [V_d, H] (the draft's lm_head), hiddens: per step the normed draft output [N, H],
    wvalid [S, N] = step weight * validity. Returns (loss: weighted CE summed over rows and steps,
    stats [S, 3]: per step CE sum, correct count, valid count, all over valid rows only)."""
    N = wvalid.shape[1]
    max_rows = max(16, chunk_elems // weight.shape[0])
    n_chunks = -(-N // max_rows)
    chunk = -(-N // n_chunks)  # equal chunks: one compiled shape when N divides evenly
    return _FusedDraftCE.apply(weight, target.probs, target.ids, wvalid, chunk, compiled, *hiddens)


def reference_draft_ce(weight: torch.Tensor, hiddens: list[torch.Tensor], target: TargetDist,
                       wvalid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as fused_draft_ce with plain autograd (full logits): the test reference."""
    S, N = wvalid.shape
    loss = torch.zeros((), dtype=torch.float32, device=weight.device)
    stats = []
    for j, h in enumerate(hiddens):
        logq = torch.log_softmax((h @ weight.to(h.dtype).T).float(), dim=-1)  # [N, V_d]
        p = target.probs[1 + j:N + 1 + j].float()
        ce = -(p * logq).sum(-1)
        valid = (wvalid[j] > 0).float()
        loss = loss + (ce * wvalid[j]).sum()
        correct = (logq.argmax(-1) == target.ids[1 + j:N + 1 + j]).float()
        stats.append(torch.stack([(ce * valid).sum(), (correct * valid).sum(), valid.sum()]).detach())
    return loss, torch.stack(stats)
