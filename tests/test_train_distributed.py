"""`torchrun` with 2 CPU processes on gloo (DDP, and FSDP2 `fully_shard`): the loss curve equals
the one-process loss on the same global batch (one process accumulating both ranks' batches), and
so does the validation on held-out samples."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _train_utils import make_store

from eyas.model.eagle3 import Eagle3Draft

ARGS = ["--max-steps", "3", "--ttt-steps", "3", "--token-budget", "256", "--draft-vocab-size", "48",
        "--num-workers", "0", "--log-every", "1", "--report-to", "none", "--save-every", "0", "--lr", "3e-3",
        "--device", "cpu", "--val-samples", "8"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "EYAS_NO_PROGRESS": "1"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return make_store(tmp_path_factory.mktemp("dist"))[2]
    finally:
        torch.set_num_threads(n)


_single: dict = {}


def single(store, tmp_path_factory, dtype):
    """The reference: one process, 2 micro-batches per step (= 2 ranks x 1 each)."""
    if dtype not in _single:
        out = tmp_path_factory.mktemp(f"single-{dtype}")
        subprocess.run([sys.executable, "-m", "eyas.cli", "train", "--store", str(store), "--out", str(out),
                        "--grad-accum", "2", "--dtype", dtype, *ARGS], check=True, capture_output=True, text=True,
                       env=ENV, timeout=300)
        _single[dtype] = out
    return _single[dtype]


def rows(out, kind="train"):
    """metrics.jsonl's training records, or its validation records (kind="val")."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["val"] for r in recs if "val" in r] if kind == "val" else [r for r in recs if "val" not in r]


@pytest.mark.parametrize("mode, dtype, tol", [("ddp", "fp32", 1e-5), ("fsdp", "fp32", 1e-5),
                                              ("ddp", "bf16", 3e-3)])
def test_two_processes_match_one(store, tmp_path_factory, tmp_path, mode, dtype, tol):
    """bf16 runs the master-weight path; DDP then averages bf16 gradients in fp32 (a comm hook) and
    rounds the average to bf16 once, where one process sums two bf16 gradients in fp32: close."""
    ref = single(store, tmp_path_factory, dtype)
    out = tmp_path / mode
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "eyas.cli", "train", "--store", str(store), "--out", str(out), "--grad-accum", "1",
           "--dtype", dtype, *ARGS]
    if mode == "fsdp":
        cmd.append("--fsdp")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = rows(ref), rows(out)
    assert [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b, strict=True):
        assert y["valid_tokens"] == x["valid_tokens"]
        assert abs(y["loss"] - x["loss"]) / x["loss"] < tol, (x["step"], x["loss"], y["loss"])
        assert abs(y["grad_norm"] - x["grad_norm"]) / x["grad_norm"] < 10 * tol
        if dtype == "fp32":
            assert y["acc"] == x["acc"]
    assert a[0]["loss"] != a[-1]["loss"]  # the steps really trained
    (va,), (vb,) = rows(ref, "val"), rows(out, "val")  # every rank measures all held-out samples, once, at the end
    assert vb["valid_tokens"] == va["valid_tokens"] > 0 and abs(vb["loss"] - va["loss"]) / va["loss"] < 10 * tol
    # the one validation is the best so far: its draft, gathered from the ranks (FSDP), is the final one
    for folder in ("draft", "draft-best"):
        w_ref = Eagle3Draft.from_pretrained(ref / folder).state_dict()
        w = Eagle3Draft.from_pretrained(out / folder).state_dict()
        for k in w_ref:
            assert torch.allclose(w[k].float(), w_ref[k].float(), atol=1e-4 if dtype == "fp32" else 2e-2), k
