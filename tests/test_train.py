"""The trainer end to end on CPU: packing plans, offline (store) == online (target in the loop),
a tiny draft learning a tiny target, exact resume, and the CLI writing a loadable draft."""

from __future__ import annotations

import collections
import json
import re

import numpy as np
import pytest
import torch
from _train_utils import AUX, first_reply_openings, metric_rows, run_tiny_train, train_store

from eyas.engines.hf import HFEngine
from eyas.model.checkpoints import import_draft
from eyas.model.config import DraftConfig
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.vocab import build_draft_vocab
from eyas.store import HiddenStore
from eyas.train.config import TrainConfig
from eyas.train.data import PackDataset, PackSchedule, SampleSource, collate_pack, fill_states, pack_epoch
from eyas.train.distributed import DistInfo
from eyas.train.trainer import Trainer
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return train_store(tmp_path_factory.mktemp("train"))


def test_plan_packs_every_sample_once_and_splits_ranks():
    lengths = np.random.default_rng(0).integers(1, 300, 500)
    packs = pack_epoch(lengths, 512, seed=3, epoch=0)
    flat = np.concatenate(packs)
    assert sorted(flat.tolist()) == list(range(500))
    assert all(np.minimum(lengths[p], 512).sum() <= 512 for p in packs)
    fill = lengths.sum() / (len(packs) * 512)
    assert fill > 0.95, f"packs only {fill:.1%} full"
    assert [p.tolist() for p in pack_epoch(lengths, 512, 3, 0)] == [p.tolist() for p in packs]
    assert [p.tolist() for p in pack_epoch(lengths, 512, 3, 1)] != [p.tolist() for p in packs]
    # two ranks x 2 accumulation read exactly the packs one rank x 4 accumulation reads, step by step
    one = PackSchedule(lengths, 512, 3, world=1, grad_accum=4).rank_packs(0, 0)
    r0, r1 = (PackSchedule(lengths, 512, 3, world=2, grad_accum=2).rank_packs(0, r) for r in (0, 1))
    for s in range(len(one) // 4):
        assert [p.tolist() for p in one[4 * s:4 * s + 4]] == [
            p.tolist() for p in r0[2 * s:2 * s + 2] + r1[2 * s:2 * s + 2]]


def test_collate_pack_layout():
    s = [{"input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.bool), "aux_hidden": torch.ones(5, 6),
          "final_hidden": torch.ones(5, 2)},
         {"input_ids": torch.arange(10, 13), "loss_mask": torch.zeros(3, dtype=torch.bool),
          "aux_hidden": 2 * torch.ones(3, 6), "final_hidden": torch.ones(3, 2)}]
    b = collate_pack(s, budget=10, pad_to=10, states=True)
    assert b["input_ids"].tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 0, 0]
    assert b["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert b["document_ids"].tolist() == [0] * 5 + [1] * 3 + [2] * 2
    assert b["loss_mask"].tolist() == [True] * 5 + [False] * 5 and b["multi_doc"] and b["num_tokens"] == 8
    assert b["aux_hidden"][5:8].eq(2).all() and b["aux_hidden"][8:].eq(0).all()
    one = collate_pack(s[:1], budget=4, pad_to=None, states=False)  # cut to the budget
    assert one["input_ids"].tolist() == [0, 1, 2, 3] and not one["multi_doc"] and one["truncated"] == 1


def test_offline_and_online_give_the_same_loss(data):
    target, prepared, store = data
    st = HiddenStore(store)
    from transformers import AutoConfig

    dcfg = DraftConfig.from_target_config(AutoConfig.from_pretrained(target), AUX, 48)
    torch.manual_seed(0)
    draft = Eagle3Draft(dcfg)
    head = st.target_head()
    draft.load_target_embedding(head.embed_tokens)
    draft.set_vocab(*build_draft_vocab(torch.arange(64), 48))
    trainer = Trainer(TrainConfig(ttt_steps=3), draft, head, DistInfo(), 10)
    packs = PackSchedule(st.lengths, 256, 0, 1, 1).packs(0)[:2]
    engine = HFEngine(str(target), aux_layer_ids=AUX, dtype="float32", device="cpu")
    for k in range(2):
        off = PackDataset(SampleSource(store, "store"), packs, 256, None, states=True)[k]
        on = fill_states(PackDataset(SampleSource(prepared, "prepared"), packs, 256, None, states=False)[k], engine)
        assert off["multi_doc"] and torch.equal(off["input_ids"], on["input_ids"])
        with torch.no_grad():
            l_off, s_off = trainer.forward_batch(off)
            l_on, s_on = trainer.forward_batch(on)  # fp32 states straight from the target
            rounded = {**on, "aux_hidden": on["aux_hidden"].bfloat16(), "final_hidden": on["final_hidden"].bfloat16()}
            l_rnd, s_rnd = trainer.forward_batch(rounded)  # the same states as the store keeps them
        assert abs(l_on - l_off) / l_off < 1e-2 and (s_on[:, 2] - s_off[:, 2]).abs().max() <= 2
        assert abs(l_rnd - l_off) / l_off < 1e-5 and torch.equal(s_rnd[:, 2], s_off[:, 2])
    # the frozen embedding kept on the host (the GPU default): rows looked up by the data pipeline
    draft2 = Eagle3Draft(dcfg)
    draft2.load_state_dict(trainer.draft_state())
    off_host = Trainer(TrainConfig(ttt_steps=3, offload_embedding=True), draft2, head, DistInfo(), 10)
    assert off_host.draft.embed_tokens is None and off_host.embed_table.shape == (64, 32)
    batch = PackDataset(SampleSource(store, "store"), packs, 256, None, True, off_host.embed_table)[0]
    with torch.no_grad():
        l_ref, _ = trainer.forward_batch({k: v for k, v in batch.items() if k != "input_embeds"})
        l_host, _ = off_host.forward_batch(batch)
    assert abs(l_host - l_ref) / l_ref < 1e-6
    assert torch.equal(off_host.draft_state()["embed_tokens.weight"], head.embed_tokens.float())


def test_held_out_opening_is_the_figure_of_first_replies_starts(data):
    """Trainer.evaluate's "opening": the plain evaluation of the same packs with the loss mask cut, by a
    plain loop, to each document's first reply's first tokens; the overall figure stays as it was."""
    target, _, store = data
    st = HiddenStore(store)
    from transformers import AutoConfig

    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target_config(AutoConfig.from_pretrained(target), AUX, 48))
    head = st.target_head()
    draft.load_target_embedding(head.embed_tokens)
    draft.set_vocab(*build_draft_vocab(torch.arange(64), 48))
    trainer = Trainer(TrainConfig(ttt_steps=3), draft, head, DistInfo(), 10)
    packs = PackSchedule(st.lengths, 256, 0, 1, 1).packs(0)[:3]
    ds = PackDataset(SampleSource(store, "store"), packs, 256, None, states=True)
    batches = [ds[k] for k in range(3)]
    first = batches[0]["document_ids"] == batches[0]["document_ids"][0]
    batches[0]["loss_mask"][first.nonzero()[-4]] = False  # its first document now has two replies
    m = trainer.evaluate(batches, opening_tokens=6)
    cut = [{**b, "loss_mask": torch.tensor(first_reply_openings(b["loss_mask"].tolist(),
                                                                b["document_ids"].tolist(), 6))}
           for b in batches]
    ref = trainer.evaluate(cut, opening_tokens=0)
    assert "opening" not in ref and m["opening"]["valid_tokens"] == ref["valid_tokens"] > 0
    assert m["opening"]["acc"] == pytest.approx(ref["acc"], abs=1e-6)
    assert m["opening"]["tau_sim"] == pytest.approx(ref["tau_sim"], abs=1e-6)
    assert ref["valid_tokens"] < m["valid_tokens"] / 2  # the starts only
    assert m["acc"] == trainer.evaluate(batches, opening_tokens=0)["acc"]


def test_tiny_draft_learns_tiny_target(data, tmp_path):
    """300 steps (~10 s): step-0 accuracy far above chance (1/48) and the majority-token baseline."""
    _, _, store = data
    st = HiddenStore(store)
    head = st.target_head()
    counts = collections.Counter()
    for i in range(len(st)):
        s = st[i]
        counts.update(head.logits(s["final_hidden"].float())[s["loss_mask"]].argmax(-1).tolist())
    majority = max(counts.values()) / sum(counts.values())
    run_tiny_train(tmp_path / "run", store, max_steps=300, log_every=50, warmup_ratio=0.05)
    m = metric_rows(tmp_path / "run")
    first, last = m[0], m[-1]
    assert last["step"] == 300 and last["loss"] < 0.75 * first["loss"]
    assert last["acc"][0] > max(3 * majority, 10 / 48), (last["acc"], majority)
    assert min(last["acc"]) > 0.2 and last["tau_sim"] > 1.35
    draft = Eagle3Draft.from_pretrained(tmp_path / "run" / "draft")
    assert draft.config.draft_vocab_size == 48 and int(draft.t2d.sum()) == 48


def test_held_out_samples_are_never_trained_on_and_measure_the_draft(data, tmp_path):
    """--val-samples: a seeded set of samples stays out of every epoch's packs; the draft is measured on
    it every --val-every steps and at the end (metrics.jsonl, the manifest); the figure depends only on
    the weights and those samples, and falls as the draft learns the target."""
    from eyas.train.data import hold_out

    _, _, store = data
    lengths = HiddenStore(store).lengths
    train_ids, val_ids = hold_out(len(lengths), 20, seed=0)
    assert len(val_ids) == 20 and np.array_equal(np.union1d(train_ids, val_ids), np.arange(len(lengths)))
    assert np.array_equal(hold_out(len(lengths), 20, seed=0)[1], val_ids)  # seeded: a resume holds out the same
    plan = PackSchedule.over(lengths, train_ids, budget=256, seed=0, world=1, grad_accum=1)
    for epoch in range(3):
        used = np.concatenate(plan.packs(epoch))
        assert np.array_equal(np.sort(used), train_ids)
    with pytest.raises(EyasError, match="--val-samples 160"):
        hold_out(len(lengths), 160, seed=0)

    # the trainer reads exactly the kept samples: one epoch trains on their tokens and no others
    epoch = run_tiny_train(tmp_path / "epoch", store, epochs=1, val_samples=20, log_every=10)
    assert epoch["tokens"] == int(np.asarray(lengths)[train_ids].sum()) < int(np.sum(lengths))

    res = run_tiny_train(tmp_path / "run", store, max_steps=150, val_samples=20, val_every=50, log_every=10)
    vals = [m for m in metric_rows(tmp_path / "run") if "val" in m]
    assert [m["step"] for m in vals] == [50, 100, 150] and res["final"]["val"] == vals[-1]["val"]
    losses, acc0 = [v["val"]["loss"] for v in vals], [v["val"]["acc"][0] for v in vals]
    assert losses == sorted(losses, reverse=True) and acc0[-1] > 1.2 * acc0[0] and vals[-1]["val"]["valid_tokens"] > 0
    opening = vals[-1]["val"]["opening"]  # these replies are under 64 tokens long: their openings are all of them
    assert (opening["valid_tokens"], opening["acc"]) == (vals[-1]["val"]["valid_tokens"], vals[-1]["val"]["acc"])
    # the same weights (lr 0) on the same held-out samples: the same figure
    again = run_tiny_train(tmp_path / "again", store, max_steps=1, lr=0.0, val_samples=20,
                           init_draft=tmp_path / "run" / "draft")
    assert again["final"]["val"]["loss"] == pytest.approx(res["final"]["val"]["loss"], rel=1e-5)

    # OUT/draft-best keeps the weights of the best validation (held-out tau_sim, then loss): here a learning
    # rate far too high wrecks the trained draft step after step, so the best is not simply the last
    wreck = run_tiny_train(tmp_path / "wreck", store, max_steps=4, lr=0.3, val_samples=20, val_every=1,
                  init_draft=tmp_path / "run" / "draft")
    vals = {m["step"]: m["val"] for m in metric_rows(tmp_path / "wreck") if "val" in m}
    best = max(vals, key=lambda k: (vals[k]["tau_sim"], -vals[k]["loss"]))
    assert wreck["best"]["step"] == best and wreck["best"]["draft"] == "draft-best"
    check = run_tiny_train(tmp_path / "check", store, max_steps=1, lr=0.0, val_samples=20,
                  init_draft=tmp_path / "wreck" / "draft-best")
    assert check["final"]["val"]["loss"] == pytest.approx(vals[best]["loss"], rel=1e-5)


def test_hard_labels_change_the_loss_only_and_the_draft_learns(data, tmp_path):
    """--label-temperature 0: the same first step as the default except for the loss (accuracy is
    agreement with the target's argmax either way); the draft learns the argmax on one-hot labels;
    a checkpoint of the other labels is not resumed, and a negative temperature is refused."""
    _, _, store = data
    soft = run_tiny_train(tmp_path / "soft", store, max_steps=2, save_every=2)
    run_tiny_train(tmp_path / "hard", store, max_steps=300, log_every=50, warmup_ratio=0.05, label_temperature=0)
    one = run_tiny_train(tmp_path / "hard1", store, max_steps=2, save_every=2, label_temperature=0)
    assert one["options_sha256"] != soft["options_sha256"]
    ms, mh = metric_rows(tmp_path / "soft"), metric_rows(tmp_path / "hard1")
    assert ms[0]["acc"] == mh[0]["acc"] and ms[0]["loss"] != mh[0]["loss"]
    first, last = metric_rows(tmp_path / "hard")[0], metric_rows(tmp_path / "hard")[-1]
    assert last["step"] == 300 and last["loss"] < 0.75 * first["loss"], (first, last)
    assert min(last["acc"]) > 0.2 and last["tau_sim"] > 1.35, last  # chance is 1/48
    with pytest.raises(EyasError, match="other data or options"):
        run_tiny_train(tmp_path / "hard1", store, max_steps=2, save_every=2, resume=True)
    with pytest.raises(EyasError, match="--label-temperature must be >= 0"):
        run_tiny_train(tmp_path / "neg", store, label_temperature=-1)


def test_reply_start_weight_changes_the_updates_not_the_metrics(data, tmp_path):
    """--reply-start-weight: the first step logs what the default's does (statistics are unweighted
    cross-entropy and accuracy), the second does not (the first update differed); the two runs do
    not resume each other's checkpoints, and weights <= 0 are refused."""
    _, _, store = data
    plain = run_tiny_train(tmp_path / "plain", store, max_steps=2, save_every=2)
    early = run_tiny_train(tmp_path / "early", store, max_steps=2, save_every=2, reply_start_weight=4.0,
                           reply_start_tokens=8)
    assert early["options_sha256"] != plain["options_sha256"]
    mp, me = metric_rows(tmp_path / "plain"), metric_rows(tmp_path / "early")
    assert (mp[0]["loss"], mp[0]["acc"]) == (me[0]["loss"], me[0]["acc"])
    assert mp[1]["loss"] != me[1]["loss"]
    with pytest.raises(EyasError, match="other data or options"):
        run_tiny_train(tmp_path / "early", store, max_steps=2, save_every=2, resume=True)
    with pytest.raises(EyasError, match="--reply-start-weight must be > 0"):
        run_tiny_train(tmp_path / "zero", store, reply_start_weight=0.0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_follows_the_same_loss_curve(data, tmp_path, dtype):
    """A run stopped after step 5 (last checkpoint at 4) and resumed logs exactly the losses of a
    run that was never stopped, and ends with the same weights. bf16 runs the master-weight path
    with the embedding table on the host, as on a GPU."""
    _, _, store = data
    kw = dict(max_steps=9, save_every=4, dtype=dtype, num_workers=1, grad_accum=2,
              offload_embedding=dtype == "bf16")  # the GPU defaults: bf16 master weights, table on the host
    run_tiny_train(tmp_path / "full", store, **kw)
    stopped = run_tiny_train(tmp_path / "cut", store, stop_after=5, **kw)
    assert stopped["stopped_at"] == 5 and len(metric_rows(tmp_path / "cut")) == 5
    run_tiny_train(tmp_path / "cut", store, resume=True, **kw)
    full, cut = metric_rows(tmp_path / "full"), metric_rows(tmp_path / "cut")
    assert [m["step"] for m in cut] == list(range(1, 10))
    for a, b in zip(full, cut, strict=True):
        assert a["loss"] == b["loss"] and a["acc"] == b["acc"] and a["lr"] == b["lr"], (a["step"], a, b)
    w_full = Eagle3Draft.from_pretrained(tmp_path / "full" / "draft").state_dict()
    w_cut = Eagle3Draft.from_pretrained(tmp_path / "cut" / "draft").state_dict()
    assert all(torch.equal(w_full[k], w_cut[k]) for k in w_full)
    assert full[0]["loss"] != full[-1]["loss"]


def test_max_time_stops_with_a_draft_and_resume_finishes_the_same_curve(data, tmp_path):
    """--max-time: the run stops at a log step past the budget, writes a usable draft and a checkpoint
    but is not 'up to date'; --resume continues it to the uninterrupted run's losses and weights."""
    _, _, store = data
    kw = dict(max_steps=6, save_every=0, num_workers=1, log_every=2)
    run_tiny_train(tmp_path / "full", store, **kw)
    cut = run_tiny_train(tmp_path / "cut", store, max_time=1e-9, **kw)  # past the budget at the first log step
    assert not cut["complete"] and cut["steps"] == 2 and cut["total_steps"] == 6
    assert Eagle3Draft.from_pretrained(tmp_path / "cut" / "draft").config.draft_vocab_size == 48
    ckpt = tmp_path / "cut" / "train_state" / "step-00000002"
    # a checkpoint is a draft folder too (eval, export): the same weights as the draft written at that step
    w_ckpt = import_draft(ckpt).state_dict()
    w_draft = Eagle3Draft.from_pretrained(tmp_path / "cut" / "draft").state_dict()
    assert w_ckpt.keys() == w_draft.keys() and all(torch.equal(w_ckpt[k], w_draft[k]) for k in w_draft)
    done = run_tiny_train(tmp_path / "cut", store, resume=True, **kw)
    assert done["complete"] and done["steps"] == 6
    full, resumed = metric_rows(tmp_path / "full"), metric_rows(tmp_path / "cut")
    assert [m["loss"] for m in full] == [m["loss"] for m in resumed] and len(full) == 3
    w_full = Eagle3Draft.from_pretrained(tmp_path / "full" / "draft").state_dict()
    w_cut = Eagle3Draft.from_pretrained(tmp_path / "cut" / "draft").state_dict()
    assert all(torch.equal(w_full[k], w_cut[k]) for k in w_full)
    with pytest.raises(EyasError, match="--max-time must be >= 0"):
        run_tiny_train(tmp_path / "neg", store, max_time=-5, **kw)
    assert not (tmp_path / "neg").exists()


def test_cli_trains_writes_a_loadable_draft_and_reuses_it(data, tmp_path):
    from typer.testing import CliRunner

    from eyas.cli import app
    from eyas.data.prepared import PreparedDataset

    _, prepared, store = data
    out = tmp_path / "cli"
    args = ["train", "--store", str(store), "--out", str(out), "--max-steps", "3", "--ttt-steps", "2",
            "--token-budget", "256", "--draft-vocab-size", "40", "--num-workers", "0", "--log-every", "1",
            "--report-to", "none", "--save-every", "2"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    draft = Eagle3Draft.from_pretrained(out / "draft")
    d2t, t2d = build_draft_vocab(PreparedDataset(prepared).token_counts(), 40)
    assert torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
    rows = metric_rows(out)
    assert [m["step"] for m in rows] == [1, 2, 3] and len(rows[0]["acc"]) == 2
    assert {"loss", "step_loss", "acc", "tau_sim", "tok_per_s", "lr", "grad_norm"} <= set(rows[0])
    assert sorted(p.name for p in (out / "train_state").iterdir()) == ["step-00000002", "step-00000003"]
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "up to date" in again.output
    bad = CliRunner().invoke(app, ["train", "--prepared", str(prepared), "--out", str(out)])
    assert bad.exit_code != 0 and "--online" in str(bad.exception or bad.output)
    bad = CliRunner().invoke(app, [*args, "--cuda-graph", "maybe"])  # a switch: --cuda-graph / --no-cuda-graph
    assert bad.exit_code == 2 and "maybe" in bad.output


def test_the_first_steps_start_up_is_reported_and_kept_out_of_the_rate(data, tmp_path, monkeypatch):
    """The first step of a run also loads the first batches and, where the draft is compiled, compiles it
    (minutes on a GPU): a line says what happened on this device, and tok/s and the ETA count from the step
    after it."""
    import eyas.train.loop as loop_module
    from eyas.recipes.train import TrainOptions, run_train

    _, _, store = data
    monkeypatch.setattr(loop_module, "START_UP_NOTE_S", 0.0)
    lines: list[str] = []
    run_train(TrainOptions(out=tmp_path / "run", store=store, draft_vocab_size=48, ttt_steps=2, token_budget=256,
                           num_workers=0, report_to="none", log_every=1, save_every=0, max_steps=3), log=lines.append)
    (start,) = [line for line in lines if "first step done after" in line]
    total, first_batch, first_step = (float(x) for x in re.search(
        r"after (\d+)s of start-up \(first batch ([\d.]+)s, first step ([\d.]+)s\)", start).groups())
    assert abs(first_batch + first_step - total) <= 1.0, start  # the parts add up to the whole
    assert "compile" not in start and "CUDA" not in start, start  # a CPU run neither compiles nor captures graphs
    rows = metric_rows(tmp_path / "run")
    assert [m["step"] for m in rows] == [1, 2, 3] and all(m["tok_per_s"] > 0 for m in rows)


def test_online_training_follows_the_offline_curve(data, tmp_path):
    """--online: the target runs in the loop on the prepared data; no states on disk."""
    target, prepared, store = data
    from eyas.recipes.train import TrainOptions, run_train

    kw = dict(draft_vocab_size=48, ttt_steps=3, token_budget=256, num_workers=1, report_to="none", log_every=1,
              save_every=0, lr=3e-3, max_steps=3)
    off_run = run_train(TrainOptions(out=tmp_path / "off", store=store, val_samples=12, **kw), log=lambda m: None)
    on_run = run_train(TrainOptions(out=tmp_path / "on", prepared=prepared, online=True, model=str(target),
                                    aux_layer_ids=AUX, target_dtype="float32", val_samples=12, **kw),
                       log=lambda m: None)
    off, on = metric_rows(tmp_path / "off"), metric_rows(tmp_path / "on")
    assert [m["step"] for m in on] == [1, 2, 3, 3] and "val" in on[-1]  # the held-out samples, measured at the end
    for a, b in zip(off, on, strict=True):  # stored states are bf16, online ones fp32: close, not equal
        a, b = a.get("val", a), b.get("val", b)
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-2
    n_off, n_on = off_run["final"]["val"]["valid_tokens"], on_run["final"]["val"]["valid_tokens"]
    assert n_off > 0 and abs(n_off - n_on) <= 0.02 * n_off  # validity follows the target's argmax: bf16 vs fp32
    assert not any((tmp_path / "on").rglob("shard-*.safetensors"))


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_scale_and_clip_matches_torch_clipping_of_scaled_gradients(max_norm):
    from eyas.train.strategy import scale_and_clip_

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 7)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, ref, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    scale = torch.tensor(0.37)
    torch._foreach_mul_([q.grad for q in ref], scale)
    expect = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=True)
    norm = scale_and_clip_(ours, scale, max_norm)
    assert torch.allclose(norm, expect, rtol=1e-6)
    for p, q in zip(ours, ref, strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    assert (norm > max_norm) == (max_norm == 0.5)  # one case clips, the other does not


def test_cuda_graph_asked_where_it_cannot_run_says_so_and_trains(data, tmp_path):
    _, _, store = data
    with pytest.warns(UserWarning, match="training without CUDA graphs"):
        res = run_tiny_train(tmp_path / "g", store, max_steps=2, cuda_graph=True)
    assert res["complete"] and res["steps"] == 2


_COMPILED_RUN = """
import json, sys, torch
from torch._dynamo.utils import counters
from eyas.recipes.train import TrainOptions, run_train
lines = []
res = run_train(TrainOptions(out=sys.argv[1], store=sys.argv[2], resume=sys.argv[4] == "resume", compile=True,
                             compile_in_background=False,
                             draft_vocab_size=48, ttt_steps=2, token_budget=256, num_workers=0, report_to="none",
                             log_every=1, save_every=0, max_steps=int(sys.argv[5]), max_time=float(sys.argv[3])),
                log=lines.append)
print(json.dumps({"steps": res["steps"], "lines": lines, "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def test_compile_cache_travels_with_the_checkpoint(data, tmp_path):
    """A compiled run leaves torch.compile's artifacts in OUT/train_state; a resume in a fresh process with
    an empty local compile cache (another machine) then finds every graph there instead of compiling it, and
    so does the same command run again from scratch into the same folder."""
    import subprocess
    import sys

    from eyas.train.compile_cache import CACHE_FILE

    _, _, store = data
    out = tmp_path / "run"

    def run(cache_dir: str, max_time: float, resume: str = "resume", steps: int = 3) -> dict:
        env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache_dir),
               "OMP_NUM_THREADS": "1"}
        args = [str(out), str(store), str(max_time), resume, str(steps)]
        r = subprocess.run([sys.executable, "-c", _COMPILED_RUN, *args], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = run("machine-a", 1e-9)  # cut by --max-time after its first step, as a preempted job
    assert first["steps"] == 1 and first["miss"] > 0 and first["hit"] == 0
    blob = out / "train_state" / CACHE_FILE
    assert blob.stat().st_size > 0
    second = run("machine-b", 0)  # fresh local cache: only the blob can supply the graphs
    assert second["steps"] == 3 and any("compile cache:" in line for line in second["lines"]), second["lines"]
    assert second["hit"] >= first["miss"] and second["miss"] == 0, second
    # the command run again with other options (one more step): trained from scratch, nothing compiled
    again = run("machine-c", 0, resume="from-scratch", steps=4)
    assert again["steps"] == 4 and any("compile cache:" in line for line in again["lines"]), again["lines"]
    assert again["hit"] >= first["miss"] and again["miss"] == 0, again
