"""Shared by the DFlash and P-EAGLE CPU tests (one-forward drafters, tested alike): a packed row of random
documents and a random tiny draft with a random target head (both sized V, V_D, H), the tiny target the
decoding tests train on, and the checks both families' training and decoding tests make."""

from __future__ import annotations

import pytest
import torch
from _draft_utils import capture
from _eval_utils import speculate, target_and_continuations
from _train_utils import metric_rows

from eyas.engines.head import TargetHead
from eyas.eval import ChainSpec, HFTarget, TreeSpec, evaluate_draft
from eyas.eval.proposers import make_proposer
from eyas.model.config import DraftConfig
from eyas.model.draft import DraftModel
from eyas.model.families import load_draft
from eyas.model.vocab import build_draft_vocab
from eyas.utils.io import EyasError

V, V_D, H = 50, 40, 32


def make_pack(doc_lengths: list[int], pad: int, seed: int = 1, mask_ratio: float = 0.8):
    """One packed row: documents side by side (positions restart), then `pad` padding tokens; about
    `mask_ratio` of the document tokens are trained."""
    g = torch.Generator().manual_seed(seed)
    N = sum(doc_lengths) + pad
    ids, mask = torch.randint(0, V - 1, (N,), generator=g), torch.rand(N, generator=g) < mask_ratio
    pos, docs = torch.zeros(N, dtype=torch.long), torch.full((N,), len(doc_lengths), dtype=torch.long)
    a = 0
    for d, n in enumerate(doc_lengths):
        pos[a:a + n], docs[a:a + n] = torch.arange(n), d
        a += n
    mask[a:] = False
    pos[a:] = torch.arange(pad)
    return ids, mask, pos, docs, torch.randn(N, 3 * H, generator=g), 3 * torch.randn(N, H, generator=g)


def tiny_draft(cls: type[DraftModel], family: str, layers: int, seed: int, head_from_target: bool,
               **config) -> tuple[DraftModel, TargetHead]:
    """A random `cls` draft (weights larger than the init, so every path shows; mask token V-1) and a random
    target head; its head started from the target's when `head_from_target`."""
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=V, draft_vocab_size=V_D, target_hidden_size=H, aux_layer_ids=[1, 2, 3],
                      rope_theta=10000.0, num_hidden_layers=layers, family=family, mask_token_id=V - 1, **config)
    draft = cls(cfg)
    for p in draft.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.3).add_(1.0 if p.dim() == 1 else 0.0)  # norms around 1
    head = TargetHead(torch.randn(V, H), 1 + 0.1 * torch.randn(H), torch.randn(V, H), 1e-6)
    draft.load_target_embedding(head.embed_tokens)
    draft.set_vocab(*build_draft_vocab(torch.randint(0, 100, (V,)), V_D))
    if head_from_target:
        draft.init_lm_head_from_target(head.lm_head, head.norm_weight)
    return draft, head


def tiny_target() -> tuple[object, list[int], list[list[int]], list[list[int]]]:
    """The EAGLE-3 decoding tests' target, aux layers, prompts (ids below 63: 63 is the mask token) and greedy
    continuations: what the one-forward drafters' decoding tests train on."""
    return target_and_continuations(prompt_ids=63)


def check_resume_follows_the_same_curve(train, store, tmp_path, dtype: str) -> None:
    """Stopped after step 4 (last checkpoint at 3) and resumed: the same losses, accuracies, validations and
    weights as a run never stopped."""
    kw = dict(max_steps=7, save_every=3, grad_accum=2, num_workers=1, val_samples=8, val_every=3, dtype=dtype,
              offload_embedding=dtype == "bf16")
    train(tmp_path / "full", store, **kw)
    assert train(tmp_path / "cut", store, stop_after=4, **kw)["stopped_at"] == 4
    train(tmp_path / "cut", store, resume=True, **kw)
    full, cut = metric_rows(tmp_path / "full"), metric_rows(tmp_path / "cut")
    assert len(full) == len(cut) and any("val" in r for r in full)
    for a, b in zip(full, cut, strict=True):
        a, b = a.get("val", a), b.get("val", b)
        assert a["loss"] == b["loss"] and a["acc"] == b["acc"] and a.get("lr") == b.get("lr"), (a, b)
    w_full, w_cut = load_draft(tmp_path / "full" / "draft"), load_draft(tmp_path / "cut" / "draft")
    assert all(torch.equal(a, b) for a, b in zip(w_full.state_dict().values(), w_cut.state_dict().values(),
                                                     strict=True))


def check_same_grads(grads: list[dict[str, torch.Tensor]]) -> None:
    """The fused and the reference loss give the same gradients, parameter by parameter."""
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[0]:
        assert (grads[0][n] - grads[1][n]).norm() <= 1e-5 * grads[1][n].norm(), n


def check_one_forward_decoding(tiny: dict, k: int) -> dict:
    """`tiny`'s draft learned, and fp32 greedy chains of 1 and `k` from one draft forward each give the target's
    own output with tau above 1.5; trees are refused up front. Returns the chain-`k` row of the table."""
    losses = tiny["losses"]  # soft labels: the loss falls towards the target's entropy, not to 0
    assert sum(losses[-20:]) < 0.95 * sum(losses[:20])
    res = evaluate_draft(tiny["target"], None, tiny["draft"], tiny["prompts"], chain=[1, k], max_new_tokens=32,
                         warmup=False, progress=False)
    table = res.table()["all"]
    for name in ("chain-1", f"chain-{k}"):
        assert table[name]["identical_to_target"] == 1.0 and table[name]["compared"] == 6
        assert table[name]["draft_forwards_per_step"] == 1.0  # the point of a one-forward drafter
    row = table[f"chain-{k}"]
    assert row["tau"] > 1.5, row
    assert len(row["accept_rate_by_pos"]) == k
    with pytest.raises(EyasError, match="trees"):
        evaluate_draft(tiny["target"], None, tiny["draft"], tiny["prompts"][:1], chain=[], tree=[TreeSpec(8, 3, 2)],
                       max_new_tokens=4, warmup=False, progress=False)
    return row


def check_proposals(tiny: dict, k: int, reference) -> int:
    """Decodes 3 of `tiny`'s prompts with chains of `k` and holds every round's proposals against the argmax
    of `reference(seq, aux, L, newest)`: an independent forward's draft logits [k, V_d] from the target's
    states (output_hidden_states) of the finished sequence, L tokens in the target's cache, `newest` the
    token after them. Returns how many rounds were checked."""
    target, aux_ids, draft = tiny["target"], tiny["aux"], tiny["draft"]
    wrapped = HFTarget(target, aux_ids)
    proposer = make_proposer(draft)
    rounds, chain = [], proposer.chain

    def record(cache, pending, n, *args):
        out = chain(cache, pending, n, *args)
        rounds.append((int(pending.cached[0]), int(pending.newest[0]), out[0][0].tolist()))
        return out

    proposer.chain = record
    checked = 0
    for prompt in tiny["prompts"][:3]:
        rounds.clear()
        seq = prompt + speculate(wrapped, draft, [prompt], ChainSpec(k), 24, proposer=proposer)[0].tokens
        aux = capture(target, [seq], aux_ids)[0][1]
        for L, newest, proposed in rounds:
            assert seq[L] == newest
            logits = reference(seq, aux, L, newest)
            assert draft.draft_to_target(logits.argmax(-1)).tolist() == proposed, (L, proposed)
            checked += 1
    wrapped.close()
    return checked
