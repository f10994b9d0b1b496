"""`eyas run`: configs are validated up front, and a tiny real pipeline runs end to end and resumes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from _eval_utils import check_speed_words

from eyas.recipes.run import build_stages, in_words, load_config, run_pipeline
from eyas.utils.io import EyasError, read_json

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_name_only_real_options(path, capsys):
    cfg = load_config(path)
    stages = build_stages(cfg, path, refuse=False)  # every section checked against its stage's schema
    names = [s.name for s in stages]
    names = names[:-1] if names[-1] == "serving" and cfg.serving else names  # the optional serving stage
    assert names[-4:] == ["extract" if not cfg.online else "prepare", "train", "export", "eval"]
    from typer.testing import CliRunner

    from eyas.cli import app  # `eyas plan` prints every stage's disk and time, in seconds, without weights

    t0 = time.perf_counter()
    out = CliRunner().invoke(app, ["plan", str(path)])
    assert out.exit_code == 0, out.output
    assert time.perf_counter() - t0 < 90  # seconds, not the minutes a weight load takes (slack for a busy machine)
    blocks = out.output.split("\n\n")[1:-1]
    assert [b.split(":")[0].split(",")[0] for b in blocks] == [s.name for s in stages]
    assert all("  Disk: " in b and "  Time: " in b for b in blocks), out.output


def test_bad_config_says_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: smollm2\ntrain:\n  lr: [1\n")
    with pytest.raises(EyasError, match=r"bad.yaml:\d+: not valid YAML"):
        load_config(bad)
    bad.write_text("target: smollm2\ntrian: {}\n")
    with pytest.raises(EyasError, match="unknown top-level key.*trian"):
        load_config(bad)


def test_tiny_pipeline_end_to_end_and_rerun_skips(tmp_path, smollm2_dir, capsys):
    cfg = {
        "target": "smollm2",
        "workdir": str(tmp_path / "run"),
        "prepare": {"inputs": ["dummy"], "max_samples": 24, "max_length": 96},
        "extract": {"dtype": "float32"},
        "train": {"ttt_steps": 2, "draft_vocab_size": 2000, "max_steps": 6, "token_budget": 1024,
                  "num_workers": 0, "lr": 0.001},
        "eval": {"prompts": "mtbench", "max_prompts": 1, "max_turns": 1, "max_new_tokens": 8, "chain": "2",
                 "tree": "none"},
        "serving": {"max_prompts": 2, "batch_sizes": [1, 2], "sweep": False},  # the eval's options, overridden
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    summary = run_pipeline(load_config(path), path)
    work = tmp_path / "run"
    assert (work / "export" / "vllm" / "model.safetensors").is_file()
    assert (work / "eval" / "trained" / "report.md").is_file()
    assert summary["tau_trained"] and all(t >= 1.0 for t in summary["tau_trained"].values())
    assert summary["serve"].startswith("vllm serve") and "--speculative-config" in summary["serve"]
    served = read_json(work / "serving" / "report.json")  # the speed in the closing words is the serving stage's
    assert {r["batch_size"] for r in served["serving"]} == {1, 2}
    assert served["meta"]["max_new_tokens"] == 8 and served["meta"]["prompts"] == "mtbench"  # the eval's own
    check_speed_words(summary["in_words"], served)
    state = read_json(work / "run_state.json")
    assert set(state) == {"prepare", "extract", "train", "export", "eval", "serving"}
    capsys.readouterr()
    run_pipeline(load_config(path), path)  # nothing changed: every stage is skipped
    err = capsys.readouterr().err
    assert err.count("up to date, skipped") == 6


def test_train_schedules_chain_drafts_and_rerun_only_what_changed(tmp_path):
    """`train: {schedules: [...]}`: schedule i starts from schedule i-1's draft with its own options; a
    finished schedule is up to date, and changing one reruns it and those after it only."""
    import shutil

    from _train_utils import make_store

    from eyas.recipes.run import RunConfig
    from eyas.utils.io import fingerprint_path

    target, _, store = make_store(tmp_path / "data")
    common = {"draft_vocab_size": 48, "ttt_steps": 2, "token_budget": 256, "num_workers": 0, "report_to": "none",
              "log_every": 1, "save_every": 0}

    def plan(second_lr):
        schedules = [{"max_steps": 3, "lr": 3e-3}, {"max_steps": 2, "lr": second_lr}]
        cfg = RunConfig(target=str(target), workdir=tmp_path / "run", train={**common, "schedules": schedules})
        return next(s for s in build_stages(cfg, tmp_path / "x.yaml") if s.name == "train")

    shutil.copytree(store, tmp_path / "run" / "store")
    stage = plan(1e-3)
    first, second = stage.options
    assert second.init_draft == first.out / "draft" and first.init_draft is None
    stage.run()
    m0, m1 = (read_json(o.out / "manifest.json") for o in stage.options)
    assert m0["steps"] == 3 and m1["steps"] == 2
    assert m1["options"]["init"] == fingerprint_path(first.out / "draft")  # trained on from the first draft
    stamp = (first.out / "manifest.json").stat().st_mtime_ns
    plan(5e-4).run()  # only the second schedule changed
    assert (first.out / "manifest.json").stat().st_mtime_ns == stamp
    assert read_json(second.out / "manifest.json")["options"]["train"]["lr"] == 5e-4
    with pytest.raises(EyasError, match="train.schedules must be a list of option mappings"):
        build_stages(RunConfig(target=str(target), train={"schedules": "fast"}), tmp_path / "x.yaml")
    with pytest.raises(EyasError, match=r"train.schedules\[1\].lr = 'quick': expected a number"):
        build_stages(RunConfig(target=str(target), train={"schedules": [{}, {"lr": "quick"}]}), tmp_path / "x.yaml")


WRONG_TYPES = {  # what a hurried config holds -> what the one error line must say
    "text for a number": ({"train": {"lr": "fast"}}, r"train\.lr = 'fast': expected a number"),
    "a number for text": ({"eval": {"prompts": 5}}, r"eval\.prompts = 5: expected text"),
    "text for a list": ({"prepare": {"inputs": "dummy"}}, r"prepare\.inputs = 'dummy': expected a list of text"),
    "text for a list (eval)": ({"eval": {"compare": "runs/a/report.json"}}, r"eval\.compare = .*expected a list"),
}


def test_wrong_types_in_a_config_stop_eyas_run_before_any_stage(tmp_path):
    """`eyas run` on a real file: one clear line naming the file, the key, the value and the type wanted,
    exit code 2, no traceback, and no stage ran (the work folder is not even made)."""
    procs = {}
    for name, (section, _) in WRONG_TYPES.items():
        path = tmp_path / f"{name.replace(' ', '_')}.yaml"
        path.write_text(yaml.safe_dump({"target": "smollm2", "workdir": str(tmp_path / name), **section}))
        procs[name] = (path, subprocess.Popen([sys.executable, "-m", "eyas.cli", "run", str(path)], text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              env={**os.environ, "EYAS_NO_PROGRESS": "1"}))
    for name, (path, proc) in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (name, err)
        assert "Traceback" not in err and err.count("eyas: error:") == 1 and len(err.strip().splitlines()) == 1, err
        assert str(path) in err and re.search(WRONG_TYPES[name][1], err), (name, err)
        assert not (tmp_path / name).exists(), f"{name}: a stage ran"


def test_yaml_reads_1e_4_as_text_and_the_schema_takes_it_as_the_number(tmp_path):
    path = tmp_path / "lr.yaml"
    path.write_text(f"target: smollm2\nworkdir: {tmp_path / 'w'}\ntrain:\n  lr: 1e-4\n  warmup_ratio: 5e-2\n")
    assert yaml.safe_load(path.read_text())["train"]["lr"] == "1e-4"  # YAML 1.1 wants a dot: this is text
    train = next(s for s in build_stages(load_config(path), path) if s.name == "train")
    opts = train.options[-1] if isinstance(train.options, list) else train.options
    assert opts.lr == 1e-4 and isinstance(opts.lr, float)


def test_the_summary_says_so_when_nothing_was_measured(tmp_path):
    assert "nothing to summarize" in in_words({"meta": {}, "results": {"all": {}}}, {}, tmp_path)


def test_the_eval_section_takes_batch_sizes(tmp_path):
    """`eval: {batch_sizes: ...}` is `eyas eval --batch-size`: the same parsing and the same checks, before any
    stage runs."""
    def eval_options(section: str):
        path = tmp_path / "c.yaml"
        path.write_text(f"target: smollm2\nworkdir: {tmp_path / 'w'}\neval:\n{section}")
        return next(s for s in build_stages(load_config(path), path) if s.name == "eval").options

    assert eval_options("  backend: vllm\n  batch_sizes: 16, 1,4\n").batch_sizes == [1, 4, 16]
    assert eval_options("  backend: vllm\n  batch_sizes: [1, 64]\n").batch_sizes == [1, 64]
    assert eval_options("  chain: '3'\n").batch_sizes == [1]
    assert eval_options("  batch_sizes: 4,1\n").batch_sizes == [1, 4]
    assert eval_options("  batch_sizes: 1,4\n  temperature: 0.7\n").batch_sizes == [1, 4]  # sampled batches too
    with pytest.raises(EyasError, match=r"c.yaml: eval.*batch.size"):
        eval_options("  backend: vllm\n  batch_sizes: [0]\n")
