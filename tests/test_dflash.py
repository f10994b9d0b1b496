"""DFlash (block-parallel drafting) on CPU: the block attention mask against its rule written out, the
objective against a block-by-block reference, training on a tiny target (it learns, it resumes
exactly, online follows offline), decoding (greedy output identical to the target's, proposals equal
to an independent plain-torch DFlash forward), and export/import for vLLM and SGLang."""

from __future__ import annotations

import json

import _packs
import pytest
import torch
from _dflash_utils import capture, make_dflash, reference_block_logits, target_dist, train_dflash
from _packs import V_D, H, V, make_pack, tiny_draft
from _train_utils import AUX, metric_rows, train_quietly, train_store

from eyas.engines.head import TargetHead
from eyas.eval import evaluate_draft
from eyas.export import ServeOptions, export_draft
from eyas.model.attention import BlockAttention
from eyas.model.checkpoints import import_draft
from eyas.model.config import DraftConfig, DraftOptions
from eyas.model.dflash import DFlashDraft, choose_mask_token
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.families import load_draft
from eyas.train.dflash import BlockConfig, BlockObjective, sample_anchors
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_dflash(block_size: int = 4, layers: int = 2, seed: int = 0) -> tuple[DFlashDraft, TargetHead]:
    """A random DFlash draft (weights larger than the init, so every path shows) and a random target head."""
    return tiny_draft(DFlashDraft, "dflash", layers, seed, head_from_target=True, block_size=block_size)


# -- the block attention mask and the anchors -------------------------------------------------------------


def test_block_mask_is_the_rule_written_out_and_flex_agrees():
    """Slot k of block r sees context position j iff j < a_r in a_r's document, and every slot of its own
    block; flex attention's block mask computes the same attention (forward: flex has no CPU backward)."""
    docs = torch.tensor([0] * 7 + [1] * 9 + [2] * 4)
    anchors, B = torch.tensor([0, 3, 8, 15, 16, 18]), 3
    att = BlockAttention(anchors, docs, B, "math")
    mask, N, Q = att.dense_mask(), docs.numel(), anchors.numel() * B
    assert mask.shape == (Q, N + Q)
    for q in range(Q):
        a = int(anchors[q // B])
        for j in range(N):
            assert bool(mask[q, j]) == (j < a and int(docs[j]) == int(docs[a])), (q, j)
        for j in range(Q):
            assert bool(mask[q, N + j]) == (j // B == q // B), (q, j)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, Q, 8, generator=g), torch.randn(1, 2, N + Q, 8, generator=g), \
        torch.randn(1, 2, N + Q, 8, generator=g)
    flex = BlockAttention(anchors, docs, B, "flex")(q, k, v)
    assert torch.allclose(flex, att(q, k, v), atol=1e-5)


def test_anchors_are_seeded_trained_and_inside_their_document():
    ids, mask, pos, docs, _, _ = make_pack([20, 13, 30], pad=9)
    a1, ok1 = sample_anchors(mask, docs, 16, seed=5)
    a2, ok2 = sample_anchors(mask, docs, 16, seed=5)
    a3, _ = sample_anchors(mask, docs, 16, seed=6)
    assert torch.equal(a1, a2) and torch.equal(ok1, ok2) and not torch.equal(a1, a3)
    assert a1.numel() == 16 and bool(ok1.all()) and torch.equal(a1, a1.sort().values) and a1.unique().numel() == 16
    assert all(mask[a] and mask[a + 1] and docs[a] == docs[a + 1] for a in a1.tolist())
    few = torch.zeros_like(mask)
    few[[3, 4, 40, 41]] = True  # two eligible anchors: 3 and 40
    a, ok = sample_anchors(few, docs, 8, seed=0)
    assert a.numel() == 8 and sorted(a[ok].tolist()) == [3, 40]


# -- the objective ------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_objective(draft, head, pack, anchors, usable, gamma):
    """Every block on its own: its document's context before the anchor, [x_a, MASK...], the plain forward,
    each slot k scored against the target's softmax at a+k-1 (restricted to the draft vocabulary)."""
    ids, mask, pos, docs, aux, final = pack
    B, N = draft.config.block_size, ids.numel()
    tgt = target_dist(draft, head.logits(final), B)
    loss, stats = torch.zeros(()), torch.zeros(B - 1, 3)
    for a in anchors[usable].tolist():
        ctx = torch.nonzero((docs == docs[a]) & (torch.arange(N) < a)).flatten()
        block = torch.tensor([int(ids[a])] + [draft.config.mask_token_id] * (B - 1))
        logits = reference_block_logits(draft, aux[ctx], pos[ctx], block, pos[a] + torch.arange(B))
        for k in range(1, B):
            t = a + k
            if t >= N or not mask[t] or docs[t] != docs[a] or tgt.ids[t - 1] < 0:
                continue
            logq = torch.log_softmax(logits[k], -1)
            ce = -(tgt.probs[t - 1] * logq).sum()
            loss += torch.exp(torch.tensor(-(k - 1) / gamma)) * ce
            stats[k - 1] += torch.stack([ce, (logq.argmax() == tgt.ids[t - 1]).float(), torch.tensor(1.0)])
    return loss, stats


@pytest.mark.parametrize("fused", [True, False])
def test_objective_equals_a_block_by_block_reference(fused):
    """Packed documents and padding: the batched objective (one forward, block mask, fused CE over the
    frozen draft head) gives each valid slot's CE, weight exp(-(k-1)/gamma) and accuracy exactly as the
    blocks run one by one; the gradients reach fc and the layers, never the frozen head or embedding."""
    draft, head = tiny_dflash(block_size=4)
    pack = make_pack([20, 13, 30], pad=9)
    ids, mask, pos, docs, aux, final = pack
    cfg = BlockConfig(block_size=4, gamma=2.0, anchors=12, attention="math", fused_loss=fused, loss_chunk_elems=5 * V_D)
    objective = BlockObjective(draft, cfg)
    loss, stats = objective(ids, aux, pos, mask, docs, target_dist(draft, head.logits(final), 4), seed=3)
    anchors, usable = sample_anchors(mask, docs, 12, seed=3)
    ref_loss, ref_stats = reference_objective(draft, head, pack, anchors, usable, gamma=2.0)
    assert stats[:, 2].tolist() == ref_stats[:, 2].tolist() and stats[0, 2] > 5
    assert stats[:, 1].tolist() == ref_stats[:, 1].tolist()
    assert torch.allclose(stats[:, 0], ref_stats[:, 0], rtol=1e-4)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)
    loss.backward()
    assert draft.fc.weight.grad.abs().sum() > 0 and draft.layers[1].mlp.down_proj.weight.grad.abs().sum() > 0
    assert draft.lm_head.weight.grad is None and draft.embed_tokens.weight.grad is None


def test_fused_and_reference_losses_give_the_same_gradients():
    grads = []
    for fused in (True, False):
        draft, head = tiny_dflash(block_size=5)
        ids, mask, pos, docs, aux, final = make_pack([25, 30], pad=0, seed=2)
        cfg = BlockConfig(block_size=5, anchors=10, attention="math", fused_loss=fused, loss_chunk_elems=7 * V_D)
        loss, _ = BlockObjective(draft, cfg)(ids, aux, pos, mask, docs, target_dist(draft, head.logits(final), 5), 1)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    _packs.check_same_grads(grads)


# -- config, registry, mask token ---------------------------------------------------------------------------


def test_family_in_config_old_drafts_read_as_eagle3(tmp_path):
    eagle = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=V, draft_vocab_size=V_D, target_hidden_size=H, aux_layer_ids=[1, 2, 3])
    assert not {"family", "block_size", "mask_token_id"} & set(eagle.to_dict())  # as before families existed
    eagle.save(tmp_path / "config.json")
    assert DraftConfig.load(tmp_path / "config.json").family == "eagle3"
    draft, _ = tiny_dflash()
    draft.save_pretrained(tmp_path / "d")
    again = load_draft(tmp_path / "d")
    assert isinstance(again, DFlashDraft) and again.config == draft.config
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), again.state_dict().values(), strict=True))
    Eagle3Draft(eagle).save_pretrained(tmp_path / "e")
    assert isinstance(load_draft(tmp_path / "e"), Eagle3Draft)
    with pytest.raises(EyasError, match="EAGLE-3.1"):
        DraftOptions(family="dflash", fc_norm=True)
    with pytest.raises(EyasError, match="block-size"):
        DraftOptions(family="dflash", block_size=1)


def test_mask_token_defaults_to_an_id_never_trained():
    counts = torch.tensor([5, 0, 3, 0, 7, 0, 2])
    assert choose_mask_token(counts, pad_token_id=3) == 3  # the pad token, never produced
    assert choose_mask_token(counts, pad_token_id=4) == 5  # the pad token is produced: the highest unused id
    assert choose_mask_token(counts, pad_token_id=None) == 5
    with pytest.raises(EyasError, match="--mask-token-id"):
        choose_mask_token(torch.ones(4, dtype=torch.long), None)


# -- training through `eyas train --family dflash` ------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return train_store(tmp_path_factory.mktemp("dflash_train"))


def train(out, store=None, **kw):
    return train_quietly(out, store=store, **{**dict(
        family="dflash", block_size=4, mask_token_id=0, draft_vocab_size=48, token_budget=256, num_workers=0,
        report_to="none", log_every=1, save_every=0, lr=3e-3, block_gamma=4.0), **kw})


def test_dflash_training_learns_the_tiny_target(data, tmp_path):
    """200 steps: the loss falls and every block slot's accuracy rises well above where it started."""
    _, _, store = data
    result = train(tmp_path / "run", store, max_steps=200, log_every=20, warmup_ratio=0.05)
    m = metric_rows(tmp_path / "run")
    first, last = m[0], m[-1]
    assert len(last["acc"]) == 3 and last["step"] == 200  # stats rows = block slots 1..3
    assert last["loss"] < 0.8 * first["loss"], (first, last)
    assert last["acc"][0] > max(0.15, 2 * first["acc"][0]) and min(last["acc"]) > first["acc"][0], (first, last)
    draft = load_draft(tmp_path / "run" / "draft")
    assert isinstance(draft, DFlashDraft) and draft.config.block_size == 4 and draft.config.mask_token_id == 0
    assert result["options"]["train"]["block_gamma"] == 4.0 and "ttt_steps" not in result["options"]["train"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dflash_resume_follows_the_same_curve(data, tmp_path, dtype):
    """Stopped after step 4 (last checkpoint at 3) and resumed: the same losses, accuracies, validations and
    weights as a run never stopped (the anchors are the batch's, not the RNG's). bf16 keeps the embedding
    table on the host, as on a GPU: the mask token's row then comes from it."""
    _packs.check_resume_follows_the_same_curve(train, data[2], tmp_path, dtype)


def test_dflash_online_follows_offline_and_options_are_checked(data, tmp_path):
    target, prepared, store = data
    train(tmp_path / "off", store, max_steps=2)
    train(tmp_path / "on", None, prepared=prepared, online=True, model=str(target), aux_layer_ids=AUX,
          target_dtype="float32", max_steps=2)
    for a, b in zip(metric_rows(tmp_path / "off"), metric_rows(tmp_path / "on"), strict=True):
        # stored states are bf16, online ones fp32: a flipped argmax moves a slot in or out of the (small) count
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 3e-2 and abs(a["acc"][0] - b["acc"][0]) < 0.1
    with pytest.raises(EyasError, match="reply-start-weight"):
        train(tmp_path / "x", store, reply_start_weight=2.0)
    with pytest.raises(EyasError, match="mask-token-id"):  # every id of the tiny vocabulary is trained on
        train(tmp_path / "y", store, mask_token_id=-1, max_steps=1)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_dflash_two_processes_match_one(data, tmp_path, mode):
    """torchrun, 2 CPU processes (gloo): the curve of one process accumulating both ranks' batches; the
    anchors are the packs', so every rank draws the ones the single process drew."""
    import os
    import subprocess
    import sys

    _, _, store = data
    args = ["-m", "eyas.cli", "train", "--store", str(store), "--family", "dflash", "--block-size", "4",
            "--mask-token-id", "0", "--max-steps", "3", "--token-budget", "256", "--draft-vocab-size", "48",
            "--num-workers", "0", "--log-every", "1", "--report-to", "none", "--save-every", "0", "--lr", "3e-3",
            "--device", "cpu", "--val-samples", "8", "--dtype", "fp32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EYAS_NO_PROGRESS": "1"}
    runs = {"one": [sys.executable, *args, "--grad-accum", "2", "--out", str(tmp_path / "one")],
            mode: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args,
                   "--out", str(tmp_path / mode)] + (["--fsdp"] if mode == "fsdp" else [])}
    for cmd in runs.values():
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
    one, two = metric_rows(tmp_path / "one"), metric_rows(tmp_path / mode)
    assert len(one) == len(two) == 4 and "val" in two[-1]
    for x, y in zip(one, two, strict=True):
        x, y = x.get("val", x), y.get("val", y)
        assert y["valid_tokens"] == x["valid_tokens"] and y["acc"] == x["acc"]
        assert abs(y["loss"] - x["loss"]) / x["loss"] < 1e-5, (x, y)
    w_one, w_two = load_draft(tmp_path / "one" / "draft"), load_draft(tmp_path / mode / "draft")
    for (k, a), b in zip(w_one.state_dict().items(), w_two.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-4), k


# -- decoding -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama target, its greedy continuations of 6 prompts, and a DFlash draft (blocks of 4, one
    layer; vocab 48 of 64) trained on them."""
    target, aux, prompts, seqs = _packs.tiny_target()
    draft = make_dflash(target, aux, 48, block_size=4, mask_token_id=63, seqs=seqs)
    losses = train_dflash(draft, capture(target, seqs, aux), steps=150)
    return {"target": target, "aux": aux, "prompts": prompts, "draft": draft, "losses": losses}


def test_greedy_block_decoding_is_the_targets_output(tiny):
    """fp32, greedy: chains of 1..3 from one draft forward each; the output is the target's own, tokens
    per verify step well above 1, and trees or chains longer than the block are refused up front."""
    chain3 = _packs.check_one_forward_decoding(tiny, 3)  # tau measured 1.69 (untrained: 1.01)
    assert chain3["tokens_per_target_forward"] > 1.3
    with pytest.raises(EyasError, match="blocks of 4"):
        evaluate_draft(tiny["target"], None, tiny["draft"], tiny["prompts"][:1], chain=[4], max_new_tokens=4,
                       warmup=False, progress=False)


def test_proposals_equal_an_independent_dflash_forward(tiny):
    """Every round's K proposals are the argmax of the plain-torch DFlash forward over the target's states
    (transformers' output_hidden_states) of every position before the anchor, with [anchor, MASK x K]
    at positions L .. L+K: what vLLM's DFlash proposer computes (NOTES, ref_dflash.py)."""
    draft = tiny["draft"]

    def reference(seq, aux, L, anchor):
        block = torch.tensor([anchor] + [draft.config.mask_token_id] * 3)
        return reference_block_logits(draft, aux[:L], torch.arange(L), block, torch.arange(L, L + 4))[1:]

    checked = _packs.check_proposals(tiny, 3, reference)
    assert checked >= 15, checked


# -- export and import ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_dir(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("dflash_target") / "target"
    tiny["target"].save_pretrained(path)
    return path


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_export_then_import_gives_the_same_draft(tmp_path, tiny, target_dir, fmt):
    draft = tiny["draft"]
    if fmt == "sglang":  # SGLang uses the target's head over the whole vocabulary
        with pytest.raises(EyasError, match="whole vocabulary"):
            export_draft(draft, tmp_path / "no", fmt, ServeOptions(verifier=str(target_dir)))
        draft = make_dflash(tiny["target"], tiny["aux"], 64, block_size=4, mask_token_id=63)
    out = export_draft(draft, tmp_path / fmt, fmt, ServeOptions(verifier=str(target_dir), dtype="float32"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [0, 1, 2], "block_size": 4}
    readme = (out / "README.md").read_text()
    assert ('"method": "dflash"' in readme and '"num_speculative_tokens": 3' in readme) if fmt == "vllm" else \
        "--speculative-algorithm DFLASH" in readme and "--speculative-num-draft-tokens 4" in readme
    back = import_draft(out, target=target_dir)
    assert isinstance(back, DFlashDraft) and back.config.to_dict() == {**draft.config.to_dict(),
                                                                       "target": back.config.target}
    for (n, a), b in zip(draft.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    with pytest.raises(EyasError, match="at most 3"):
        export_draft(draft, tmp_path / "k", fmt, ServeOptions(num_speculative_tokens=5))


def test_import_of_a_checkpoint_sharing_the_targets_embedding_and_head(tmp_path, tiny, target_dir):
    """SpecForge's DFlash checkpoints ship neither embed_tokens nor lm_head: the target's are used."""
    from safetensors.torch import load_file, save_file

    draft = make_dflash(tiny["target"], tiny["aux"], 64, block_size=4, mask_token_id=63)
    out = export_draft(draft, tmp_path / "full", "vllm", ServeOptions(dtype="float32"))
    tensors = {k: v for k, v in load_file(str(out / "model.safetensors")).items()
               if k not in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")}
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    del config["eyas"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(EyasError, match="pass --model <target model folder>"):
        import_draft(out)
    back = import_draft(out, target=target_dir)
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), back.state_dict().values(),
                                                     strict=True))


def test_export_all_writes_what_serves_it_and_skips_the_rest(tmp_path, tiny, target_dir):
    """`eyas export --format all` on a trained folder: vLLM's layout, with K = block size - 1 by default;
    SGLang (its head is the target's whole vocabulary) and speculators (no DFlash reader here) are skipped."""
    from eyas.recipes.export import ExportOptions, run_export

    tiny["draft"].save_pretrained(tmp_path / "draft")
    lines: list[str] = []
    written = run_export(ExportOptions(draft=tmp_path / "draft", format="all", out=tmp_path / "out",
                                       verifier=str(target_dir)), log=lines.append)
    assert written == [tmp_path / "out" / "vllm"]
    assert '"num_speculative_tokens": 3' in (tmp_path / "out" / "vllm" / "README.md").read_text()
    assert sum("skipped" in line for line in lines) == 2, lines
