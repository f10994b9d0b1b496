"""`eyas run`: configs are validated up front, and a tiny real pipeline runs end to end and resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eyas.recipes.run import load_config, plan_pipeline, run_pipeline
from eyas.utils.io import EyasError, read_json

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_name_only_real_options(path):
    cfg = load_config(path)
    stages = plan_pipeline(cfg, path)  # every section checked against its stage's schema: names and types
    assert [s.name for s in stages][-4:] == ["extract" if not cfg.online else "prepare", "train", "export", "eval"]
    text = path.read_text()
    assert "Disk" in text and "Time" in text, "configs carry disk and time estimates"


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
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    summary = run_pipeline(load_config(path), path)
    work = tmp_path / "run"
    assert (work / "export" / "vllm" / "model.safetensors").is_file()
    assert (work / "eval" / "trained" / "report.md").is_file()
    assert summary["tau_trained"] and all(t >= 1.0 for t in summary["tau_trained"].values())
    assert summary["serve"].startswith("vllm serve") and "--speculative-config" in summary["serve"]
    state = read_json(work / "run_state.json")
    assert set(state) == {"prepare", "extract", "train", "export", "eval"}
    capsys.readouterr()
    run_pipeline(load_config(path), path)  # nothing changed: every stage is skipped
    err = capsys.readouterr().err
    assert err.count("up to date, skipped") == 5
