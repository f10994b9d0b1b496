"""`eyas eval --backend vllm`: vLLM's own speculative decoding measured on a tiny target with a draft trained on
its answers, one request at a time and with several requests in flight (the serving curve), and held against
eyas' own chain decoding of the same draft on the same prompts ("one engine agrees").

Runs in the vLLM venv:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -m vllm tests/test_eval_vllm.py
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _eval_utils import capture, check_speed_words, make_draft, train_draft
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from eyas.eval import BASELINE, PromptItem, PromptSet, evaluate_draft  # noqa: E402
from eyas.eval.prompts import render_prompt  # noqa: E402
from eyas.recipes.run import in_words  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

K = 3
NEW_TOKENS = 24
BATCH_SIZES = [1, 4]
PROMPTS = PromptSet("mini", [PromptItem("a", ["Write a haiku about the sea.", "Now one about hills."]),
                             PromptItem("b", ["What is 17 times 23?", "And 17 times 24?"]),
                             PromptItem("c", ["Name three prime numbers."])])


@pytest.fixture(scope="module")
def measured(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with SmolLM2's tokenizer, a draft trained briefly on its greedy answers to PROMPTS,
    eyas' own chain-3 decoding of them (hf backend) and `eyas eval --backend vllm --batch-size 1,4`'s report."""
    from eyas.recipes.evaluate import EvalOptions, run_eval

    root = tmp_path_factory.mktemp("eval-vllm")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    base = evaluate_draft(model, tok, make_draft(model, [1, 2, 3], 512), PROMPTS, chain=[1],
                          max_new_tokens=NEW_TOKENS, progress=False)
    answers = {(r["item"], r["turn"]): r for r in base.records if r["method"] == BASELINE}
    seqs = []
    for item in PROMPTS.items:
        msgs = []
        for t, turn in enumerate(item.turns):
            msgs.append({"role": "user", "content": turn})
            seqs.append(render_prompt(tok, msgs) + answers[(item.id, t)]["answer_ids"])
            msgs.append({"role": "assistant", "content": answers[(item.id, t)]["answer"]})
    draft = make_draft(model, [1, 2, 3], 512, seqs)
    train_draft(draft, capture(model, seqs, [1, 2, 3]), steps=40)  # accepted partly: ~[0.7, 0.3, 0.2]
    draft.config.target = str(root / "target")
    draft.save_pretrained(root / "draft")
    mine = evaluate_draft(model, tok, draft, PROMPTS, chain=[K], max_new_tokens=NEW_TOKENS, progress=False)
    chats = root / "prompts.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t} for t in it.turns]}) + "\n"
                             for it in PROMPTS.items))
    out = run_eval(EvalOptions(draft=str(root / "draft"), model=str(root / "target"), prompts=f"mini={chats}",
                               chain=str(K), tree="none", max_new_tokens=NEW_TOKENS, engine="vllm",
                               batch_sizes=BATCH_SIZES, out=root / "eval"), log=lambda s: None)
    return {"mine": mine.table()["all"], "report": json.loads((out / "report.json").read_text()), "out": out}


def test_vllm_serving_curve_at_each_batch_size(measured):
    """Each batch size measures the target alone and the chain on every prompt; the report shows the curve."""
    report = measured["report"]
    rows = report["serving"]
    assert [(r["batch_size"], r["method"]) for r in rows] == [(1, BASELINE), (1, f"chain-{K}"), (4, BASELINE),
                                                             (4, f"chain-{K}")]
    for r in rows:
        assert r["tokens_per_s"] > 0
        if r["method"] == BASELINE:
            assert r["speedup"] == pytest.approx(1.0) and r["tokens_per_forward"] == pytest.approx(1.0)
        else:
            assert r["speedup"] > 0 and 1.0 < r["tokens_per_forward"] <= K + 1, r
            assert r["identical"] == 1.0, r  # greedy: the target's own answers, with 4 requests in flight too
    one = {r["method"]: r for r in rows if r["batch_size"] == 1}
    results = report["results"]["all"]
    assert one[f"chain-{K}"]["tokens_per_s"] == pytest.approx(results[f"chain-{K}"]["tok_s"])
    assert one[f"chain-{K}"]["speedup"] == pytest.approx(results[f"chain-{K}"]["speedup"])
    md = (measured["out"] / "report.md").read_text()
    assert "## Serving curve" in md and f"| 4 | chain-{K} |" in md and f"| 4 | {BASELINE} |" in md
    assert json.loads((measured["out"] / "manifest.json").read_text())["options"]["batch_sizes"] == BATCH_SIZES
    words = in_words(report, {}, measured["out"])  # eyas run's closing words, from this run's report
    check_speed_words(words, report)
    assert "at batch size 4" in words


def test_eyas_and_vllm_agree_on_acceptance_by_position(measured):
    """One engine agrees: the same draft on the same prompts, greedy, gives the same chain acceptance at every
    draft position in eyas' decoder and in vLLM's counters, within 0.02, alone and with 4 requests in flight.
    The draft accepts partly, and its positions differ by more than the tolerance, so an off-by-one in
    either the evaluator or the export fails here."""
    report, mine = measured["report"], measured["mine"][f"chain-{K}"]
    theirs = report["results"]["all"][f"chain-{K}"]
    assert theirs["identical_to_target"] == 1.0
    assert report["results"]["all"][BASELINE]["new_tokens"] == measured["mine"][BASELINE]["new_tokens"]
    assert theirs["accept_hist"] == mine["accept_hist"]  # one request at a time: the very same verify steps
    ours = mine["accept_rate_by_pos"]
    assert all(0.1 < r < 0.95 for r in ours), ours  # neither never nor always accepted
    assert min(a - b for a, b in zip(ours, ours[1:], strict=False)) > 0.05, ours  # a shift would show
    served = next(r for r in report["serving"] if r["batch_size"] == 4 and r["method"] == f"chain-{K}")
    for rates in (theirs["accept_rate_by_pos"], served["accept_rate_by_pos"]):
        assert len(rates) == K and max(abs(a - b) for a, b in zip(ours, rates, strict=True)) <= 0.02, (ours, rates)

