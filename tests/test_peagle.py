"""P-EAGLE (parallel drafting with EAGLE-3's model) on CPU: the attention pattern against its rule written
out, COD depth sampling, the one-forward objective against an entry-by-entry reference, training on a tiny
target (it learns, it resumes exactly), decoding (greedy output identical to the target's, one draft
forward per step, proposals equal to an independent plain-torch forward), and export/import for vLLM and
speculators."""

from __future__ import annotations

import json

import _packs
import pytest
import torch
from _packs import V_D, V, make_pack, tiny_draft
from _peagle_utils import capture, make_peagle, reference_parallel_logits, target_dist, train_peagle
from _train_utils import TINY_EAGLE3, metric_rows, train_quietly, train_store

from eyas.engines.head import TargetHead
from eyas.export import ServeOptions, export_draft
from eyas.model.attention import ParallelDraftAttention
from eyas.model.checkpoints import import_draft
from eyas.model.config import DraftOptions
from eyas.model.families import load_draft
from eyas.model.peagle import PEagleDraft
from eyas.train.loss import step_validity
from eyas.train.peagle import ParallelConfig, ParallelObjective, depth_counts, sample_depths
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")

PACK_MASK = 0.85  # the share of a pack's document tokens trained here (DFlash's tests: 0.8)


def tiny_peagle(layers: int = 2, seed: int = 0) -> tuple[PEagleDraft, TargetHead]:
    """A random P-EAGLE draft (weights larger than the init, so every path shows) and a random target head."""
    return tiny_draft(PEagleDraft, "peagle", layers, seed, head_from_target=False)


# -- the attention pattern and the depths ---------------------------------------------------------------------


def test_parallel_mask_is_the_rule_written_out_and_flex_agrees():
    """Entry q sees entry k iff same document and (k is a row at or before q's anchor, or k is one of q's
    anchor's mask slots at a depth <= q's); flex attention's block mask computes the same attention."""
    docs_rows = torch.tensor([0] * 6 + [1] * 7)
    anchor = torch.cat([torch.arange(13), torch.tensor([2, 5, 8, 11, 2, 8, 8])])
    depth = torch.cat([torch.zeros(13, dtype=torch.long), torch.tensor([1, 1, 1, 1, 2, 2, 3])])
    att = ParallelDraftAttention(anchor, depth, docs_rows[anchor], "math")
    mask, T = att.dense_mask(), anchor.numel()
    for q in range(T):
        for k in range(T):
            same = docs_rows[anchor[q]] == docs_rows[anchor[k]]
            row = depth[k] == 0 and anchor[k] <= anchor[q]
            slot = depth[k] >= 1 and anchor[k] == anchor[q] and depth[k] <= depth[q]
            assert bool(mask[q, k]) == bool(same and (row or slot)), (q, k)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, T, 8, generator=g) for n in (4, 2, 2))
    flex = ParallelDraftAttention(anchor, depth, docs_rows[anchor], "flex")(q, k, v)
    assert torch.allclose(flex, att(q, k, v), atol=1e-5)


def test_depths_are_nested_seeded_and_trained():
    """COD: depth d holds ceil(N * max(r^d, r_min)) entries; a usable anchor of depth d is a usable anchor of
    depth d-1 whose depth-d target is trained; the same seed draws the same anchors."""
    ids, mask, pos, docs, _, final = make_pack([30, 25, 20], pad=5, mask_ratio=PACK_MASK)
    _, head = tiny_peagle()
    draft, _ = tiny_peagle()
    tgt = target_dist(draft, head.logits(final), 6)
    valid = step_validity(mask, docs, tgt.ids, 5)
    counts = depth_counts(80, 5, 0.7, 0.2)
    assert counts == [56, 40, 28, 20]
    picks = sample_depths(valid, counts, seed=4)
    assert all(torch.equal(a, b) and torch.equal(u, w) for (a, u), (b, w) in zip(picks, sample_depths(valid, counts, 4),
                                                                              strict=True))
    assert not torch.equal(picks[0][0], sample_depths(valid, counts, 5)[0][0])
    previous = set(range(80))
    for d, (anchors, usable) in enumerate(picks, start=1):
        assert anchors.numel() == counts[d - 1] and torch.equal(anchors, anchors.sort().values)
        chosen = set(anchors[usable].tolist())
        assert chosen <= previous and all(bool(valid[d, a]) for a in chosen) and len(chosen) >= 3
        previous = chosen


# -- the objective ----------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_objective(draft, head, pack, depths, seed):
    """Every entry on its own: its anchor's document up to the anchor, then d mask slots, the plain forward;
    scored against the target's softmax at anchor + 1 + d (restricted to the draft vocabulary)."""
    ids, mask, pos, docs, aux, final = pack
    N = ids.numel()
    tgt = target_dist(draft, head.logits(final), depths + 1)
    valid = step_validity(mask, docs, tgt.ids, depths)
    picks = sample_depths(valid, depth_counts(N, depths, 0.7, 0.2), seed)
    entries = [(t, 0) for t in range(N) if valid[0, t]]
    entries += [(int(a), d) for d, (anchors, usable) in enumerate(picks, start=1) for a in anchors[usable]]
    nxt = torch.cat([ids[1:], torch.zeros(1, dtype=torch.long)])
    loss, stats = torch.zeros(()), torch.zeros(depths, 3)
    for a, d in entries:
        ctx = torch.nonzero((docs == docs[a]) & (torch.arange(N) <= a)).flatten()
        logits = reference_parallel_logits(draft, aux[ctx], nxt[ctx], pos[ctx], d)[d]
        logq = torch.log_softmax(logits, -1)
        ce = -(tgt.probs[a + 1 + d] * logq).sum()
        loss += ce
        stats[d] += torch.stack([ce, (logq.argmax() == tgt.ids[a + 1 + d]).float(), torch.tensor(1.0)])
    return loss, stats


@pytest.mark.parametrize("fused", [True, False])
def test_objective_equals_an_entry_by_entry_reference(fused):
    """Packed documents and padding: the one-forward objective (every row at depth 0, sampled anchors at
    depths 1..3, the parallel mask, the fused head) gives each valid entry's CE and accuracy exactly as the
    entries run one by one; the gradients reach fc, the layers, mask_hidden and mask_embed, never the frozen
    embedding."""
    draft, head = tiny_peagle()
    pack = make_pack([20, 13, 30], pad=7, mask_ratio=PACK_MASK)
    ids, mask, pos, docs, aux, final = pack
    cfg = ParallelConfig(depths=4, attention="math", fused_loss=fused, loss_chunk_elems=5 * V_D)
    loss, stats = ParallelObjective(draft, cfg)(ids, aux, pos, mask, docs, target_dist(draft, head.logits(final), 5),
                                                seed=3)
    ref_loss, ref_stats = reference_objective(draft, head, pack, depths=4, seed=3)
    assert stats[:, 2].tolist() == ref_stats[:, 2].tolist() and stats[3, 2] > 5
    assert stats[:, 1].tolist() == ref_stats[:, 1].tolist()
    assert torch.allclose(stats[:, 0], ref_stats[:, 0], rtol=1e-4)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)
    loss.backward()
    for p in (draft.fc.weight, draft.layers[1].mlp.down_proj.weight, draft.mask_hidden, draft.mask_embed,
              draft.lm_head.weight):
        assert p.grad.abs().sum() > 0
    assert draft.embed_tokens.weight.grad is None


def test_fused_and_reference_losses_give_the_same_gradients():
    grads = []
    for fused in (True, False):
        draft, head = tiny_peagle()
        ids, mask, pos, docs, aux, final = make_pack([25, 30], pad=0, seed=2, mask_ratio=PACK_MASK)
        cfg = ParallelConfig(depths=5, attention="math", fused_loss=fused, loss_chunk_elems=7 * V_D)
        loss, _ = ParallelObjective(draft, cfg)(ids, aux, pos, mask, docs, target_dist(draft, head.logits(final), 6), 1)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    _packs.check_same_grads(grads)


def test_config_and_registry(tmp_path):
    draft, _ = tiny_peagle()
    data = draft.config.to_dict()
    assert data["family"] == "peagle" and data["mask_token_id"] == V - 1 and "block_size" not in data
    draft.save_pretrained(tmp_path / "d")
    again = load_draft(tmp_path / "d")
    assert isinstance(again, PEagleDraft) and again.config == draft.config
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), again.state_dict().values(), strict=True))
    with pytest.raises(EyasError, match="never chains"):
        DraftOptions(family="peagle", norm_output=True)


# -- training through `eyas train --family peagle` -----------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return train_store(tmp_path_factory.mktemp("peagle_train"))


def train(out, store=None, **kw):
    return train_quietly(out, store=store, **{**TINY_EAGLE3, "family": "peagle", "mask_token_id": 0, **kw})


def test_peagle_training_learns_the_tiny_target(data, tmp_path):
    """150 steps: the loss falls and every depth's accuracy rises above where it started."""
    _, _, store = data
    result = train(tmp_path / "run", store, max_steps=150, log_every=15, warmup_ratio=0.05)
    m = metric_rows(tmp_path / "run")
    first, last = m[0], m[-1]
    assert len(last["acc"]) == 3 and last["step"] == 150  # stats rows = depths 0..2
    assert last["loss"] < 0.8 * first["loss"], (first, last)
    assert last["acc"][0] > max(0.15, 2 * first["acc"][0]) and min(last["acc"]) > first["acc"][0], (first, last)
    draft = load_draft(tmp_path / "run" / "draft")
    assert isinstance(draft, PEagleDraft) and draft.config.mask_token_id == 0
    assert result["options"]["train"]["cod_ratio"] == 0.7 and "ttt_decay" not in result["options"]["train"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_peagle_resume_follows_the_same_curve(data, tmp_path, dtype):
    """Stopped after step 4 (last checkpoint at 3) and resumed: the same losses, accuracies, validations and
    weights as a run never stopped (the anchors are the batch's, not the RNG's). bf16 keeps the embedding
    table on the host, as on a GPU; the mask embedding is a parameter of its own."""
    _packs.check_resume_follows_the_same_curve(train, data[2], tmp_path, dtype)


def test_peagle_options_are_checked(data, tmp_path):
    _, _, store = data
    with pytest.raises(EyasError, match="reply-start-weight"):
        train(tmp_path / "x", store, reply_start_weight=2.0)
    with pytest.raises(EyasError, match="mask-token-id"):  # every id of the tiny vocabulary is trained on
        train(tmp_path / "y", store, mask_token_id=-1, max_steps=1)
    with pytest.raises(EyasError, match="cod-ratio"):
        train(tmp_path / "z", store, cod_ratio=0.1, cod_min_ratio=0.2)


# -- decoding -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama target, its greedy continuations of 6 prompts, and a P-EAGLE draft (one layer, vocab 48 of
    64, 4 depths) trained on them."""
    target, aux, prompts, seqs = _packs.tiny_target()
    draft = make_peagle(target, aux, 48, mask_token_id=63, seqs=seqs)
    losses = train_peagle(draft, capture(target, seqs, aux), steps=150)
    return {"target": target, "aux": aux, "prompts": prompts, "draft": draft, "losses": losses}


def test_greedy_parallel_decoding_is_the_targets_output(tiny):
    """fp32, greedy: chains of 1..4 from one draft forward each; the output is the target's own, tokens per
    verify step above 1, and trees are refused up front."""
    _packs.check_one_forward_decoding(tiny, 4)


def test_proposals_equal_an_independent_parallel_forward(tiny):
    """Every round's K proposals are the argmax of the plain-torch P-EAGLE forward over every verified
    position (token p+1, the target's state at p, from transformers' output_hidden_states) and K-1 mask
    slots: what vLLM's parallel drafting computes (NOTES 2.5)."""
    draft = tiny["draft"]

    def reference(seq, aux, L, newest):
        return reference_parallel_logits(draft, aux[:L], torch.tensor(seq[1:L + 1]), torch.arange(L), 3)

    checked = _packs.check_proposals(tiny, 4, reference)
    assert checked >= 12, checked


# -- export and import ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_dir(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("peagle_target") / "target"
    tiny["target"].save_pretrained(path)
    return path


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_export_then_import_gives_the_same_draft(tmp_path, tiny, target_dir, fmt):
    """vLLM's layout is EAGLE-3's + mask_token_id + mask_hidden, the mask embedding in embed_tokens' row; the
    README's command turns parallel drafting on. Read back, every tensor is the same but that row (the
    target's in eyas' own layout, the learned one after the trip: the draft never reads it elsewhere)."""
    draft = tiny["draft"]
    out = export_draft(draft, tmp_path / fmt, fmt, ServeOptions(verifier=str(target_dir), dtype="float32",
                                                                num_speculative_tokens=4))
    config = json.loads((out / "config.json").read_text())
    assert config["mask_token_id"] == 63
    if fmt == "vllm":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]  # not PEagleDraftModel: vLLM 0.32 refuses it
        assert '"parallel_drafting": true' in (out / "README.md").read_text()
    else:
        assert config["speculators_model_type"] == "peagle" and config["norm_before_residual"] is False
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert "mask_embed" not in tensors and tuple(tensors["mask_hidden"].shape) == (1, 3 * 64)
    assert torch.equal(tensors["embed_tokens.weight"][63], draft.mask_embed.detach())
    back = import_draft(out, target=target_dir)
    assert isinstance(back, PEagleDraft) and back.config.to_dict() == {**draft.config.to_dict(),
                                                                       "target": back.config.target}
    for (n, a), b in zip(draft.state_dict().items(), back.state_dict().values(), strict=True):
        if n == "embed_tokens.weight":
            assert torch.equal(a[:63], b[:63]) and torch.equal(b[63], draft.mask_embed.detach())
        else:
            assert torch.equal(a, b), n
    with pytest.raises(EyasError, match="embedding"):
        export_draft(draft, tmp_path / "noemb", fmt, ServeOptions(verifier=str(target_dir), include_embedding=False))
    with pytest.raises(EyasError, match="served in the vllm, speculators"):
        export_draft(draft, tmp_path / "sg", "sglang", ServeOptions(verifier=str(target_dir)))
