"""Batched greedy decoding over static caches (eyas.eval.batch_decode): token for token the target's own output
for every family and method at every batch size, each row accepting its own count, finished rows refilled;
and `eyas eval --batch-size` measuring each batch size side by side."""

from __future__ import annotations

import json

import pytest
import torch
from _dflash_utils import capture as capture_dist
from _dflash_utils import make_dflash, train_dflash
from _eval_utils import capture, make_draft, speculate, target_and_continuations, target_generate, train_draft
from _peagle_utils import make_peagle, train_peagle

from eyas.eval import BASELINE, ChainSpec, HFTarget, TreeSpec, evaluate_draft

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    """The tiny target, prompts of many lengths, its greedy answers (stopping at a token that ends some), and a
    draft of each family trained on its continuations."""
    target, aux, prompts, seqs = target_and_continuations()
    dists = capture_dist(target, seqs, aux)
    eagle3 = make_draft(target, aux, 48, seqs)
    train_draft(eagle3, capture(target, seqs, aux), steps=80)
    dflash = make_dflash(target, aux, 48, block_size=5, mask_token_id=63, seqs=seqs)
    train_dflash(dflash, dists, steps=60)
    peagle = make_peagle(target, aux, 48, mask_token_id=63, seqs=seqs)
    train_peagle(peagle, dists, steps=60)
    g = torch.Generator().manual_seed(3)
    prompts = prompts[:4] + [torch.randint(0, 64, (n,), generator=g).tolist() for n in (1, 3, 17)]
    wrapped = HFTarget(target, aux)
    full = [target_generate(wrapped, p, 24).tokens for p in prompts]
    # the stop token: one that ends some answers early, at different lengths, and not others
    stop = max(range(64), key=lambda t: len({a.index(t) if t in a else 24 for a in full}))
    answers = [target_generate(wrapped, p, 24, stop_ids={stop}).tokens for p in prompts]
    return {"target": target, "wrapped": wrapped, "prompts": prompts, "answers": answers, "stop": stop,
            "eagle3": eagle3.eval(), "dflash": dflash.eval(), "peagle": peagle.eval()}


def _decode(tiny, family, method, batch):
    return speculate(tiny["wrapped"], tiny[family] if family else None, tiny["prompts"], method, 24, batch,
                     [tiny["stop"]])


@pytest.mark.parametrize("family,method", [
    (None, None), ("eagle3", ChainSpec(1)), ("eagle3", ChainSpec(4)), ("eagle3", TreeSpec(12, 4, 3)),
    ("eagle3", TreeSpec(4, 3, 2)), ("dflash", ChainSpec(4)), ("peagle", ChainSpec(3))])
def test_batched_output_is_the_targets_at_every_batch_size(tiny, family, method):
    for batch in (1, 2, 3):
        gens = _decode(tiny, family, method, batch)
        assert [g.tokens for g in gens] == tiny["answers"], (family, method, batch)
        if method is None:
            assert all(g.target_forwards == g.new_tokens for g in gens)
            continue
        steps = [a for g in gens for a in g.accepted]
        assert max(steps) <= method.max_accept
        assert sum(steps) / len(steps) > 0.2, steps  # trained drafts: draft tokens are accepted, rows differ
        assert all(g.target_forwards == 1 + len(g.accepted) for g in gens)


def test_rows_accept_their_own_counts_and_finished_rows_take_the_next_prompt(tiny):
    """Three rows for seven prompts of different lengths and answers: each row stops at its own stop token,
    is refilled, and the per-row accepted counts are those of the same prompt decoded alone."""
    alone = _decode(tiny, "eagle3", ChainSpec(4), 1)
    batched = _decode(tiny, "eagle3", ChainSpec(4), 3)
    assert [g.accepted for g in batched] == [g.accepted for g in alone]
    assert len({len(g.tokens) for g in batched}) > 1  # answers of different lengths shared the rows


def test_eval_at_several_batch_sizes_reports_the_serving_table(tiny):
    res = evaluate_draft(tiny["target"], None, tiny["eagle3"], tiny["prompts"], chain=[3], tree=["8:3:3"],
                         max_new_tokens=16, batch_sizes=[1, 2], progress=False, stop_ids={tiny["stop"]})
    assert res.table()["all"]["chain-3"]["identical_to_target"] == 1.0
    assert res.table()["all"]["tree-8:3:3"]["identical_to_target"] == 1.0
    rows = {(r["batch_size"], r["method"]): r for r in res.serving}
    assert set(rows) == {(b, m) for b in (1, 2) for m in (BASELINE, "chain-3", "tree-8:3:3")}
    assert all(r["identical"] == 1.0 for (_, m), r in rows.items() if m != BASELINE)
    assert rows[(2, "chain-3")]["tokens_per_forward"] > 1.2 and rows[(1, BASELINE)]["tokens_per_forward"] == 1.0
    # timed in rounds (7 prompts: 4 at batch 1, 3 at batch 2), each method against the target alone round by round
    assert [rows[(b, "chain-3")]["rounds"] for b in (1, 2)] == [4, 3]
    for (_, m), r in rows.items():
        if m != BASELINE and r["speedup"] is not None:
            low, high = r["speedup_range"]
            assert low <= r["speedup"] <= high and r["speedup"] <= r["tokens_per_forward"], r
        elif m != BASELINE:
            assert "too noisy" not in r["speedup_note"] and "tokens per target forward" in r["speedup_note"] or \
                "target alone ran between" in r["speedup_note"], r
    assert len(res.records) == 7 * 3  # records (and the per-method metrics) are the first batch size's
    assert json.loads(json.dumps(res.to_dict()))["serving"] == res.serving


def test_cli_eval_batch_size_two_random_draft_float32_is_the_targets(smollm2_dir, tmp_path):
    """`eyas eval --batch-size 2` on a random draft, float32 on the CPU: the output is the target's."""
    from eyas.recipes.evaluate import EvalOptions, run_eval

    out = run_eval(EvalOptions(draft="random", model=str(smollm2_dir), prompts="mtbench", max_prompts=2, max_turns=1,
                               chain="2", tree="6:2:3", max_new_tokens=8, dtype="float32", device="cpu",
                               batch_sizes=[2], out=tmp_path / "ev"), log=lambda *_: None)
    data = json.loads((out / "report.json").read_text())
    for m in ("chain-2", "tree-6:2:3"):
        assert data["results"]["all"][m]["identical_to_target"] == 1.0
    assert {r["batch_size"] for r in data["serving"]} == {2}


@pytest.mark.parametrize("method", [ChainSpec(4), TreeSpec(12, 4, 3)])
def test_a_windowed_draft_decodes_batched_as_it_does_alone(tiny, method):
    """--draft-window: the batched decoder's masks apply the draft's sliding window the same way at every batch
    size (the same accepted counts, row by row, at batch 1 and 3; the output the target's), and the window
    binds (without it the draft is accepted otherwise)."""
    draft = tiny["eagle3"]
    try:
        counts = {}
        for window in (3, 0):
            draft.config.sliding_window = window
            for batch in (1, 3):
                gens = _decode(tiny, "eagle3", method, batch)
                assert [g.tokens for g in gens] == tiny["answers"], (window, batch)
                assert [g.accepted for g in gens] == counts.setdefault(window, [g.accepted for g in gens])
        assert counts[3] != counts[0]
    finally:
        draft.config.sliding_window = 0
