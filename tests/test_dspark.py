"""DSpark (DFlash's block forward + a Markov head + a confidence head) on CPU, added through the family
declaration alone: the objective against a slot-by-slot reference, `eyas train --family dspark` learning a
tiny target, decoding identical to the target with proposals equal to an independent forward and the
Markov chain, `eyas eval`, and vLLM's layout written and read back with every field its engine reads."""

from __future__ import annotations

import json
import math

import _packs
import pytest
import torch
from _dflash_utils import capture, reference_block_logits, target_dist
from _draft_utils import draft_for_target, train_on
from _packs import V_D, H, V, make_pack, tiny_draft
from _train_utils import metric_rows, train_quietly, train_store
from transformers import LlamaForCausalLM

from eyas.eval import TreeSpec, evaluate_draft
from eyas.export import ServeOptions, export_draft
from eyas.export.dspark import ENGINE_FIELDS, check_engine_fields
from eyas.model.attention import BlockAttention
from eyas.model.checkpoints import import_draft
from eyas.model.config import DraftOptions
from eyas.model.dspark import DSparkDraft
from eyas.model.families import load_draft
from eyas.recipes.run import make_untrained_draft
from eyas.train.dflash import BlockConfig, sample_anchors
from eyas.train.dspark import DSparkObjective
from eyas.train.loss import TargetDist, reference_draft_ce
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")
B = 4


def test_objective_equals_a_slot_by_slot_reference():
    """Slot j of the block at anchor a is scored at row a + j on lm_head(norm(x_j)) + markov_w2 markov_w1[x_{a+j}],
    written out with the model's plain modules; the fused head gives the same loss and statistics."""
    draft, head = tiny_draft(DSparkDraft, "dspark", 2, 0, head_from_target=True, block_size=B, markov_rank=8)
    ids, mask, pos, docs, aux, _ = make_pack([20, 14], pad=2)
    probs = torch.softmax(torch.randn(ids.numel() + B, V_D), -1)
    tids = probs.argmax(-1)
    target = TargetDist(probs, tids)
    cfg = BlockConfig(block_size=B, gamma=4.0, anchors=6, attention="math")
    fused, stats = DSparkObjective(draft, cfg).blocks(ids, aux, pos, mask, docs, target, seed=3)
    plain, plain_stats = DSparkObjective(draft, BlockConfig(**{**cfg.__dict__, "fused_loss": False})).blocks(
        ids, aux, pos, mask, docs, target, seed=3)
    assert torch.allclose(fused, plain, rtol=1e-5) and torch.allclose(stats, plain_stats)
    assert stats.shape == (B, 3) and stats[0, 2] > 0  # one row per slot, the anchor's included

    # the CE part by hand: the bias written as markov_w2(markov_w1(prev)), the head as lm_head(norm(x))
    anchors, usable = sample_anchors(mask, docs, 6, 3)
    block = draft.block_embeds(draft.embed_tokens(ids[anchors]), B).reshape(1, -1, H)
    out = draft(block, (pos[anchors][:, None] + torch.arange(B)).reshape(1, -1), draft.context(aux[None]), pos[None],
                BlockAttention(anchors, docs, B, "math")).view(len(anchors), B, H)
    hiddens, rows, wvalid = [], [], []
    for j in range(B):
        r = anchors + j
        nxt = torch.nn.functional.pad(mask.bool(), (0, B))[r + 1]
        same = torch.nn.functional.pad(docs, (0, B), value=-1)[r + 1] == docs[anchors]
        prev = torch.nn.functional.pad(ids, (0, B))[r]
        bias = draft.markov_head.markov_w2(draft.markov_head.markov_w1(prev))
        logits = draft.lm_head(draft.norm(out[:, j])) + bias
        assert torch.allclose(logits, draft.logits_after(out[:, j], prev), atol=1e-5)
        hiddens.append(torch.cat([draft.norm(out[:, j]), draft.markov_head.markov_w1(prev)], -1))
        rows.append(r)
        wvalid.append((usable & nxt & same & (tids[r] >= 0)).float() * math.exp(-j / 4.0))
    ce, ce_stats = reference_draft_ce(draft.head_weight(), hiddens, target, wvalid, rows=rows)
    assert torch.allclose(ce_stats, stats) and ce <= fused  # the rest is the confidence head's BCE (>= 0)
    fused.backward()
    assert draft.markov_head.markov_w2.weight.grad.abs().sum() > 0 and draft.fc.weight.grad.abs().sum() > 0
    assert draft.confidence_head.proj.weight.grad.abs().sum() > 0 and draft.lm_head.weight.grad is None


@pytest.fixture(scope="module")
def tiny():
    """The one-forward drafters' tiny target and a DSpark draft (blocks of 4, Markov rank 16) trained on its
    greedy continuations with eyas' objective."""
    target, aux, prompts, seqs = _packs.tiny_target()
    opts = DraftOptions(family="dspark", draft_vocab_size=48, block_size=B, mask_token_id=63, markov_rank=16)
    draft = draft_for_target(DSparkDraft, target, aux, opts, seqs, 0)
    objective = DSparkObjective(draft, BlockConfig(block_size=B, gamma=4.0, anchors=16, attention="math"))
    losses = train_on(draft, objective.blocks, lambda logits: target_dist(draft, logits, B),
                      capture(target, seqs, aux), 150, 3e-3)
    return {"target": target, "aux": aux, "prompts": prompts, "draft": draft, "losses": losses}


def test_greedy_decoding_is_the_targets_output_with_blocks_of_k(tiny):
    """fp32 greedy, batched at 1-3 rows: K proposals from one forward of a block of K (the anchor's slot proposes
    too), the output the target's own; trained 150 steps, chains of 4 accept well above what an untrained draft
    does (measured tau 2.18; untrained about 1)."""
    res = evaluate_draft(tiny["target"], None, tiny["draft"], tiny["prompts"], chain=[1, B], max_new_tokens=32,
                         warmup=False, progress=False, batch_sizes=[1, 2, 3])
    table = res.table()["all"]
    for name in ("chain-1", f"chain-{B}"):
        assert table[name]["identical_to_target"] == 1.0 and table[name]["draft_forwards_per_step"] == 1.0
    assert {r["batch_size"] for r in res.serving} == {1, 2, 3}  # DSpark decodes batched, as every family
    assert all(r["identical"] == 1.0 for r in res.serving if r["method"] != "target"), res.serving
    assert table[f"chain-{B}"]["tau"] > 1.8 and len(table[f"chain-{B}"]["accept_rate_by_pos"]) == B
    with pytest.raises(EyasError, match="trees"):
        evaluate_draft(tiny["target"], None, tiny["draft"], tiny["prompts"][:1], chain=[], tree=[TreeSpec(8, 3, 2)],
                       max_new_tokens=4, warmup=False, progress=False)
    with pytest.raises(EyasError, match="blocks of 4"):
        evaluate_draft(tiny["target"], None, tiny["draft"], tiny["prompts"][:1], chain=[5], max_new_tokens=4,
                       warmup=False, progress=False)


def test_proposals_equal_an_independent_forward_and_the_markov_chain(tiny):
    """Every round's proposals: the plain-torch DFlash forward of [anchor, MASK x 3] at positions L .. L+3, then
    left to right the Markov bias of the token before (the anchor, then the previous proposal)."""
    draft = tiny["draft"]
    w1, w2 = draft.markov_head.markov_w1.weight.detach(), draft.markov_head.markov_w2.weight.detach()

    def reference(seq, aux, L, anchor):
        block = torch.tensor([anchor] + [draft.config.mask_token_id] * (B - 1))
        base = reference_block_logits(draft, aux[:L], torch.arange(L), block, torch.arange(L, L + B))
        prev, rows = anchor, []
        for j in range(B):
            logits = base[j] + w1[prev] @ w2.T
            rows.append(logits)
            prev = int(draft.draft_to_target(logits.argmax()[None])[0])
        return torch.stack(rows)

    assert _packs.check_proposals(tiny, B, reference) >= 10


# -- through the CLI stages -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return train_store(tmp_path_factory.mktemp("dspark_train"))


def test_eyas_train_family_dspark_learns_the_tiny_target(data, tmp_path):
    """`eyas train --family dspark`: the loss falls, the anchor's slot learns, and the saved draft decodes the
    target's own output with more than one token per target forward (`eyas eval` of a DSpark folder:
    tests/test_eval_cli.py)."""
    target, _, store = data
    result = train_quietly(tmp_path / "run", store=store, family="dspark", block_size=B, mask_token_id=0,
                           markov_rank=8, draft_vocab_size=48, token_budget=256, num_workers=0, report_to="none",
                           log_every=20, save_every=0, lr=3e-3, block_gamma=4.0, max_steps=120, warmup_ratio=0.05)
    m = metric_rows(tmp_path / "run")
    first, last = m[0], m[-1]
    assert len(last["acc"]) == B and last["loss"] < 0.9 * first["loss"], (first, last)  # stats rows: slots 0..3
    assert last["acc"][0] > max(0.15, 2 * first["acc"][0]), (first, last)
    assert result["options"]["draft"]["markov_rank"] == 8 and "ttt_steps" not in result["options"]["train"]
    draft = load_draft(tmp_path / "run" / "draft")
    assert isinstance(draft, DSparkDraft) and draft.config.markov_rank == 8
    make_untrained_draft(tmp_path / "run" / "draft", tmp_path / "untrained")
    model = LlamaForCausalLM.from_pretrained(target).eval()
    prompts = [[1 + (7 * i + j) % 40 for j in range(6)] for i in range(3)]
    rows = [evaluate_draft(model, None, d.eval(), prompts, chain=[B], max_new_tokens=16, warmup=False,
                           progress=False).table()["all"][f"chain-{B}"]
            for d in (draft, load_draft(tmp_path / "untrained"))]
    assert all(r["identical_to_target"] == 1.0 for r in rows) and rows[0]["tau"] > rows[1]["tau"] + 0.1, rows


# -- vLLM's layout ------------------------------------------------------------------------------------------------


def test_export_writes_every_field_vllm_reads_and_reads_back(tmp_path, tiny):
    target_dir = tmp_path / "target"
    tiny["target"].save_pretrained(target_dir)
    draft = tiny["draft"]
    out = export_draft(draft, tmp_path / "vllm", "vllm", ServeOptions(verifier=str(target_dir), dtype="float32"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["sample_from_anchor"] is True
    assert config["markov_rank"] == 16 and config["enable_confidence_head"] and config["block_size"] == B
    assert config["dflash_config"]["target_layer_ids"] == [k - 1 for k in tiny["aux"]]
    assert "num_speculative_tokens\": 4" in (out / "README.md").read_text()
    back = import_draft(out, target=target_dir)
    assert isinstance(back, DSparkDraft) and back.config.markov_rank == 16
    for name, t in draft.state_dict().items():
        assert torch.equal(t, back.state_dict()[name]), name
    # a field vLLM reads, left out: the writer refuses, and so does the reader of such a folder
    for name in ENGINE_FIELDS:
        with pytest.raises(EyasError, match=name):
            check_engine_fields({k: v for k, v in config.items() if k != name})
    config.pop("sample_from_anchor")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(EyasError, match="sample_from_anchor"):
        import_draft(out, target=target_dir)
    with pytest.raises(EyasError, match="vllm layout"):
        export_draft(draft, tmp_path / "sg", "sglang", ServeOptions(dtype="float32"))


def test_options_and_config():
    data = tiny_draft(DSparkDraft, "dspark", 1, 0, head_from_target=True, block_size=B, markov_rank=4)[0]
    d = data.config.to_dict()
    assert d["family"] == "dspark" and d["markov_rank"] == 4 and d["block_size"] == B and d["mask_token_id"] == V - 1
    with pytest.raises(EyasError, match="markov-rank"):
        DraftOptions(family="dspark", markov_rank=0)
    with pytest.raises(EyasError, match="fc-norm"):
        DraftOptions(family="dspark", fc_norm=True)
