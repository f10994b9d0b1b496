"""eyas eval: speculative decoding (chain and EAGLE-2 tree) is exact, its caches and tree masks are
right, the metrics follow the EAGLE definitions, and the report says what they mean."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from _eval_utils import (
    capture,
    hf_greedy,
    make_draft,
    speculate,
    target_and_continuations,
    tiny_target,
    train_draft,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from eyas.eval import (
    BASELINE,
    ChainSpec,
    HFTarget,
    MethodStats,
    TreeSpec,
    evaluate_draft,
    greedy_acceptance,
)
from eyas.eval.metrics import Generation
from eyas.eval.prompts import render_prompt
from eyas.eval.proposer_base import Pending
from eyas.eval.proposers import make_proposer
from eyas.eval.report import load_report, markdown_summary, write_report
from eyas.eval.serving import ServingRun, best_speedups, runs_of, serving_rows
from eyas.model.attention import StaticKVCache, TTTAttention
from eyas.train.ttt import shift_left
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    """A tiny target, 12 prompts with its greedy continuations, and drafts trained on them (vocab 48 of
    64): one decoder layer (EAGLE-3's), two, and EAGLE-3.1's (fc_norm, norm_output)."""
    target, aux, prompts, seqs = target_and_continuations()
    trained = make_draft(target, aux, 48, seqs)
    train_draft(trained, capture(target, seqs, aux), steps=120)
    two_layers = make_draft(target, aux, 48, seqs, layers=2)
    train_draft(two_layers, capture(target, seqs, aux), steps=120)
    eagle31 = make_draft(target, aux, 48, seqs, eagle31=True)
    train_draft(eagle31, capture(target, seqs, aux), steps=120)
    untrained = make_draft(target, aux, 48, seqs, seed=1)
    return {"target": target, "aux": aux, "prompts": prompts, "trained": trained, "two_layers": two_layers,
            "eagle31": eagle31, "untrained": untrained}


# -- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["trained", "two_layers", "eagle31"])
def test_tiny_trained_draft_accepts_often_and_output_is_the_targets(tiny, which):
    prompts = tiny["prompts"][:4]
    res = evaluate_draft(tiny["target"], None, tiny[which], prompts, chain=[2, 4], tree=["12:4:3"],
                         max_new_tokens=32, progress=False)
    table = res.table()["all"]
    assert table["chain-4"]["identical_to_target"] == 1.0 and table["tree-12:4:3"]["identical_to_target"] == 1.0
    assert table["chain-2"]["identical_to_target"] == 1.0
    assert table["chain-4"]["tau"] > 2.5 and table["tree-12:4:3"]["tau"] > 2.5, table
    assert table["chain-2"]["tau"] <= 3.0  # at most K + 1
    # fewer target forwards than tokens: the point of it all
    assert table["chain-4"]["tokens_per_target_forward"] > 2.0
    # independent reference: transformers' own greedy generate
    wrapped = HFTarget(tiny["target"], tiny["aux"])
    refs = [hf_greedy(tiny["target"], p, 32) for p in prompts[:2]]
    for method in (ChainSpec(4), TreeSpec(12, 4, 3)):
        assert [g.tokens for g in speculate(wrapped, tiny[which], prompts[:2], method, 32, rows=2)] == refs
    wrapped.close()


def test_untrained_draft_is_still_exact(tiny):
    res = evaluate_draft(tiny["target"], None, tiny["untrained"], tiny["prompts"][:3], chain=[3], tree=["10:3:4"],
                         max_new_tokens=24, progress=False)
    for m in ("chain-3", "tree-10:3:4"):
        assert res.table()["all"][m]["identical_to_target"] == 1.0
        assert res.overall()[m].new_tokens == 3 * 24


def _rounds_of(proposer, kind: str, rounds: list):
    """Record every round of `proposer.<kind>` (rows=1): (tokens in the target's cache, its output)."""
    propose = getattr(proposer, kind)

    def record(cache, pending, *args):
        out = propose(cache, pending, *args)
        rounds.append((int(pending.cached[0]), [o[0].clone() if o is not None else None for o in out]))
        return out

    setattr(proposer, kind, record)


def test_tree_verify_equals_each_path_run_alone(tiny):
    """The decoder's tree verify (its 4-D mask over the static cache and depth positions) gives every node the
    logits and aux states of its own path run alone, in every round of a decoding (the accepted path moved
    into place in between)."""
    target, aux_ids, draft = tiny["target"], tiny["aux"], tiny["trained"]
    wrapped = HFTarget(target, aux_ids)
    proposer, rounds, verified = make_proposer(draft), [], []
    _rounds_of(proposer, "tree", rounds)
    hook = target.register_forward_hook(
        lambda mod, args, kwargs, out: verified.append((kwargs["input_ids"][0].clone(), out.logits[0].clone(),
                                                        torch.cat([wrapped._captured[a][0] for a in aux_ids], -1)))
        if kwargs.get("attention_mask") is not None else None, with_kwargs=True)
    prompt = tiny["prompts"][5]
    try:
        answer = speculate(wrapped, draft, [prompt], TreeSpec(14, 4, 3), 16, proposer=proposer)[0].tokens
    finally:
        hook.remove()
    assert len(rounds) == len(verified) >= 3
    for (L, (tokens, parents, _)), (ids, logits, aux) in zip(rounds, verified, strict=True):
        seq = (prompt + answer)[:L + 1]  # the prefix in the target's cache and the root (the newest token)
        assert ids.tolist() == seq[-1:] + tokens.tolist()
        parent_all = [0] + parents.tolist()
        for i in range(len(ids)):
            path, j = [], i
            while j != 0:
                path.append(j)
                j = parent_all[j]
            o = target(torch.tensor([seq + [int(ids[k]) for k in reversed(path)]]), output_hidden_states=True)
            ref_aux = torch.cat([o.hidden_states[a][0, -1] for a in aux_ids])
            assert (logits[i] - o.logits[0, -1]).abs().max() <= 1e-4 * o.logits[0, -1].abs().max()
            assert (aux[i] - ref_aux).abs().max() <= 1e-4 * ref_aux.abs().max()
    wrapped.close()


@torch.no_grad()
def ttt_logits(draft, seq: list[int], aux: torch.Tensor, steps: int) -> torch.Tensor:
    """The training-time-test unroll of eyas.train.ttt.TTTModel over one whole sequence: step j, row t reads
    the true token x[t+1+j] and the draft's step j-1 output at t. -> draft logits [steps, T, V_d]."""
    ids = torch.tensor([seq])
    T = ids.shape[1]
    attend, hidden, out = TTTAttention("math"), draft.fuse(aux[None]), []
    for j in range(steps):
        hidden = draft(shift_left(ids, 1 + j), hidden, (torch.arange(T) + j)[None], attend)
        out.append(draft.logits(hidden)[0])
    return torch.stack(out)


@pytest.mark.parametrize("which", ["trained", "two_layers", "eagle31"])
def test_decoding_proposes_what_training_time_test_predicts(tiny, which):
    """What the draft learns is what it proposes: in every round of greedy speculative decoding, the
    draft's logits at the root (the row that reads the newest token with the target's state before it)
    are the training unroll's step-0 logits at that row, and the chain's step j those of step j, as long
    as the tokens before it are the true ones (which training feeds). Training accuracy and acceptance
    measure the same predictions; the reference states come from transformers' output_hidden_states,
    not eval's hooks. With two decoder layers, each keeps its own keys in the cache."""
    target, aux_ids, draft = tiny["target"], tiny["aux"], tiny[which]
    wrapped = HFTarget(target, aux_ids)
    proposer = make_proposer(draft)
    rounds: list[tuple[int, list[torch.Tensor], list[int]]] = []  # (L, logits of steps 0.., proposed tokens)
    logits_of, propose = draft.logits, {"chain": proposer.chain, "tree": proposer.tree}

    def recorded(kind):
        def run(cache, pending, *args):
            rounds.append((int(pending.cached[0]), [], []))
            draft.logits = lambda h: rounds[-1][1].append(logits_of(h)[0, -1].clone()) or logits_of(h)
            try:
                out = propose[kind](cache, pending, *args)
            finally:
                del draft.logits
            if kind == "chain":
                rounds[-1][2].extend(out[0][0].tolist())
            else:
                del rounds[-1][1][1:]  # the tree's later steps score a whole frontier: the root alone is checked
            return out
        return run

    proposer.chain, proposer.tree = recorded("chain"), recorded("tree")
    checked = 0
    for prompt in tiny["prompts"][:3]:
        for method in (ChainSpec(4), TreeSpec(12, 4, 3)):
            rounds.clear()
            seq = prompt + speculate(wrapped, draft, [prompt], method, 24, proposer=proposer)[0].tokens
            pred = ttt_logits(draft, seq, capture(target, [seq], aux_ids)[0][1], 4)  # [4, T, V_d]
            for L, logits, proposed in rounds:
                root = L - 1
                for j, got in enumerate(logits):
                    ref = pred[j, root]
                    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), (L, j)
                    checked += 1
                    if j >= len(proposed) or root + 2 + j >= len(seq) or proposed[j] != seq[root + 2 + j]:
                        break  # the next step reads a token that training never feeds there
    wrapped.close()
    assert checked >= 40, checked


def _after_prompt(wrapped: HFTarget, proposer, prompt: list[int], window: int = 0
                  ) -> tuple[StaticKVCache, Pending]:
    """A draft cache holding the prompt's entries and one row's pending entry (the target's first token with its
    state before it), as the decoder leaves them after a prefill."""
    with torch.inference_mode():
        logits, aux = wrapped.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], wrapped.new_cache())
    cache = StaticKVCache(1, len(prompt) + 64, window)
    proposer.prefill(cache, 0, torch.tensor(prompt[1:]), aux[:-1])
    first = logits[-1].argmax().view(1, 1)
    return cache, Pending(first, aux[-1:][None], torch.ones(1, dtype=torch.long), torch.tensor([len(prompt)]))


@torch.inference_mode()
def test_dynamic_tree_is_eagle2_selection(tiny):
    """`total` nodes, closed under ancestors (parents come first), siblings distinct, depth <= D, and the root's
    children the draft's top-k tokens."""
    wrapped = HFTarget(tiny["target"], tiny["aux"])
    proposer = make_proposer(tiny["untrained"])
    cache, pending = _after_prompt(wrapped, proposer, tiny["prompts"][0])
    _, root_logits = proposer._extend(cache, pending)
    tokens, parents, depth = (t[0] for t in proposer.tree(cache, pending, TreeSpec(20, 5, 3)))
    wrapped.close()
    assert tokens.numel() == 20 and int(depth.max()) <= 5
    for i in range(20):
        p = int(parents[i])
        assert p <= i  # parents come first (index p-1 < i), 0 is the root
        assert int(depth[i]) == (1 if p == 0 else int(depth[p - 1]) + 1)
    for p in set(parents.tolist()):
        sib = tokens[parents == p].tolist()
        assert len(sib) == len(set(sib))
    top = proposer.d2t_ids[root_logits[0].topk(3).indices]
    assert sorted(tokens[parents == 0].tolist()) == sorted(top.tolist())


def test_a_windowed_drafts_tree_sees_what_its_chain_sees():
    """--draft-window: a one-wide tree (top_k 1) follows the same path as the chain (the tree's context mask
    applies the window from each depth's position, the chain's from its own), and the window binds here (the
    chain without it proposes otherwise)."""
    target, aux, _, seqs = target_and_continuations()
    draft = make_draft(target, aux, 48, seqs, seed=1)
    for p in draft.parameters():  # larger weights than the init: attention must matter
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    wrapped = HFTarget(target, aux)
    prompt = seqs[0][:24]

    def chain_and_tree(window: int) -> tuple[list[int], list[int]]:
        draft.config.sliding_window = window
        proposer = make_proposer(draft)
        cache, pending = _after_prompt(wrapped, proposer, prompt, window)
        chain = proposer.chain(cache, pending, 5)[0][0].tolist()
        cache, pending = _after_prompt(wrapped, proposer, prompt, window)
        return chain, proposer.tree(cache, pending, TreeSpec(5, 5, 1))[0][0].tolist()

    with torch.inference_mode():
        chain, tree = chain_and_tree(3)
        full_chain, full_tree = chain_and_tree(0)
    draft.config.sliding_window = 0
    wrapped.close()
    assert tree == chain and full_tree == full_chain
    assert chain != full_chain


def test_draft_cache_extend_in_pieces_equals_one_pass(tiny):
    draft = tiny["trained"]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (10,), generator=g)
    aux = torch.randn(10, 3 * 64, generator=g)
    proposer = make_proposer(draft)

    def pending(a, b):
        return Pending(tokens[None, a:b], aux[None, a:b], torch.tensor([b - a]), torch.tensor([b]))

    with torch.inference_mode():
        out_all, logits_all = proposer._extend(StaticKVCache(1, 32), pending(0, 10))
        parts = StaticKVCache(1, 32)
        proposer._extend(parts, pending(0, 6))
        out_parts, logits_parts = proposer._extend(parts, pending(6, 10))
    assert torch.allclose(out_all, out_parts, atol=1e-5) and torch.allclose(logits_all, logits_parts, atol=1e-4)


@pytest.mark.slow
def test_smollm2_greedy_identical_untrained_and_trained(smollm2_dir):
    """SmolLM2-135M real weights, fp32: speculative greedy output == the target's own greedy output, with a
    random draft and with a draft trained (a few TTT steps) on the target's answers to these prompts."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    aux = [2, 15, 27]
    prompts = [render_prompt(tok, [{"role": "user", "content": q}])
               for q in ("Write a haiku about the sea.", "List three uses of copper.")]
    n = 24
    refs = [hf_greedy(model, p, n) for p in prompts]
    seqs = [p + r for p, r in zip(prompts, refs, strict=True)]
    untrained = make_draft(model, aux, 32000)
    trained = make_draft(model, aux, 256, seqs)
    train_draft(trained, capture(model, seqs, aux), steps=40)
    wrapped = HFTarget(model, aux)
    for draft, min_tau in ((untrained, 1.0), (trained, 2.5)):
        for method in (ChainSpec(4), TreeSpec(16, 4, 4)):
            accepted = []
            # no stop ids: always n tokens, like hf_greedy; both prompts side by side
            for out, ref in zip(speculate(wrapped, draft, prompts, method, n, rows=2), refs, strict=True):
                assert out.tokens == ref, (method, draft is trained)
                accepted += out.accepted
            tau = 1 + sum(accepted) / len(accepted)
            assert tau >= min_tau, (method, tau)
            if draft is untrained:
                assert tau < 1.5
    wrapped.close()


# -- metrics -------------------------------------------------------------------------------------------


def test_metrics_follow_eagle_definitions():
    s = MethodStats("chain-3", 3)
    s.add(Generation(tokens=list(range(9)), seconds=1.0, target_forwards=4, draft_forwards=9, accepted=[3, 1, 0]))
    s.add(Generation(tokens=list(range(5)), seconds=1.0, target_forwards=3, draft_forwards=6, accepted=[2, 0]),
          identical=True)
    assert s.accept_hist == [2, 1, 1, 1]
    assert s.tau == pytest.approx(1 + 6 / 5)  # bonus token counted
    assert s.accept_rate_by_pos == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    assert s.accept_cond_by_pos == pytest.approx([3 / 5, 2 / 3, 1 / 2])
    assert s.tokens_per_target_forward == pytest.approx(14 / 7)
    assert s.tok_s == pytest.approx(7.0)
    d = s.to_dict(baseline_tok_s=3.5)
    assert d["speedup"] == pytest.approx(2.0) and d["identical_to_target"] == 1.0 and d["compared"] == 1
    assert MethodStats.from_dict(d).to_dict(3.5) == d


def test_greedy_acceptance_counts_like_vllm(tiny):
    res = greedy_acceptance(tiny["target"], None, tiny["trained"], tiny["prompts"][:2], k=3, max_new_tokens=24)
    n = res["num_drafts"]
    assert n > 0 and res["num_draft_tokens"] == 3 * n
    assert res["mean_acceptance_length"] == pytest.approx(1 + res["num_accepted_tokens"] / n)
    pos = res["accepted_per_pos"]
    assert len(pos) == 3 and pos[0] >= pos[1] >= pos[2] and sum(pos) == res["num_accepted_tokens"]


# -- reports, prompts, CLI ----------------------------------------------------------------------------


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_report_json_markdown_plots_and_compare(tiny, tmp_path):
    kw = dict(chain=[1, 3], tree=["8:3:3"], max_new_tokens=12, progress=False)
    good = evaluate_draft(tiny["target"], None, tiny["trained"], tiny["prompts"][:1], **kw)
    bad = evaluate_draft(tiny["target"], None, tiny["untrained"], tiny["prompts"][:1], **kw)
    write_report(bad, tmp_path / "bad", label="untrained")
    out = write_report(good, tmp_path / "good", label="trained", compare=[("untrained", load_report(tmp_path / "bad"))])
    again = load_report(out / "report.json")
    assert again.table() == good.table() and again.methods == ["chain-1", "chain-3", "tree-8:3:3"]
    md = (out / "report.md").read_text()
    assert "| chain-3 |" in md and "tau untrained" in md and "Δ tau" in md
    t_good, t_bad = good.overall()["chain-3"].tau, bad.overall()["chain-3"].tau
    assert f"{t_good - t_bad:+.2f}" in md
    for name in ("acceptance_by_position.png", "tau_by_prompt_set.png", "tau_vs_k.png"):
        w, h = _png_size(out / name)
        assert w >= 600 and h >= 400
    data = json.loads((out / "report.json").read_text())
    assert data["compared"][0]["label"] == "untrained" and data["records"]
    assert data["results"]["all"][BASELINE]["speedup"] == pytest.approx(1.0)
    with pytest.raises(EyasError):
        load_report(tmp_path / "nothing.json")
    assert "tau counts the bonus token" in markdown_summary(good)
    # exact in fp32: no precision note; a bf16 run whose output drifted says why and what to run
    assert "Note:" not in md and good.overall()["chain-3"].identical == good.overall()["chain-3"].compared > 0
    good.meta["dtype"] = "bfloat16"
    next(iter(good.sets.values()))["chain-3"].identical -= 1
    assert "differ from the target's own (chain-3)" in markdown_summary(good)
    assert "--dtype float32" in markdown_summary(good)


def test_serving_curve_rows_table_plot_and_round_trip(tiny, tmp_path):
    """A measurement's rows (batch 1: the run's own table), rows of a larger batch, and their report: a table in
    report.md, serving_curve.png, and report.json's `serving`, which a reread report keeps."""
    res = evaluate_draft(tiny["target"], None, tiny["trained"], tiny["prompts"][:2], chain=[3], max_new_tokens=12,
                         progress=False)
    one = serving_rows(1, runs_of(res.overall()))
    res.serving = []  # the table's own figures, not those of the timing rounds (tests/test_eval_sweep.py)
    table = res.table()["all"]
    assert [r["method"] for r in one] == [BASELINE, "chain-3"] and one[0]["speedup"] == pytest.approx(1.0)
    assert one[1]["tokens_per_s"] == pytest.approx(table["chain-3"]["tok_s"])
    assert one[1]["speedup"] == pytest.approx(table["chain-3"]["speedup"])
    assert one[1]["tokens_per_forward"] == pytest.approx(table["chain-3"]["tokens_per_target_forward"])
    assert one[1]["accept_rate_by_pos"] == table["chain-3"]["accept_rate_by_pos"]
    assert one[1]["identical"] == table["chain-3"]["identical_to_target"] == 1.0
    four = serving_rows(4, [ServingRun("chain-3", 400, 2.0, 2.5), ServingRun(BASELINE, 400, 1.0, 1.0)])
    assert [r["method"] for r in four] == [BASELINE, "chain-3"]  # the target alone first
    assert four[1]["tokens_per_s"] == pytest.approx(200.0) and four[1]["speedup"] == pytest.approx(0.5)
    assert best_speedups(one + four) == [(1, "chain-3", one[1]["speedup"]), (4, "chain-3", 0.5)]
    res.serving = one + four
    out = write_report(res, tmp_path / "curve", label="served")
    md = (out / "report.md").read_text()
    assert "## Serving curve" in md and "| 4 | chain-3 | 200.0 | 0.50x | 2.50 | – |" in md and "serving_curve.png" in md
    w, h = _png_size(out / "serving_curve.png")
    assert w >= 600 and h >= 300
    assert load_report(out).serving == res.serving


def test_eval_refuses_a_draft_for_another_target(tiny):
    other = tiny_target(vocab=80)
    with pytest.raises(EyasError, match="does not fit this target"):
        evaluate_draft(other, None, tiny["trained"], [[1, 2, 3]], chain=[2], max_new_tokens=4, progress=False)
