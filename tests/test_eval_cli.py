"""eyas eval around the decoder: prompt sets, the CLI end to end with reuse and resume, clear errors.
(vLLM's acceptance counters against eyas': tests/test_eval_vllm.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _eval_utils import check_speed_words, save_tiny_target_and_draft
from transformers import AutoTokenizer, LlamaForCausalLM

from eyas.eval import (
    BASELINE,
    EvalResult,
    TreeSpec,
)
from eyas.eval.prompts import chat_file_set, humaneval_set, load_prompt_sets, mtbench_set, render_prompt
from eyas.eval.report import write_report
from eyas.model.family_facts import FAMILIES
from eyas.recipes.run import in_words
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prompt_sets(tmp_path):
    mt = mtbench_set()
    assert len(mt.items) == 80 and all(len(it.turns) == 2 for it in mt.items) and mt.num_turns == 160
    he = humaneval_set()
    assert len(he.items) == 164 and he.items[0].turns[0].lstrip().startswith(("def", "from", "import"))
    f = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": "a"}, {"role": "user", "content": f"r{i}"},
                          {"role": "assistant", "content": "b"}]}
            for i in range(5)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = chat_file_set(f, max_prompts=2)
    assert [it.turns for it in s.items] == [["q3", "r3"], ["q4", "r4"]] and s.items[0].system == "be brief"
    sets = load_prompt_sets(f"mtbench,{f}", max_prompts=3, max_turns=1)
    assert [s.name for s in sets] == ["mtbench", "chats"] and sets[0].num_turns == 3
    with pytest.raises(EyasError):
        load_prompt_sets("no-such-set")
    # MT-Bench-style records written raw (ensure_ascii=False): a U+2028 inside a turn is not a line break
    q = tmp_path / "questions.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "turns": [f"a\u2028{i}", "b"]}, ensure_ascii=False) + "\n"
                         for i in (1, 2)), encoding="utf-8")
    assert [(it.id, it.turns) for it in chat_file_set(q).items] == [("1", ["a\u20281", "b"]), ("2", ["a\u20282", "b"])]
    # MT-Bench's own question.jsonl, named, as on a machine without the MT-Bench package
    from eyas.assets import mtbench_path

    (named,) = load_prompt_sets(f"mtbench={mtbench_path()}", max_prompts=80)
    assert named.name == "mtbench"
    assert [(it.id, it.turns) for it in named.items] == [(it.id, it.turns) for it in mt.items]


def test_prepared_dataset_slice_cuts_before_first_answer(tmp_path):
    from safetensors.torch import save_file

    ids = torch.arange(20, dtype=torch.int32)
    mask = torch.zeros(20, dtype=torch.uint8)
    mask[[4, 5, 12, 13, 14]] = 1  # sample 0 = [0, 8): answer at 4; sample 1 = [8, 20): answer at 12
    save_file({"input_ids": ids, "loss_mask": mask, "offsets": torch.tensor([0, 8, 20])},
              str(tmp_path / "shard-00000.safetensors"))
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "eyas.prepared/1", "shards": [
        {"file": "shard-00000.safetensors", "num_samples": 2, "num_tokens": 20}]}))
    (s,) = load_prompt_sets(str(tmp_path), max_prompts=5)
    assert [it.token_ids for it in s.items] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    (last,) = load_prompt_sets(str(tmp_path), max_prompts=1)
    assert [it.id for it in last.items] == ["sample-1"]  # the held-out slice is the tail


@pytest.fixture(scope="module")
def tiny_folder(smollm2_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer and chat template, saved like any HF model."""
    root = tmp_path_factory.mktemp("tinyllm")
    save_tiny_target_and_draft(root, AutoTokenizer.from_pretrained(smollm2_dir))
    return root


def test_cli_eval_end_to_end_reuse_and_resume(tiny_folder, tmp_path):
    from eyas.recipes.evaluate import PARTIAL_SUFFIX, EvalOptions, run_eval

    logs: list[str] = []
    kw = dict(model=str(tiny_folder / "target"), prompts="mtbench", chain="1,2", tree="6:2:3", max_new_tokens=6,
              max_prompts=2, out=tmp_path / "ev")
    torch.backends.cuda.matmul.allow_tf32 = True  # as training leaves it, before `eyas run`'s eval
    try:
        out = run_eval(EvalOptions(draft=str(tiny_folder / "draft"), **kw), log=logs.append)
        assert torch.backends.cuda.matmul.allow_tf32  # given back as it was
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    data = json.loads((out / "report.json").read_text())
    assert data["meta"]["tf32"] is False  # float32 verified in float32, not TF32: exact
    assert set(data["results"]["mtbench"]) == {BASELINE, "chain-1", "chain-2", "tree-6:2:3"}
    assert data["results"]["mtbench"]["chain-2"]["identical_to_target"] == 1.0
    assert len(data["records"]) == 2 * 2 * 4  # 2 questions x 2 turns x (target + 3 methods)
    assert (out / "tau_vs_k.png").is_file() and (out / "manifest.json").is_file()
    # one request at a time: the serving rows are the batch-1 table's, and no curve is drawn
    assert [(r["batch_size"], r["method"]) for r in data["serving"]] == [(1, m) for m in data["results"]["all"]]
    assert not (out / "serving_curve.png").exists() and "Serving curve" not in (out / "report.md").read_text()
    check_speed_words(in_words(data, {}, tmp_path), data)  # the quickstart's closing words, from this real run
    older = {k: v for k, v in data.items() if k != "serving"}  # a report written before the serving curve
    assert in_words(older, {}, tmp_path) == in_words(data, {}, tmp_path)
    assert not (tmp_path / ("ev" + PARTIAL_SUFFIX)).exists()
    # MT-Bench turn 2 is asked after the model's own turn-1 answer, with the chat template
    tok = AutoTokenizer.from_pretrained(tiny_folder / "target")
    q = mtbench_set(1).items[0]
    recs = {(r["turn"], r["method"]): r for r in data["records"] if r["item"] == q.id}
    answer = recs[(0, BASELINE)]["answer"]
    turn2 = render_prompt(tok, [{"role": "user", "content": q.turns[0]}, {"role": "assistant", "content": answer},
                                {"role": "user", "content": q.turns[1]}])
    assert recs[(1, "chain-1")]["prompt_tokens"] == len(turn2)
    # same inputs and options: reused
    logs.clear()
    run_eval(EvalOptions(draft=str(tiny_folder / "draft"), **kw), log=logs.append)
    assert any("up to date" in line for line in logs)
    # a new --compare on an up-to-date run only redraws the report against the other run
    other = write_report(EvalResult.from_dict(data), tmp_path / "other", label="older")
    run_eval(EvalOptions(draft=str(tiny_folder / "draft"), compare=[str(other)], label="newer", **kw),
             log=logs.append)
    assert "tau older" in (out / "report.md").read_text() and "# eyas eval: newer" in (out / "report.md").read_text()
    # a killed run resumes from its partial records
    partial = tmp_path / ("ev" + PARTIAL_SUFFIX)
    manifest = json.loads((out / "manifest.json").read_text())
    kept = data["records"][:5]
    partial.write_text("\n".join(json.dumps(x) for x in [{"options_sha256": manifest["options_sha256"]}, *kept]) + "\n")
    logs.clear()
    run_eval(EvalOptions(draft=str(tiny_folder / "draft"), force=True, **kw), log=logs.append)
    assert any("resuming: 5 generations" in line for line in logs)
    resumed = json.loads((out / "report.json").read_text())
    assert len(resumed["records"]) == 16 and resumed["records"][:5] == kept  # the first five taken from the partial
    assert resumed["results"]["mtbench"][BASELINE]["generations"] == 4


def test_eval_resumes_after_a_torn_line_and_a_second_kill(tiny_folder, tmp_path, monkeypatch):
    """A kill can cut the partial file's last line. The next run keeps what came before it and appends
    on a line of its own, so a second kill loses nothing the resumed run had finished."""
    import eyas.eval.runner as runner
    from eyas.recipes.evaluate import PARTIAL_SUFFIX, EvalOptions, run_eval

    logs: list[str] = []
    kw = dict(model=str(tiny_folder / "target"), prompts="mtbench", chain="1,2", tree="6:2:3", max_new_tokens=6,
              max_prompts=2, out=tmp_path / "ev")
    first = run_eval(EvalOptions(draft=str(tiny_folder / "draft"), **kw), log=logs.append)
    full = json.loads((first / "report.json").read_text())
    sha = json.loads((tmp_path / "ev" / "manifest.json").read_text())["options_sha256"]
    partial = tmp_path / ("ev" + PARTIAL_SUFFIX)
    kept = full["records"][:5]
    torn = json.dumps(full["records"][5])[:40]  # the sixth record, cut by the kill
    partial.write_text("\n".join(json.dumps(x) for x in [{"options_sha256": sha}, *kept]) + "\n" + torn)

    original = runner.evaluate_draft

    def killed_after_three(*args, on_record=None, **kwargs):
        seen = []

        def record(rec):
            on_record(rec)
            seen.append(rec)
            if len(seen) == 3:
                raise KeyboardInterrupt  # the second kill, after three more generations were saved

        return original(*args, on_record=record, **kwargs)

    monkeypatch.setattr(runner, "evaluate_draft", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        run_eval(EvalOptions(draft=str(tiny_folder / "draft"), force=True, **kw), log=logs.append)
    monkeypatch.setattr(runner, "evaluate_draft", original)
    logs.clear()
    run_eval(EvalOptions(draft=str(tiny_folder / "draft"), force=True, **kw), log=logs.append)
    assert any("resuming: 8 generations" in line for line in logs), logs
    resumed = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert len(resumed["records"]) == 16 and resumed["records"][:5] == kept
    assert not partial.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the words on a GPU need a GPU run")
def test_closing_words_on_a_gpu_name_the_card_and_batch_size(tiny_folder, tmp_path):
    """On a GPU the closing words give the speedup measured, at which batch size and on which card, without the
    CPU's explanation."""
    from eyas.recipes.evaluate import EvalOptions, run_eval

    out = run_eval(EvalOptions(draft=str(tiny_folder / "draft"), model=str(tiny_folder / "target"), prompts="mtbench",
                               chain="2", tree="none", max_new_tokens=16, max_prompts=2, device="cuda",
                               out=tmp_path / "ev"), log=lambda s: None)
    report = json.loads((out / "report.json").read_text())
    words = in_words(report, {}, tmp_path)
    check_speed_words(words, report)
    assert torch.cuda.get_device_name() in words and "on a CPU" not in words


def test_batch_sizes_are_checked_where_they_are_given(tiny_folder, tmp_path):
    """--batch-size takes comma-separated whole numbers, each at most once, greedy or sampled, and a batch larger
    than the run's requests is refused before anything loads."""
    from eyas.recipes.evaluate import EvalOptions, run_eval

    assert EvalOptions(draft="random").batch_sizes == [1]
    assert EvalOptions(draft="random", engine="vllm", batch_sizes=[16, 1, "4"]).batch_sizes == [1, 4, 16]
    for bad, message in (([0], "between 1 and"), ([1, 1], "given twice"), ([], "at least one"), ([2.5], "whole"),
                         ([True], "whole")):
        with pytest.raises(EyasError, match=message):
            EvalOptions(draft="random", engine="vllm", batch_sizes=bad)
    assert EvalOptions(draft="random", batch_sizes=[4, 1], temperature=0.7).batch_sizes == [1, 4]  # sampled too
    res = subprocess.run([sys.executable, "-m", "eyas.cli", "eval", "--draft", "random", "--backend", "vllm",
                          "--batch-size", "1,four"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--batch-size '1,four'" in res.stderr and "Traceback" not in res.stderr, res.stderr
    with pytest.raises(EyasError, match="--batch-size 8: the prompts give 2 requests"):
        run_eval(EvalOptions(draft=str(tiny_folder / "draft"), model=str(tiny_folder / "target"), prompts="mtbench",
                             max_prompts=1, engine="vllm", batch_sizes=[1, 8], out=tmp_path / "ev"))


def test_eval_names_a_missing_draft_folder(tiny_folder, tmp_path):
    """A mistyped --draft is named with what to give instead, not a FileNotFoundError traceback."""
    from eyas.recipes.evaluate import EvalOptions, run_eval

    with pytest.raises(EyasError, match=r"--draft .*nowhere does not exist: give the folder `eyas train` wrote"):
        run_eval(EvalOptions(draft=str(tmp_path / "nowhere"), model=str(tiny_folder / "target"), prompts="mtbench",
                             chain="1", max_new_tokens=2, max_prompts=1, out=tmp_path / "ev"), log=lambda m: None)


def test_tree_spec_parsing():
    assert TreeSpec.parse("60:7:10") == TreeSpec(60, 7, 10) and TreeSpec(60, 7, 10).name == "tree-60:7:10"
    for bad in ("60:7", "a:b:c", "0:7:10"):
        with pytest.raises(ValueError):
            TreeSpec.parse(bad)


def test_evalresult_rejects_foreign_json():
    with pytest.raises(EyasError):
        EvalResult.from_dict({"format": "something-else"})


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"eagle3"}))
def test_random_draft_and_the_untrained_baseline_are_the_family_evaluated(tiny_folder, tmp_path, family):
    """`eyas eval --draft random --family X` and `eyas run`'s untrained baseline build a draft of X (they
    built EAGLE-3 whatever the family, and the eval stage of a DFlash or P-EAGLE run failed)."""
    from eyas.model.families import build_draft, draft_class, load_draft
    from eyas.model.family_facts import family_part
    from eyas.recipes.evaluate import EvalOptions, random_draft, run_eval
    from eyas.recipes.run import make_untrained_draft

    target = LlamaForCausalLM.from_pretrained(tiny_folder / "target")
    random = random_draft(str(tiny_folder / "target"), target, family)
    assert isinstance(random, family_part(family, "model")) and random.config.family == family
    out = run_eval(EvalOptions(draft="random", family=family, model=str(tiny_folder / "target"), prompts="mtbench",
                               chain="2", tree="none", max_new_tokens=4, max_prompts=1, max_turns=1, baseline=True,
                               out=tmp_path / "ev"), log=lambda m: None)
    assert json.loads((out / "report.json").read_text())["results"]["mtbench"]["chain-2"]["identical_to_target"] == 1

    trained = build_draft(random.config)
    trained.load_state_dict(random.state_dict())
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.add_(1.0)  # "trained": every trainable tensor moved
    trained.save_pretrained(tmp_path / "trained")
    # `eyas eval` of the family's folder on the default methods (eyas run's eval stage): its chains, no tree
    out = run_eval(EvalOptions(draft=str(tmp_path / "trained"), model=str(tiny_folder / "target"), prompts="mtbench",
                               chain="2", max_new_tokens=4, max_prompts=1, max_turns=1, out=tmp_path / "ev-trained"),
                   log=lambda m: None)
    results = json.loads((out / "report.json").read_text())["results"]["mtbench"]
    assert results["chain-2"]["identical_to_target"] == 1 and not any(m.startswith("tree") for m in results)
    with pytest.raises(EyasError, match="chains only"):  # a tree asked for is refused, not dropped
        run_eval(EvalOptions(draft=str(tmp_path / "trained"), model=str(tiny_folder / "target"), prompts="mtbench",
                             chain="2", tree="8:2:4", max_new_tokens=4, max_prompts=1, max_turns=1,
                             out=tmp_path / "ev-tree"), log=lambda m: None)
    make_untrained_draft(tmp_path / "trained", tmp_path / "untrained")
    before = load_draft(tmp_path / "untrained")
    assert type(before) is draft_class(random.config) and before.config == trained.config
    after = trained.state_dict()
    frozen = {n for n, p in trained.named_parameters() if not p.requires_grad} | dict(trained.named_buffers()).keys()
    for name, tensor in before.state_dict().items():
        assert torch.equal(tensor, after[name]) == (name in frozen), name
