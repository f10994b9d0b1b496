"""Speculation that follows the load: the per-batch-size sweep (eyas.eval.budget), the recommendation of what to serve
at which concurrency (eyas.eval.recommend), and speedups the timing can honestly give (eyas.eval.timing): a noisy
clock never puts an impossible speedup in report.md or in `eyas run`'s closing words."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from _eval_utils import capture, make_draft, save_tiny_target_and_draft, target_and_continuations, train_draft
from transformers import AutoTokenizer

from eyas.eval import BASELINE, ChainSpec, TreeSpec, evaluate_draft
from eyas.eval.budget import sweep_plan, verify_tokens
from eyas.eval.recommend import choose, recommendation, serve_lines, stops_paying
from eyas.eval.report import write_report
from eyas.recipes.run import in_words

pytestmark = pytest.mark.usefixtures("one_thread")

ASKED = [ChainSpec(3), ChainSpec(5), ChainSpec(7), TreeSpec(60, 7, 10)]  # eyas eval's default methods


@pytest.fixture(scope="module")
def trained():
    target, aux, prompts, seqs = target_and_continuations()
    draft = make_draft(target, aux, 48, seqs)
    train_draft(draft, capture(target, seqs, aux), steps=80)
    g = torch.Generator().manual_seed(3)
    prompts = prompts[:4] + [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 17, 5)]
    return {"target": target, "draft": draft.eval(), "prompts": prompts}


def test_the_sweep_shrinks_the_speculation_per_row_as_rows_grow_and_costs_at_most_twice_the_default():
    plan = sweep_plan([1, 4, 16, 64], ASKED, 1024, lambda m: True)
    for b, methods in plan.items():
        assert methods[:4] == ASKED  # what the user asked for is always measured
        ladder = methods[4:]
        assert all(verify_tokens(m) <= max(2, 1024 // b) for m in ladder), (b, ladder)
        assert len(methods) + 1 <= 2 * (len(ASKED) + 1)  # decodes per batch size, the target alone included
    assert [m.name for m in plan[64][4:]] == ["chain-1", "chain-2", "tree-15:5:4", "tree-8:4:2"]
    assert TreeSpec(30, 6, 6) in plan[16] and TreeSpec(30, 6, 6) not in plan[64]
    for small, large in ((1, 4), (4, 16), (16, 64)):  # a larger batch measures a subset of a smaller one's
        assert set(plan[large]) <= set(plan[small])
    chains_only = sweep_plan([1], [ChainSpec(3)], 1024, lambda m: isinstance(m, ChainSpec))[1]
    assert [m.name for m in chains_only] == ["chain-3", "chain-1", "chain-2", "chain-5", "chain-7"]


def _row(b, m, s, tpf=None, note=None):
    row = {"batch_size": b, "method": m, "tokens_per_s": 100.0, "speedup": s, "tokens_per_forward": tpf}
    return {**row, "speedup_note": note} if note else row


def test_the_fastest_at_each_batch_size_with_the_target_alone_a_candidate():
    """The issue's H100 curve: the tree wins alone, the chain at 16 and 64; a slower draft at 128 leaves the target
    alone fastest, from where speculation stops paying; a noisy batch size recommends nothing."""
    rows = [_row(b, BASELINE, 1.0) for b in (1, 16, 64, 128)]
    rows += [_row(1, "chain-7", 1.46), _row(1, "tree-60:7:10", 1.80), _row(16, "chain-7", 1.39),
             _row(16, "tree-60:7:10", 1.05), _row(64, "chain-7", 1.18), _row(64, "tree-60:7:10", 0.68),
             _row(128, "chain-7", 0.93), _row(128, "tree-60:7:10", 0.41)]
    choices = choose(rows)
    assert [(c.batch_size, c.method, c.speedup) for c in choices] == [
        (1, "tree-60:7:10", 1.80), (16, "chain-7", 1.39), (64, "chain-7", 1.18), (128, BASELINE, 1.0)]
    assert stops_paying(choices) == 128
    assert stops_paying(choices[:3]) is None
    noisy = rows + [_row(256, BASELINE, 1.0), _row(256, "chain-7", None, 2.4, "it measured 3.56x")]
    last = choose(noisy)[-1]
    assert last.method is None and "3.56x" in last.note and stops_paying(choose(noisy)) is None


def test_serve_commands_come_from_the_export_printers(trained, tmp_path):
    cfg = trained["draft"].config
    folders = {"vllm": tmp_path / "vllm", "sglang": tmp_path / "sglang"}
    rows = [_row(8, "chain-2", 1.1), _row(8, "chain-5", 1.3), _row(8, "tree-30:6:6", 1.5)]
    vllm, sglang = serve_lines(cfg, folders, "tgt", "tree-30:6:6", rows, 8)
    assert vllm.startswith("vllm serve tgt --speculative-config") and '"num_speculative_tokens": 5' in vllm
    assert "the fastest chain here, chain-5" in vllm and str(folders["vllm"]) in vllm
    assert sglang.endswith("--speculative-num-steps 6 --speculative-eagle-topk 6 --speculative-num-draft-tokens 31")
    vllm, sglang = serve_lines(cfg, folders, "tgt", "chain-3")
    assert '"num_speculative_tokens": 3' in vllm and "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4" \
        in sglang
    assert serve_lines(cfg, folders, "tgt", BASELINE) == ["vllm serve tgt",
                                                          "python -m sglang.launch_server --model-path tgt"]


class BusyMachine:
    """time.perf_counter, and every third timed decode ends 5 s late: a machine busy with other work."""

    def __init__(self) -> None:
        self.reads, self.lag = 0, 0.0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 6 == 0:  # the second reading of every third start/stop pair
            self.lag += 5.0
        return time.perf_counter() + self.lag


@pytest.mark.parametrize("batch_sizes,temperature", [([1, 2], 0.0), ([1, 2], 0.7)])  # greedy and sampled batches
def test_a_noisy_clock_puts_no_impossible_speedup_in_the_report_or_the_closing_words(trained, tmp_path, batch_sizes,
                                                                                     temperature):
    clock = BusyMachine()
    res = evaluate_draft(trained["target"], None, trained["draft"], trained["prompts"], chain=[3], tree=["8:3:3"],
                         max_new_tokens=12, batch_sizes=batch_sizes, temperature=temperature, progress=False,
                         clock=clock)
    assert clock.reads > 20  # the injected clock timed the decoding
    res.recommendation = recommendation(res.serving, None, None, {}, "tgt")
    write_report(res, tmp_path / "ev", label="noisy")
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    md = (tmp_path / "ev" / "report.md").read_text()
    words = in_words(report, {}, tmp_path)
    rows = {(r["batch_size"], r["method"]): r for r in report["serving"]}
    noisy = [k for k, r in rows.items() if r.get("speedup_note")]
    assert noisy, rows  # a decode of the target alone that ran 5 s late is caught
    for (b, m), r in rows.items():
        if m == BASELINE:
            continue
        assert r["speedup"] is None or r["speedup"] <= r["tokens_per_forward"], r
        if len(batch_sizes) > 1:  # the serving curve's table
            line = next(ln for ln in md.splitlines() if ln.startswith(f"| {b} | {m} |"))
            assert ("too noisy" in line) == ((b, m) in noisy), line
    for m, v in report["results"]["all"].items():  # the per-method table too
        assert v["speedup"] is None or v["speedup"] <= v["tokens_per_target_forward"] + 1e-9, (m, v)
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {m} |"))
        assert ("too noisy" in line) == ((1, m) in noisy), line
    assert "the timing was too noisy to give a speedup" in md and "too noisy to give a speedup" in words
    for s, b, m in re.findall(r"([\d.]+)x at batch size (\d+) \(([^)]+)\)", words):
        assert (int(b), m) not in noisy and float(s) <= rows[(int(b), m)]["tokens_per_forward"], words
    for c in report["recommendation"]["choices"]:
        assert c["speedup"] is None or c["method"] == BASELINE or \
            c["speedup"] <= rows[(c["batch_size"], c["method"])]["tokens_per_forward"]


@pytest.fixture(scope="module")
def chat_folder(smollm2_dir, tmp_path_factory, trained):
    """A tiny random Llama with SmolLM2's tokenizer, and an EAGLE-3 draft for it, saved as folders."""
    root = tmp_path_factory.mktemp("sweep")
    save_tiny_target_and_draft(root, AutoTokenizer.from_pretrained(smollm2_dir))
    return root


def test_cli_sweeps_per_batch_size_and_recommends_what_to_serve(chat_folder, tmp_path):
    from eyas.recipes.evaluate import EvalOptions, run_eval

    logs: list[str] = []
    out = run_eval(EvalOptions(draft=str(chat_folder / "draft"), model=str(chat_folder / "target"), prompts="mtbench",
                               max_prompts=4, max_turns=1, chain="2", tree="6:2:3", max_new_tokens=6,
                               batch_sizes=[1, 2], verify_budget=8, serve_at=3, out=tmp_path / "ev"),
                   log=logs.append)
    data = json.loads((out / "report.json").read_text())
    measured = {b: [r["method"] for r in data["serving"] if r["batch_size"] == b] for b in (1, 2)}
    assert measured[1] == [BASELINE, "chain-2", "tree-6:2:3", "chain-1", "chain-3", "chain-5", "chain-7"]
    assert measured[2] == [BASELINE, "chain-2", "tree-6:2:3", "chain-1", "chain-3"]  # 4 verify tokens a row
    rec = data["recommendation"]
    assert rec["serve_at"] == 3 and rec["measured_at"] == 2  # the largest batch size measured at or below 3
    at2 = next(c for c in rec["choices"] if c["batch_size"] == 2)
    assert rec["method"] == at2["method"]
    timed = [r for r in data["serving"] if r["batch_size"] == 2 and r["speedup"] is not None]
    if rec["method"] == BASELINE:
        assert all(r["speedup"] <= 1.0 for r in timed if r["method"] != BASELINE)
        assert rec["serve"][0] == f"vllm serve {chat_folder / 'target'}"
    elif rec["method"] is not None:
        assert rec["speedup"] == max(r["speedup"] for r in timed)
        assert any("--speculative-config" in s for s in rec["serve"])
    md = (out / "report.md").read_text()
    assert "## Recommendation" in md and "| 2 |" in md.split("## Recommendation")[1]
    assert (out / "recommendation.png").is_file() and (out / "serving_curve.png").is_file()
    assert any("## Recommendation" in line for line in logs)
    words = in_words(data, {}, tmp_path)
    if rec["method"] is not None:
        assert "For 3 requests in flight (measured at 2) on cpu" in words


def test_sweep_options_are_checked_where_they_are_given():
    from eyas.recipes.evaluate import EvalOptions, fingerprint, sweeping
    from eyas.utils.io import EyasError

    with pytest.raises(EyasError, match="--verify-budget 1: a round verifies at least 2 tokens a row"):
        EvalOptions(draft="random", verify_budget=1)
    with pytest.raises(EyasError, match="--serve-at 0: requests in flight"):
        EvalOptions(draft="random", serve_at=0)
    assert not sweeping(EvalOptions(draft="random"))  # one batch size: the methods asked for, as before
    several = EvalOptions(draft="random", batch_sizes=[1, 16])
    assert sweeping(several) and fingerprint(several, "t")["verify_budget"] == 1024
    assert not sweeping(EvalOptions(draft="random", batch_sizes=[1, 16], sweep=False))
    assert "verify_budget" not in fingerprint(EvalOptions(draft="random"), "t")  # earlier runs stay up to date


def test_closing_words_serve_the_exported_folders(chat_folder, tmp_path):
    """`eyas run`'s closing words give the recommended method's commands with the folders export wrote."""
    from eyas.recipes.run import recommendation_in_words

    rows = [_row(b, BASELINE, 1.0) for b in (1, 8)] + [_row(1, "chain-3", 1.4, 2.0), _row(8, "chain-3", 1.2, 2.0),
                                                       _row(8, "chain-2", 1.1, 1.8)]
    draft = chat_folder / "draft"
    rec = recommendation(rows, None, None, {}, "tgt")
    assert rec["method"] == "chain-3" and rec["serve"] == []  # the eval alone knew no draft config
    for fmt in ("vllm", "sglang"):
        (tmp_path / fmt).mkdir()
    report = {"meta": {"draft": str(draft), "target": "tgt"}}
    words = recommendation_in_words(rec, report, rows, tmp_path)
    assert words[0] == "For 8 requests in flight, serve chain-3 (1.20x the target alone):"
    vllm, sglang = words[1:]
    assert f'"model": "{tmp_path / "vllm"}"' in vllm and '"num_speculative_tokens": 3' in vllm
    assert f"--speculative-draft-model-path {tmp_path / 'sglang'}" in sglang
