"""The command line: every stage is there with a --help that explains its options."""

from __future__ import annotations

import subprocess
import sys

import pytest

STAGES = ["prepare", "regenerate", "extract", "train", "export", "eval", "run", "plan", "bundle"]


def eyas(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eyas.cli", *args], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})


def test_top_level_help_lists_every_stage():
    out = eyas("--help")
    assert out.returncode == 0
    for stage in STAGES:
        assert stage in out.stdout


@pytest.mark.parametrize("stage", STAGES)
def test_stage_help(stage):
    out = eyas(stage, "--help")
    assert out.returncode == 0, out.stderr
    assert "Usage" in out.stdout and "--help" in out.stdout
    assert "not built yet" not in out.stdout, f"eyas {stage} is still a stub"


def test_tensor_parallel_eval_is_vllms_and_says_so():
    """`--tp` spreads the target over GPUs through vLLM; with the one-device hf backend it is refused in words."""
    out = eyas("eval", "--draft", "random", "--tp", "2", "--out", "/tmp/never-written")
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr
    assert "--engine vllm" in out.stdout + out.stderr


def test_old_spellings_of_the_target_runner_still_work_with_a_note(tmp_path):
    """`--backend` (eval) became `--engine`, the one word for what runs the target: the old flag and YAML key
    are still read, and say they are deprecated."""
    out = eyas("eval", "--draft", "random", "--backend", "hf", "--tp", "2", "--out", "/tmp/never-written")
    assert out.returncode != 0 and "--engine vllm" in out.stdout + out.stderr  # parsed as --engine hf
    assert "--backend is now --engine" in out.stderr
    from eyas.recipes.evaluate import EvalOptions
    from eyas.utils.schema import from_mapping

    assert from_mapping(EvalOptions, {"draft": "random", "backend": "vllm"}, "run.yaml: eval").engine == "vllm"
