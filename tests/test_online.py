"""Online training with the target ahead of the draft (eyas.train.online), on CPU with the hf engine:
the same losses as offline training from a store of the same states, exact resume of a killed run,
the producer's bound and its errors, and one target (rank 0) feeding two torchrun processes over gloo.

The fair comparison: `eyas extract` keeps states and the target's head in bf16, the target computes in
fp32 here; `StoreRounded` hands the online run the very same bf16 numbers (rounded from the same fp32
forward), so both runs train on identical inputs and their losses agree to 1e-5. Without the rounding
they agree to ~1e-2 (tests/test_train.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from _train_utils import (
    AUX,
    TINY_EAGLE3,
    StoreRounded,
    metric_rows,
    same_curve,
    train_quietly,
    train_store,
    without_rates,
)

from eyas.engines.base import FlatCapture
from eyas.engines.hf import HFEngine
from eyas.model.eagle3 import Eagle3Draft
from eyas.train.data import PackSchedule, SampleSource
from eyas.train.online import Layout, StateSpec, TargetFeed, node_layout

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(TINY_EAGLE3, max_steps=6, val_samples=12, val_every=3)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return train_store(tmp_path_factory.mktemp("online"))


def train(out, target_engine=None, **kw):
    return train_quietly(out, target_engine=target_engine, **{**KW, **kw})


def test_online_equals_offline_and_a_killed_run_resumes_exactly(data, tmp_path):
    target, prepared, store = data
    engine = StoreRounded(HFEngine(str(target), aux_layer_ids=AUX, dtype="float32", device="cpu"))
    online = dict(prepared=prepared, online=True, model=str(target), aux_layer_ids=AUX, prefetch=2)
    train(tmp_path / "off", store=store)
    train(tmp_path / "on", engine, **online)
    same_curve(metric_rows(tmp_path / "off"), metric_rows(tmp_path / "on"), 1e-5)
    assert not any((tmp_path / "on").rglob("*.safetensors.tmp")) and not any((tmp_path / "on").rglob("shard-*"))

    # killed after step 3 (checkpoint at 2, the producer steps ahead), then resumed: the very same curve
    cut = train(tmp_path / "cut", engine, stop_after=3, **{**online, "save_every": 2})
    assert cut["stopped_at"] == 3
    train(tmp_path / "cut", engine, resume=True, **{**online, "save_every": 2})
    assert without_rates(metric_rows(tmp_path / "on")) == without_rates(metric_rows(tmp_path / "cut"))
    w_full = Eagle3Draft.from_pretrained(tmp_path / "on" / "draft").state_dict()
    w_cut = Eagle3Draft.from_pretrained(tmp_path / "cut" / "draft").state_dict()
    assert all(torch.equal(w_full[k], w_cut[k]) for k in w_full)


class SlowTarget:
    """Counts captures; fails at capture `fail_at` (to see the error reach the training loop)."""

    device = torch.device("cpu")

    def __init__(self, fail_at=-1):
        self.calls, self.fail_at = 0, fail_at

    def capture_flat(self, seqs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("target fell over")
        n = sum(len(s) for s in seqs)
        return FlatCapture(torch.ones(n, 6), torch.ones(n, 2), [0, n])


def test_the_producer_stays_a_bounded_number_of_steps_ahead_and_its_errors_reach_the_loop(data):
    _, prepared, _ = data
    import numpy as np

    from eyas.data.prepared import PreparedDataset

    lengths = PreparedDataset(prepared).lengths
    plan = PackSchedule(np.asarray(lengths), 256, 0, world=1, grad_accum=1)
    target = SlowTarget()
    feed = TargetFeed(target, Layout(0, 0, [0]), StateSpec(6, 2, torch.float32), torch.device("cpu"), depth=2)
    it = feed.batches(SampleSource(prepared, "prepared"), plan, 0, 0, steps=10, num_workers=0)
    _, _, micro = next(it)
    assert micro[0]["aux_hidden"].shape == (micro[0]["input_ids"].shape[0], 6)
    time.sleep(0.5)  # the loop is busy: the producer fills the queue and waits
    assert target.calls <= 1 + 1 + 2 + 1  # the step taken, the one taken ahead, the queue, the one being put
    feed.close()
    assert not any(t.name == "eyas-target" for t in threading.enumerate())

    feed = TargetFeed(SlowTarget(fail_at=3), Layout(0, 0, [0]), StateSpec(6, 2, torch.float32),
                      torch.device("cpu"), depth=2)
    with pytest.raises(RuntimeError, match="target fell over"):
        for _ in feed.batches(SampleSource(prepared, "prepared"), plan, 0, 0, steps=10, num_workers=0):
            pass
    feed.close()


def test_node_layout_hosts_one_target_per_node(monkeypatch):
    assert node_layout(3, 4, spans_gpus=False) == Layout(3, 3, [3])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert node_layout(0, 4, True) == Layout(0, 0, [0, 1]) and node_layout(1, 4, True) == Layout(1, 0, [])
    assert node_layout(2, 4, True).served == [2, 3] and node_layout(3, 4, True).host == 2


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "EYAS_NO_PROGRESS": "1"}
ARGS = ["--max-steps", "4", "--ttt-steps", "3", "--token-budget", "256", "--draft-vocab-size", "48",
        "--num-workers", "0", "--log-every", "1", "--report-to", "none", "--save-every", "0", "--lr", "3e-3",
        "--device", "cpu", "--val-samples", "8", "--online", "--target-dtype", "float32", "--aux-layers", "1,3,4"]


def test_one_target_feeds_two_torchrun_processes_over_gloo(data, tmp_path):
    """--device-map places the target (here on the CPU) once per node: rank 0 runs it and sends rank 1 its
    states; the curve equals one process accumulating both ranks' micro-batches (the target in-process)."""
    target, prepared, _ = data
    common = ["-m", "eyas.cli", "train", "--prepared", str(prepared), "--model", str(target), *ARGS]
    one = subprocess.run([sys.executable, *common, "--out", str(tmp_path / "one"), "--grad-accum", "2"],
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          *common, "--out", str(tmp_path / "two"), "--device-map", "cpu"],
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "rank 0 runs it and sends ranks [1] their states" in two.stderr
    a, b = metric_rows(tmp_path / "one"), metric_rows(tmp_path / "two")
    same_curve(a, b, 1e-5)
    assert a[0]["loss"] != a[-2]["loss"]


def test_the_target_takes_the_gpus_after_the_trainers_and_starts_outside_their_world(monkeypatch):
    from eyas.train.online import target_environment, target_gpus
    from eyas.utils.io import EyasError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert target_gpus(None, 6, 2) == [2, 3, 4, 5, 6, 7] and target_gpus(None, None, 2) == [2, 3, 4, 5, 6, 7]
    assert target_gpus(None, 8, 1) == list(range(8))  # too few beside the trainer: shared
    assert target_gpus([4, 5], 2, 2) == [4, 5]
    with pytest.raises(EyasError, match=r"needs 2 GPU\(s\) but gets \[7, 8\]"):
        target_gpus([7, 8], 2, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with target_environment([1, 2]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,6" and "RANK" not in os.environ
        assert "MASTER_PORT" not in os.environ and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5,6,7" and os.environ["RANK"] == "0"
