"""`eyas bundle`: a config's target, data and eyas itself packed for an offline node; unpacked elsewhere
from its tar parts, the run there is killed twice and resumed, and ends with the draft a direct run makes."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time

import pytest
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eyas.recipes.bundle import BundleOptions, run_bundle
from eyas.recipes.run import load_config, run_pipeline
from eyas.utils.io import EyasError, read_json, sha256_file

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("bundle")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                      eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    with open(root / "chats.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Count to {i + 3}, please."},
                                             {"role": "assistant", "content": " ".join(map(str, range(i + 3)))}]})
                    + "\n")
    (root / "questions.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["Count to five."]}) + "\n")
    config = {"target": str(root / "target"), "workdir": str(root / "direct"),
              "prepare": {"inputs": [str(root / "chats.jsonl")], "max_length": 96, "num_workers": 1},
              "extract": {"dtype": "float32", "device": "cpu"},
              "train": {"ttt_steps": 2, "draft_vocab_size": 400, "max_steps": 8, "token_budget": 256,
                        "num_workers": 0, "save_every": 2, "lr": 0.001, "report_to": "none", "device": "cpu"},
              "eval": {"prompts": f"q={root / 'questions.jsonl'}", "max_prompts": 1, "max_turns": 1,
                       "max_new_tokens": 6, "chain": "2", "tree": "none", "device": "cpu"}}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return root, path


def test_a_bundled_run_killed_twice_ends_where_a_direct_run_ends(setup, tmp_path):
    root, config = setup
    run_pipeline(load_config(config), config)
    direct = load_file(str(root / "direct" / "train" / "draft" / "model.safetensors"))

    out = tmp_path / "b"
    run_bundle(BundleOptions(config=config, out=out, workdir=False, part_mb=3), log=lambda m: None)
    manifest = read_json(out / "manifest.json")
    assert {"config.yaml", "README.md", "assets/target/config.json", "assets/prompts/questions.jsonl"} <= \
        set(manifest["files"]) | {"manifest.json"}
    assert any(name.startswith("wheels/eyas-") and name.endswith(".whl") for name in manifest["files"])
    for name, meta in manifest["files"].items():
        assert sha256_file(out / name) == meta["sha256"], name
    parts = sorted(tmp_path.glob("b.tar.*"))
    assert len(parts) > 1 and all(p.stat().st_size <= 3 << 20 for p in parts)

    node = tmp_path / "node"  # elsewhere: only the parts arrive, joined as `cat b.tar.* | tar -x` does
    node.mkdir()
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r|") as tar:
        tar.extractall(node, filter="data")
    here = node / "b"
    assert yaml.safe_load((here / "config.yaml").read_text())["target"] == "assets/target"
    env = {**os.environ, "EYAS_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "eyas.cli", "run", "config.yaml"]
    rng = random.Random(7)
    for _ in range(2):  # killed at a seeded point, as a time limit kills a job
        proc = subprocess.Popen(cmd, cwd=here, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(8, 25))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    bundled = load_file(str(here / "work" / "train" / "draft" / "model.safetensors"))
    assert set(bundled) == set(direct)
    for k, v in direct.items():
        assert bundled[k].equal(v), k
    taus = [read_json(w / "eval" / "trained" / "report.json")["results"]["all"]["chain-2"]["tau"]
            for w in (root / "direct", here / "work")]
    assert taus[0] == taus[1]


def test_bundle_refuses_what_cannot_travel(setup, tmp_path):
    root, config = setup
    bad = tmp_path / "hub.yaml"
    bad.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "target": "someorg/not-on-this-disk"}))
    with pytest.raises(EyasError, match="is not a local folder"):
        run_bundle(BundleOptions(config=bad, out=tmp_path / "x"), log=lambda m: None)
    assert not (tmp_path / "x").exists()
    with pytest.raises(EyasError, match="--part-mb must be >= 0"):
        BundleOptions(config=config, out=tmp_path / "y", part_mb=-1)
