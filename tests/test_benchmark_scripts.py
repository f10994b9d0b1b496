"""Pieces of the analysis scripts under benchmarks/ that read user data: what they keep, and a clear
error when nothing is usable; and the training benchmark's same-run peer, driven from its source."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from eyas.assets import cache_dir
from eyas.data.chat import ChatEncoder
from eyas.data.readers import SkipLog, read_conversations
from eyas.utils.io import EyasError

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def test_acceptance_by_position_keeps_the_first_turns_and_names_unusable_data(tmp_path, smollm2_dir):
    abp = load_script("acceptance_by_position")
    assert abp.reply_positions(torch.tensor([0, 1, 1, 1, 0, 0, 1, 1])).tolist() == [-1, 0, 1, 2, -1, -1, 0, 1]

    encoder = ChatEncoder(AutoTokenizer.from_pretrained(smollm2_dir))
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
            {"role": "user", "content": "More?"}, {"role": "assistant", "content": "Yes, more."}]
    (one,) = abp.encode_turns(encoder, [conv], 1, "chat.jsonl", SkipLog())
    assert one.input_ids.tolist() == encoder.encode(conv[:2]).input_ids.tolist()
    (both,) = abp.encode_turns(encoder, [conv], 2, "chat.jsonl", SkipLog())
    assert both.input_ids.tolist() == encoder.encode(conv).input_ids.tolist()

    questions = tmp_path / "questions.jsonl"  # prompts only, as MT-Bench ships them: nothing to measure
    questions.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                                 for q in ("a", "b")))
    log = SkipLog()
    convs = read_conversations([str(questions)], log)
    with pytest.raises(EyasError, match=r"questions\.jsonl: no conversation with an assistant reply.*no_assistant"):
        abp.encode_turns(encoder, convs, 1, str(questions), log)


def test_acceptance_by_position_splits_step_0_by_the_targets_confidence(smollm2_dir, capsys):
    """The confidence table partitions exactly the tokens and hits of step 0 (first band and all), and
    its bins follow the target's own top-1 probability at each predicted token."""
    from eyas.eval.target import HFTarget
    from eyas.generate import load_generator
    from eyas.recipes.evaluate import load_draft

    abp = load_script("acceptance_by_position")
    model, tokenizer = load_generator(str(smollm2_dir), "float32")
    # a short, unlikely reply: the target is unsure at some of its tokens and sure at others
    conv = [{"role": "user", "content": "Name three colors."},
            {"role": "assistant", "content": "Mauve, red, and the colour of a quiet evening sky."}]
    encoded = abp.encode_turns(ChatEncoder(tokenizer), [conv], 1, "chat", SkipLog())
    draft = load_draft("random", str(smollm2_dir), model, model.device, model.dtype).eval()
    target = HFTarget(model, list(draft.config.aux_layer_ids))
    try:
        correct, count, _, by_conf, n_conf = abp.measure(draft, target, encoded, 2, 16, 2)
        ids = torch.as_tensor(encoded[0].input_ids)[None]
        logits, _ = target.forward(ids, torch.arange(ids.shape[1])[None], target.new_cache())
    finally:
        target.close()
    assert torch.equal(n_conf.sum(1), torch.stack([count[0, 0], count[-1, 0]]))
    assert torch.equal(by_conf.sum(1), torch.stack([correct[0, 0], correct[-1, 0]]))
    # independently: step 0 predicts each trained token from two positions back, i.e. the target's
    # distribution one position back; bin those top-1 probabilities by hand
    mask = torch.as_tensor(encoded[0].loss_mask).bool()
    top1 = torch.softmax(logits.float(), -1).amax(-1)
    tok = torch.arange(2, ids.shape[1])[mask[2:]]
    expect = torch.zeros(len(abp.CONFIDENCE_EDGES) + 1)
    for p in top1[tok - 1].tolist():
        expect[sum(p >= e for e in abp.CONFIDENCE_EDGES)] += 1
    assert torch.equal(n_conf[1], expect) and expect.count_nonzero() >= 3, expect

    # the side-by-side row of several drafts: step 0 of the first band, of all tokens, then the first
    # band's confidence bins; a draft half as good reads 0.50x in every column it has tokens in
    row = abp.step0_row(correct, count, by_conf, n_conf)
    assert row.shape == (2 + len(abp.CONFIDENCE_EDGES) + 1,)
    assert row[0] == correct[0, 0] / count[0, 0] and row[1] == correct[-1, 0] / count[-1, 0]
    assert torch.equal(row[2:], by_conf[0] / n_conf[0].clamp_min(1))
    abp.print_comparison(["a", "b"], [torch.full_like(row, 0.4), torch.full_like(row, 0.2)], 16)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "| b / first | " + " | ".join(["0.50x"] * row.numel()) + " |"
    assert lines[1].count("|") == lines[-1].count("|") and "0-15, p 0.9-1" in lines[1]


def peer_source() -> Path | None:
    """SpecForge 0.2.0's source: $EYAS_PEER_SRC, else the copy scripts/test.sh unpacks into the cache."""
    path = Path(os.environ.get("EYAS_PEER_SRC") or cache_dir() / "specforge-0.2.0")
    return path if (path / "specforge" / "__init__.py").is_file() else None


def test_a_peer_version_that_cannot_be_driven_says_why_and_leaves_nothing_behind(tmp_path):
    peer_module = load_script("specforge_peer")
    (tmp_path / "old" / "specforge").mkdir(parents=True)
    (tmp_path / "old" / "specforge" / "__init__.py").write_text("")  # a package without the step's modules
    path_before = list(sys.path)
    for where, why in ((tmp_path, "holds no specforge package"), (tmp_path / "old", "No module named 'specforge.")):
        peer = peer_module.SpecForge(f"label={where}")
        assert peer.label == "label" and peer.path == where.resolve()
        with pytest.raises(peer_module.PeerUnusable, match=why), peer.imported(torch.device("cpu")):
            pass
        assert sys.path == path_before and not any(n.split(".")[0] == "specforge" for n in sys.modules)
    with pytest.raises(ValueError, match="BACKEND"):
        peer_module.parse_variant("fa")


def test_repeated_figures_are_interleaved_and_judged_by_their_whole_range():
    """benchmarks/common.py: rounds rotate which case goes first, ratios pair draws of one round, and a ratio
    meets its goal only when its lowest draw does."""
    common = load_script("common")
    order: list[str] = []
    results = common.interleaved([lambda: order.append("a") or len(order), lambda: order.append("b") or len(order),
                                  lambda: order.append("c") or len(order)], 3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert results == [[1, 6, 8], [2, 4, 9], [3, 5, 7]]  # per case, in round order
    with pytest.raises(ValueError, match="repeats"):
        common.interleaved([lambda: 0], 0)

    s = common.spread([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.low, s.high, s.draws) == (2.5, 1.0, 10.0, 4)
    assert common.spread([24844.0]).show() == "24,844 (1 run)"
    assert common.spread([1.0, 1.5, 2.0]).show(".2f", "x") == "1.50x (1.00-2.00x, 3 runs)"

    # per round, not median over median: round 2's slow peer draw meets eyas' slow draw of the same round
    r = common.paired_ratio([130.0, 90.0, 128.0], [100.0, 72.0, 100.0])
    assert (r.median, r.low, r.high) == (1.28, 1.25, 1.3)
    with pytest.raises(ValueError, match="same round"):
        common.paired_ratio([1.0, 2.0], [1.0])

    assert common.verdict(r, 1.25) == "met"
    assert common.verdict(common.spread([1.2, 1.3, 1.4]), 1.25) == "not met (its range crosses the goal)"
    assert common.verdict(common.spread([1.07, 1.1, 1.2]), 1.25) == "not met"


@pytest.mark.skipif(peer_source() is None, reason="no SpecForge source: set EYAS_PEER_SRC or run scripts/test.sh")
def test_train_benchmark_runs_the_peers_own_step_beside_eyas_in_one_run(tmp_path):
    """`benchmarks/train.py --smoke --peer-src` on CPU: SpecForge's sdpa step (and its compact teacher) from
    its source, every case twice, interleaved, as medians with their ranges; same-run ratios per round and
    the goal line; a tree it cannot drive costs one line a round."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train.py"), "--smoke", "--repeats", "2",
           "--peer-src", f"v0.2.0={peer_source()}", "--peer-src", f"broken={tmp_path}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "EYAS_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT)})
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    lines = out.splitlines()
    assert out.count("peer v0.2.0: SpecForge 0.2.0 from") == 2
    assert out.count(f"peer broken: cannot be driven ({tmp_path} holds no specforge package)") == 2
    assert sum(line.startswith("  eyas tiny 256 eager: ") for line in lines) == 2
    for variant in ("sdpa, bare", "sdpa+compact, bare"):
        assert sum(line.startswith(f"  v0.2.0 tiny 256 {variant}: ") for line in lines) == 2
        assert any(line.startswith(f"| tiny | 256 | v0.2.0 | {variant} | ") and ", 2 runs) |" in line
                   and line.endswith("| yes |") for line in lines), out
        assert any(line.startswith(f"| tiny | 256 | eager | v0.2.0 | {variant} | ") and "x, 2 runs) |" in line
                   for line in lines), out
    assert "fastest peer case v0.2.0 sdpa" in out
    assert any(line.startswith("    eyas eager: ") and line.split("-> ")[-1].startswith(("met", "not met"))
               for line in lines), out
    assert any(line.startswith("| tiny | 256 | eager | ") and "%, 2 runs) |" in line for line in lines), out
    assert "Time to the first step: " in out


def test_online_benchmark_runs_end_to_end_on_cpu(tmp_path):
    """`benchmarks/online.py --smoke`: the serial and the online rows of one run, each drawn twice, their
    per-round ratio against the goal, and the peer's line (its FSDP-wrapped loop needs a GPU)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "online.py"), "--smoke", "--repeats", "2", "--work-dir",
           str(tmp_path), "--peer-src", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "EYAS_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT)})
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    serial = next(line for line in out.splitlines() if line.startswith("| serial: bare target forward, then the "))
    assert serial.count(", 2 runs)") == 2 and ">= 0.9x: " in serial  # the rate and the per-round ratio
    assert "| eyas online (TargetFeed + Trainer) | " in out
    assert "peer: not run: its loop wraps the draft in FSDP and needs a GPU" in out
    assert not list(tmp_path.iterdir())  # the prepared dataset of random tokens is gone


def test_families_benchmark_runs_every_family_on_cpu():
    """`benchmarks/families.py --smoke`: each draft family's training step runs, finite, with its ratio to
    EAGLE-3's in the same run."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "families.py"), "--smoke"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tiny |")]
    assert [r.split("|")[2].strip() for r in rows] == ["eagle3", "dflash", "peagle"]
    assert all(r.rstrip(" |").endswith("True") for r in rows) and "1.00x" in rows[0]


def test_extract_benchmark_draws_every_row_and_pairs_its_ratios(tmp_path):
    """`benchmarks/extract.py --smoke --repeats 2`: every row twice, as a median with its range, and its
    ratios to the bare forward and the naive loop per round (the bare forward's own: exactly 1)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "extract.py"), "--smoke", "--repeats", "2", "--samples", "8",
           "--work-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "EYAS_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[2].strip(): line for line in done.stdout.splitlines() if line.startswith("| tiny |")}
    assert list(rows) == ["bare forward", "naive e2e (torch.save)", "eyas e2e"]
    assert all(line.count(", 2 runs)") == 3 for line in rows.values()), rows
    assert "| 1.00 (1.00-1.00, 2 runs) |" in rows["bare forward"]
    assert "| 1.00 (1.00-1.00, 2 runs) |" in rows["naive e2e (torch.save)"]
    assert not list(tmp_path.iterdir())  # every store is gone


def test_train_benchmark_without_a_peer_reports_mfu_first_step_and_a_profile():
    """`benchmarks/train.py --smoke --profile eager` with no peer: eyas' row (median of one draw, MFU against
    the ceiling measured in the run, the time to its first step), the goal not judged, and where one
    step's time goes (the profiler's top operators, matrix products among them)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train.py"), "--smoke", "--repeats", "1", "--profile", "eager"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "EYAS_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT)})
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(line for line in out.splitlines() if line.startswith("| tiny | 256 | eager | "))
    assert "(1 run)" in row and "% (1 run)" in row and "| yes |" in row
    assert "256 tokens: no peer ran (--peer-src), not judged" in out
    assert "Time to the first step: " in out
    profile = out[out.index("Profile: eyas tiny 256 eager, 3 steps"):]
    assert "aten::mm" in profile


def tiny_chat_data(root: Path, tokenizer_dir: Path, store: bool = True) -> tuple[Path, Path]:
    """(a tiny random 6-layer chat target over SmolLM2's tokenizer, its prepared dummy chats); with `store`, also
    root/store extracted from them at aux layers 1, 3, 5 (not the defaults, so a draft that forgets its layers
    shows): what the quality benchmarks start from, made in-process and in seconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.recipes.extract import ExtractOptions, run_extract
    from eyas.recipes.prepare import PrepareOptions, run_prepare

    target, prepared = root / "target", root / "prepared"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                                 eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)).save_pretrained(target)
    tokenizer.save_pretrained(target)
    run_prepare(PrepareOptions(inputs=["dummy"], model=str(target), out=prepared, max_length=256, max_samples=24,
                               num_workers=1))
    if store:
        run_extract(ExtractOptions(prepared=prepared, out=root / "store", model=str(target), engine="hf",
                                   aux_layer_ids=[1, 3, 5], dtype="float32", device="cpu", preflight=False))
    return target, prepared


def run_script(name: str, *args: str) -> str:
    cmd = [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "EYAS_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def test_quality_duel_pairs_the_gain_over_one_per_seed_and_names_a_peer_that_accepted_nothing():
    duel = load_script("quality_duel")
    r = duel.gain_ratios([3.0, 2.5], [1.5, 1.25])  # tau - 1: 2.0 / 0.5 and 1.5 / 0.25
    assert (r.median, r.low, r.high, r.draws) == (5.0, 4.0, 6.0, 2)
    assert duel.gain_ratios([2.0, 2.0], [1.5, 1.0]) is None  # the second seed's peer draft accepted nothing


@pytest.mark.skipif(peer_source() is None, reason="no SpecForge source: set EYAS_PEER_SRC or run scripts/test.sh")
def test_quality_duel_trains_both_sides_for_the_budget_and_evaluates_the_peers_draft(tmp_path, smollm2_dir):
    """`benchmarks/quality_duel.py` on CPU, tiny: eyas and SpecForge's own training (from its source) each for
    the budget from one store, the peer's draft written in its layout and read by `eyas eval` with the
    store's aux layers, its report beside eyas', and the table of both sides' tau."""
    from safetensors import safe_open

    from eyas.model.checkpoints import import_draft

    target, _ = tiny_chat_data(tmp_path, smollm2_dir)
    out = run_script("quality_duel", "--out", str(tmp_path), "--peer-src", str(peer_source()), "--model", str(target),
                     "--budget-s", "2", "--goals", "2=3", "--seeds", "0", "--prompts", "dummy", "--max-prompts", "1",
                     "--max-new-tokens", "8", "--tree", "6:3:2", "--draft-vocab", "256", "--eval-dtype", "float32")
    peer = tmp_path / "B2" / "s0" / "peer"
    run = json.loads((peer / "draft" / "peer_run.json").read_text())
    assert run["version"] == "0.2.0" and (run["steps"] == 24 or run["seconds"] >= 2)  # its epoch's end or budget
    with safe_open(str(peer / "draft" / "model.safetensors"), framework="pt") as f:
        assert any(k.startswith("midlayer.") for k in f.keys())  # noqa: SIM118  SpecForge's own layout, not eyas'
    draft = import_draft(peer / "draft", target)
    assert draft.config.aux_layer_ids == [1, 3, 5]  # the store's, as its config names them
    report = json.loads((peer / "eval" / "report.json").read_text())
    assert report["meta"]["draft"] == str(peer / "draft") and report["results"]["all"]["chain-7"]["tau"] >= 1
    assert "| tau eyas |" in (peer / "eval" / "report.md").read_text()  # eyas' eval beside it, same options
    for side in ("eyas", "peer"):
        assert f"  {side} B=2s seed 0: " in out
    rows = [line for line in out.splitlines() if line.startswith("| 2 | ")]
    assert [r.split("|")[2].strip() for r in rows] == ["chain-7", "tree-6:3:2"]
    assert all(r.count("(1 run)") == 2 and "| >= 3x |" in r for r in rows), rows


def test_family_quality_trains_each_family_for_the_same_time_and_scores_the_serving_table(tmp_path, smollm2_dir):
    """`benchmarks/family_quality.py --store` on CPU, tiny: EAGLE-3 and DFlash each for the budget, each row with
    its steps, tau and the speedups of the serving table at batch 1 and 2, and the block-drafter goal judged."""
    target, _ = tiny_chat_data(tmp_path, smollm2_dir)
    out = run_script("family_quality", "--out", str(tmp_path / "runs"), "--store", str(tmp_path / "store"), "--model",
                     str(target), "--budget-s", "2", "--val-samples", "2", "--variants", "eagle3,dflash",
                     "--batch-sizes", "2", "--prompts", "dummy", "--max-prompts", "2", "--max-new-tokens", "8",
                     "--eval-dtype", "float32", "--train-args", "--draft-vocab-size 256")
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
            if line.startswith(("| eagle3 |", "| dflash |"))}
    assert list(rows) == ["eagle3", "dflash"]
    assert out.count(" --max-time 2 ") == 2  # the same budget for each
    batch1, tau = {}, {}
    for name, cells in rows.items():
        manifest = json.loads((tmp_path / "runs" / name / "manifest.json").read_text())
        assert int(cells[0]) == manifest["steps"] >= 1
        report = json.loads((tmp_path / "runs" / name / "eval" / "report.json").read_text())
        speedups = {r["batch_size"]: r["speedup"] for r in report["serving"] if r["method"] == cells[3].strip()}
        assert [c.strip() for c in cells[5:7]] == [f"{speedups[1]:.2f}x", f"{speedups[2]:.2f}x"]
        batch1[name] = speedups[1]
        tau[name] = report["results"]["all"][cells[3].strip()]["tokens_per_target_forward"]
    ratio, tau_ratio = batch1["dflash"] / batch1["eagle3"], tau["dflash"] / tau["eagle3"]
    assert f"goal: best block drafter dflash at {ratio:.2f}x EAGLE-3's batch-1 speedup (>= 1.3x): " in out
    assert f"; = {tau_ratio:.2f}x its tau / {tau_ratio / ratio:.2f}x its cost per verify step" in out


def test_int4_study_quantizes_attention_too_and_crosses_states_and_verifiers(tmp_path, smollm2_dir):
    """`benchmarks/int4_study.py` on CPU, tiny: the target packed W4A16 by compressed-tensors on every decoder linear
    (attention included; embedding and head kept), loaded quantized by transformers and close to the bf16 target;
    a draft trained on the INT4 target's states, verified by either target, a row per cell and method."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    target, _ = tiny_chat_data(tmp_path, smollm2_dir, store=False)
    out = run_script("int4_study", "--out", str(tmp_path), "--model", str(target), "--budget-s", "2", "--cells",
                     "int4>int4,int4>bf16", "--prompts", "dummy", "--max-prompts", "1", "--max-new-tokens", "8",
                     "--tree", "6:3:2", "--train-args", "--draft-vocab-size 256")
    int4 = tmp_path / "int4-target"
    with safe_open(str(int4 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118
    for layer in range(6):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                     "mlp.up_proj", "mlp.down_proj"):
            assert f"model.layers.{layer}.{proj}.weight_packed" in names
    assert "model.embed_tokens.weight" in names and not any("embed_tokens.weight_packed" in n for n in names)
    ids = torch.arange(1, 40)[None]
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(int4, dtype=torch.float32)(ids).logits
    assert 0 < (got - ref).abs().max() < 0.25 * ref.abs().max()  # quantized: near the bf16 target, not equal
    rows = [line for line in out.splitlines() if line.startswith("| int4 | ")]
    assert [r.split("|")[2:4] for r in rows] == [[" int4 ", " chain-7 "], [" int4 ", " tree-6:3:2 "],
                                                 [" bf16 ", " chain-7 "], [" bf16 ", " tree-6:3:2 "]]
    assert all(r.rstrip(" |").endswith("x") for r in rows), rows  # a speedup against the verifying target alone


def test_train_max_time_counts_the_commands_start_up(tmp_path):
    """The equal-time benchmarks rest on `eyas train --max-time` spending start-up from the budget: a command
    whose start lies past the budget stops at its first log step; one started now runs its schedule."""
    from _train_utils import TINY_EAGLE3, train_store

    from eyas.recipes.train import TrainOptions, TrainRecipe

    _, _, store = train_store(tmp_path / "data")
    results = []
    for out, started_ago in (("late", 1000.0), ("now", 0.0)):
        opts = TrainOptions(out=tmp_path / out, store=store, max_steps=4, max_time=500, **{**TINY_EAGLE3,
                                                                                           "log_every": 2})
        recipe = TrainRecipe(opts, log=lambda m: None)
        recipe.started -= started_ago  # as if its start-up had taken that long
        results.append(recipe.run())
    late, now = results
    assert not late["complete"] and late["steps"] == 2
    assert now["complete"] and now["steps"] == 4
def test_cold_start_benchmark_times_each_mode_in_a_fresh_process_on_cpu(tmp_path):
    """`benchmarks/cold_start.py --tiny`: each mode drawn in a process of its own with empty compile caches;
    the draft compiled in the background gives its first step before torch.compile has run, and reaches the
    compiled code later; the eager mode compiles nothing; the table has a row per mode."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cold_start.py"), "--tiny", "--repeats", "1", "--modes",
           "background,eager", "--detail", "--log-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "EYAS_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    draws = {line.split(":")[0].strip(): line for line in out.splitlines() if line.startswith("  ")}
    assert set(draws) == {"background", "eager"}, out

    def figures(line: str) -> tuple[float, float, int, float]:
        m = re.search(r"torch.compile ([\d.]+)s over \d+ graphs\); full speed after ([\d.]+)s \(step (\d+); "
                      r"torch.compile ([\d.]+)s", line)
        return float(m[1]), float(m[2]), int(m[3]), float(m[4])

    first_compile, _, steps, all_compile = figures(draws["background"])
    assert first_compile == 0.0 and steps > 1 and all_compile > 0, draws["background"]
    assert figures(draws["eager"])[3] == 0.0 and "NOT FINITE" not in out
    rows = [line for line in out.splitlines() if line.startswith(("| background |", "| eager |"))]
    assert len(rows) == 2 and all(line.count("(1 run)") == 8 for line in rows), rows
    logs = sorted(p.name for p in tmp_path.iterdir())
    assert logs == ["background-0.log", "eager-1.log"], logs  # one log per draw, named by mode and draw
