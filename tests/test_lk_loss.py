"""The LK losses (arXiv 2602.23881) in the fused draft head: their value and gradient against the definition
written with plain autograd, the one-hot case (LK^alpha is CE), the target's draft-vocabulary mass, each
family's objective (EAGLE-3's TTT, DFlash's blocks, P-EAGLE's depths) fused against its autograd reference,
and the option's place in the training schema and fingerprint."""

from __future__ import annotations

import json

import pytest
import torch
from _train_utils import make_store

from eyas.engines.head import TargetHead
from eyas.model.config import DraftConfig
from eyas.model.dflash import DFlashDraft
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.peagle import PEagleDraft
from eyas.model.vocab import build_draft_vocab, draft_to_target_ids, target_to_draft_ids
from eyas.train.config import TrainConfig
from eyas.train.dflash import BlockConfig, BlockObjective
from eyas.train.loss import LossSpec, TargetDist, fused_draft_ce, target_distribution
from eyas.train.peagle import ParallelConfig, ParallelObjective
from eyas.train.ttt import TTTConfig, TTTModel
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")

V, V_D, H = 50, 30, 32
KINDS = ["lk-alpha", "lk-lambda"]


def definition(h: torch.Tensor, weight: torch.Tensor, p: torch.Tensor, mass: torch.Tensor, kind: str, eta: float
               ) -> torch.Tensor:
    """Per-row LK loss from the paper's definitions: alpha = sum_v min(p_full(v), q(v)) with p_full the
    target's probability over its whole vocabulary (here mass * renormalised p), lam = exp(-eta * sg(alpha))."""
    q = torch.softmax(h @ weight.T, -1)
    p_full = mass[:, None] * p
    alpha = torch.stack([sum(min(a, b) for a, b in zip(pr, qr, strict=True)) for pr, qr in zip(p_full, q, strict=True)])
    if kind == "lk-alpha":
        return -torch.log(alpha)
    kl = (p * (torch.log(p) - torch.log(q))).sum(-1)
    lam = torch.exp(-eta * alpha.detach())
    return lam * kl + (1 - lam) * (1 - alpha)


def random_rows(n: int, seed: int = 0, one_hot: bool = False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(V_D, H, generator=g)).requires_grad_()
    if one_hot:
        ids = torch.randint(0, V_D, (n,), generator=g)
        p, mass = torch.nn.functional.one_hot(ids, V_D).float(), torch.ones(n)
    else:
        p = torch.softmax(2 * torch.randn(n, V_D, generator=g), -1)
        ids, mass = p.argmax(-1), 0.3 + 0.7 * torch.rand(n, generator=g)
    return h, weight, p, mass, ids


@pytest.mark.parametrize("kind", KINDS)
def test_fused_lk_equals_its_definition_value_and_gradient(kind):
    """Rows of different draft-vocabulary mass, small chunks: the fused head's loss, per-row stats and
    gradients (wrt the hidden states and the head) equal autograd through the definition."""
    n = 23
    h, weight, p, mass, ids = random_rows(n)
    w = torch.rand(n) * (torch.rand(n) < 0.8)  # row weights, some rows invalid
    pad = torch.zeros(1, V_D)
    target = TargetDist(torch.cat([pad, p]), torch.cat([torch.tensor([-1]), ids]), torch.cat([torch.zeros(1), mass]))
    loss, stats = fused_draft_ce(weight, [h], target, w[None], chunk_elems=5 * V_D, loss=LossSpec(kind, 3.0))
    loss.backward()
    g_h, g_w = h.grad.clone(), weight.grad.clone()
    h.grad = weight.grad = None
    per_row = definition(h, weight, p, mass, kind, 3.0)
    ref = (per_row * w).sum()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert stats[0, 0].item() == pytest.approx((per_row * (w > 0)).sum().item(), rel=1e-5)
    assert stats[0, 2].item() == (w > 0).sum().item()
    assert torch.allclose(g_h, h.grad, atol=1e-6, rtol=1e-4) and torch.allclose(g_w, weight.grad, atol=1e-6, rtol=1e-4)


def test_a_one_hot_target_reduces_lk_alpha_to_ce():
    """With the target's whole probability on one draft token, the acceptance rate is q(that token) and
    -log alpha is the cross-entropy: the same loss and the same gradients."""
    h, weight, p, mass, ids = random_rows(17, seed=3, one_hot=True)
    target = TargetDist(torch.cat([torch.zeros(1, V_D), p]), torch.cat([torch.tensor([-1]), ids]),
                        torch.cat([torch.zeros(1), mass]))
    w = torch.ones(1, 17)
    results = []
    for spec in (LossSpec("ce"), LossSpec("lk-alpha")):
        h.grad = weight.grad = None
        loss, stats = fused_draft_ce(weight, [h], target, w, chunk_elems=4 * V_D, loss=spec)
        loss.backward()
        results.append((loss.item(), stats, h.grad.clone(), weight.grad.clone()))
    (ce, s_ce, gh_ce, gw_ce), (lk, s_lk, gh_lk, gw_lk) = results
    assert lk == pytest.approx(ce, rel=1e-5) and torch.allclose(s_ce, s_lk, rtol=1e-5)
    assert torch.allclose(gh_ce, gh_lk, atol=1e-6) and torch.allclose(gw_ce, gw_lk, atol=1e-6)


def test_target_distribution_carries_the_draft_vocabulary_mass():
    """mass = the target's full-vocabulary probability of the draft vocabulary (at the label temperature):
    what turns the renormalised probs back into the probabilities verification accepts with."""
    torch.manual_seed(0)
    head = TargetHead(torch.randn(V, H), 1 + 0.1 * torch.randn(H), torch.randn(V, H), 1e-6)
    final = 3 * torch.randn(11, H)
    vocab = torch.randperm(V)[:V_D].sort().values
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[vocab] = torch.arange(V_D)
    logits = head.logits(final).float()
    for temperature in (1.0, 0.5):
        tgt = target_distribution(head, final, vocab, t2d, pad_rows=2, chunk_elems=3 * V,
                                  label_temperature=temperature, with_mass=True)
        full = torch.softmax(logits / temperature, -1)
        assert torch.allclose(tgt.mass[:11], full[:, vocab].sum(-1), atol=1e-6) and tgt.mass[11:].eq(0).all()
        assert torch.allclose(tgt.probs[:11] * tgt.mass[:11, None], full[:, vocab], atol=1e-6)
    hard = target_distribution(head, final, vocab, t2d, label_temperature=0, with_mass=True)
    assert torch.equal(hard.mass, (hard.ids >= 0).float())
    everything = target_distribution(head, final, None, torch.arange(V), with_mass=True)
    assert torch.allclose(everything.mass, torch.ones(11)) and target_distribution(head, final, None,
                                                                                    torch.arange(V)).mass is None


# -- each family's objective, fused against its plain-autograd reference ---------------------------------------


def small_draft(family: str, seed: int = 0):
    torch.manual_seed(seed)
    extra = {"dflash": dict(family="dflash", block_size=4, mask_token_id=V - 1),
             "peagle": dict(family="peagle", mask_token_id=V - 1)}.get(family, {})
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=V, draft_vocab_size=V_D, target_hidden_size=H, aux_layer_ids=[1, 2, 3],
                      rope_theta=10000.0, num_hidden_layers=2, **extra)
    draft = {"eagle3": Eagle3Draft, "dflash": DFlashDraft, "peagle": PEagleDraft}[family](cfg)
    for p in draft.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.3).add_(1.0 if p.dim() == 1 else 0.0)
    head = TargetHead(torch.randn(V, H), 1 + 0.1 * torch.randn(H), 2 * torch.randn(V, H), 1e-6)
    draft.load_target_embedding(head.embed_tokens)
    draft.set_vocab(*build_draft_vocab(torch.randint(0, 100, (V,)), V_D))
    return draft, head


def run_objective(family: str, kind: str, fused: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    draft, head = small_draft(family)
    g = torch.Generator().manual_seed(1)
    N = 40
    ids, mask = torch.randint(0, V - 1, (N,), generator=g), torch.rand(N, generator=g) < 0.85
    docs = torch.tensor([0] * 22 + [1] * 18)
    pos = torch.cat([torch.arange(22), torch.arange(18)])
    aux, final = torch.randn(N, 3 * H, generator=g), 3 * torch.randn(N, H, generator=g)
    spec, chunk = LossSpec(kind, 3.0), 7 * V_D
    tgt = target_distribution(head, final, draft_to_target_ids(draft.d2t), target_to_draft_ids(draft.t2d),
                              pad_rows=6, with_mass=True)
    if family == "eagle3":
        model = TTTModel(draft, TTTConfig(steps=3, attention="math", fused_loss=fused, loss_chunk_elems=chunk,
                                          loss=spec))
        loss, stats = model(ids[None], aux[None], pos[None], mask[None], tgt.probs, tgt.ids, docs[None],
                            target_mass=tgt.mass)
    elif family == "dflash":
        model = BlockObjective(draft, BlockConfig(block_size=4, anchors=10, attention="math", fused_loss=fused,
                                                  loss_chunk_elems=chunk, loss=spec))
        loss, stats = model(ids, aux, pos, mask, docs, tgt, seed=2)
    else:
        model = ParallelObjective(draft, ParallelConfig(depths=4, attention="math", fused_loss=fused,
                                                        loss_chunk_elems=chunk, loss=spec))
        loss, stats = model(ids, aux, pos, mask, docs, tgt, seed=2)
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["eagle3", "dflash", "peagle"])
def test_each_familys_fused_lk_equals_plain_autograd(family, kind):
    """The objective with the fused head (gradients formed chunk by chunk, no logits kept) gives the loss,
    per-step stats and parameter gradients of the same objective over full logits with plain autograd."""
    loss, stats, grads = run_objective(family, kind, fused=True)
    ref_loss, ref_stats, ref_grads = run_objective(family, kind, fused=False)
    assert stats[0, 2] > 5 and torch.equal(stats[:, 1:], ref_stats[:, 1:])
    assert torch.allclose(stats[:, 0], ref_stats[:, 0], rtol=1e-5)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for n in grads:
        assert (grads[n] - ref_grads[n]).norm() <= 1e-5 * ref_grads[n].norm() + 1e-9, n


# -- the option -------------------------------------------------------------------------------------------------


def test_loss_option_schema_and_fingerprint():
    """CE (the default) leaves the fingerprint as it was before --loss existed; an LK loss and its eta join it
    for every family whose objective reads them."""
    from eyas.model.family_facts import FAMILIES
    from eyas.train.objectives import objective_class

    for family in FAMILIES:
        objective = objective_class(family)
        assert {"loss", "lk_eta"} <= set(objective.options), family
        ce = TrainConfig().schedule_options(objective.options)
        lk = TrainConfig(loss="lk-lambda", lk_eta=2.0).schedule_options(objective.options)
        assert "loss" not in ce and "lk_eta" not in ce
        assert lk["loss"] == "lk-lambda" and lk["lk_eta"] == 2.0
    assert TrainConfig(loss="lk-alpha").loss_spec() == LossSpec("lk-alpha", 3.0)
    with pytest.raises(EyasError, match="lk-eta"):
        TrainConfig(lk_eta=-1.0)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return make_store(tmp_path_factory.mktemp("lk_train"))[2]
    finally:
        torch.set_num_threads(n)


def test_eagle3_trains_with_an_lk_loss(store, tmp_path):
    """`eyas train --loss lk-lambda`: the loss logged is the LK loss (between 0 and ~log V_d), it falls, and
    the manifest's options name it."""
    from eyas.recipes.train import TrainOptions, run_train

    result = run_train(TrainOptions(out=tmp_path / "lk", store=store, loss="lk-lambda", ttt_steps=2, max_steps=40,
                                    draft_vocab_size=48, token_budget=256, num_workers=0, report_to="none",
                                    log_every=10, save_every=0, lr=3e-3), log=lambda m: None)
    m = [json.loads(line) for line in (tmp_path / "lk" / "metrics.jsonl").read_text().splitlines()]
    assert 0 < m[-1]["loss"] < m[0]["loss"] < 8, (m[0], m[-1])
    assert result["options"]["train"]["loss"] == "lk-lambda" and result["options"]["train"]["lk_eta"] == 3.0
