"""`torchrun` with 2 CPU processes on gloo (DDP, and FSDP2 `fully_shard`): the loss curve equals
the one-process loss on the same global batch (one process accumulating both ranks' batches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _train_utils import make_store

from eyas.model.draft import Eagle3Draft

ARGS = ["--max-steps", "3", "--ttt-steps", "3", "--token-budget", "256", "--draft-vocab-size", "48",
        "--num-workers", "0", "--log-every", "1", "--report-to", "none", "--save-every", "0", "--lr", "3e-3",
        "--device", "cpu", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process, 2 micro-batches per step (= 2 ranks x 1)."""
    root = tmp_path_factory.mktemp("dist")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, _, store = make_store(root)
        out = root / "single"
        subprocess.run([sys.executable, "-m", "eyas.cli", "train", "--store", str(store), "--out", str(out),
                        "--grad-accum", "2", *ARGS], check=True, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "EYAS_NO_PROGRESS": "1"}, timeout=300)
    finally:
        torch.set_num_threads(n)
    return store, out


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_match_one(single, tmp_path, mode):
    store, ref = single
    out = tmp_path / mode
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "eyas.cli", "train", "--store", str(store), "--out", str(out), "--grad-accum", "1", *ARGS]
    if mode == "fsdp":
        cmd.append("--fsdp")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "EYAS_NO_PROGRESS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = rows(ref), rows(out)
    assert [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert y["valid_tokens"] == x["valid_tokens"] and y["acc"] == x["acc"]
        assert abs(y["loss"] - x["loss"]) / x["loss"] < 1e-5, (x["step"], x["loss"], y["loss"])
        assert abs(y["grad_norm"] - x["grad_norm"]) / x["grad_norm"] < 1e-4
    assert a[0]["loss"] != a[-1]["loss"]  # the steps really trained
    w_ref = Eagle3Draft.from_pretrained(ref / "draft").state_dict()
    w = Eagle3Draft.from_pretrained(out / "draft").state_dict()
    for k in w_ref:
        assert torch.allclose(w[k], w_ref[k], atol=1e-4), k
