"""Training refuses to report success on nothing: a NaN loss and a run of empty steps each stop the run
with an error that says why, and no draft is saved from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _train_utils import AUX, VOCAB, make_target, metric_rows, run_tiny_train

from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


def _store(root, edit, tokens: int = VOCAB, n: int = 24):
    """A store of `n` samples of token ids below `tokens`, extracted (no preflight) from the tiny target
    after `edit(model)` changed it."""
    from transformers import LlamaForCausalLM

    from eyas.data.prepared import PreparedWriter
    from eyas.recipes.extract import ExtractOptions, run_extract

    target = make_target(root / "target")
    model = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        edit(model)
    model.save_pretrained(target)
    rng = np.random.default_rng(0)
    w = PreparedWriter(root / "prepared", vocab_size=VOCAB)
    for _ in range(n):
        ids = np.concatenate([np.arange(tokens), rng.integers(0, tokens, 20)])
        w.add(ids, np.r_[np.zeros(8, np.uint8), np.ones(len(ids) - 8, np.uint8)])
    w.finish(tokenizer="random", chat_template_sha256="", max_length=256, skipped={}, truncated=0,
             options_sha256=f"guards-{tokens}", sources=[])
    run_extract(ExtractOptions(prepared=root / "prepared", out=root / "store", model=str(target), engine="hf",
                               aux_layer_ids=AUX, dtype="float32", device="cpu", preflight=False))
    return root / "store"


def _nan_norm(model):
    model.model.norm.weight[3] = float("nan")


def _argmax_in_62_63(model):
    """Every logit 0 but tokens 62 and 63, one of which is positive at every position."""
    w = model.lm_head.weight
    w.zero_()
    w[62, 0], w[63, 0] = 5.0, -5.0


def _nan_state(store):
    """A NaN written into the first sample's final state (the writer refuses to store one; a bad disk or an
    edit does not ask it)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    f = store / "shard-00000.safetensors"
    with safe_open(str(f), "pt") as sf:
        tensors, meta = {k: sf.get_tensor(k) for k in sf.keys()}, sf.metadata()  # noqa: SIM118
    tensors["final_hidden"][0, 5] = float("nan")
    save_file(tensors, str(f), metadata=meta)


@pytest.mark.parametrize(("edit", "damage", "names"), [
    (_nan_norm, None, r"target_head\.safetensors: the final norm's weight holds 1 NaN/inf"),
    (lambda model: None, _nan_state, r"shard-00000\.safetensors: sample 0 holds NaN/inf states \(final_hidden: 1\)"),
], ids=["nan-head", "nan-state"])
def test_a_store_with_nan_values_is_refused_before_training_naming_its_file(tmp_path, edit, damage, names):
    """A store extracted with --no-preflight from a damaged target: the head and a sample of states are checked
    when training starts, so the error names the store's file, not the draft's weights or the learning rate."""
    store = _store(tmp_path, edit)
    if damage is not None:
        damage(store)
    with pytest.raises(EyasError, match=rf"the store .*store holds non-finite values.*{names}.*rerun `eyas extract`"):
        run_tiny_train(tmp_path / "run", store, max_steps=4)
    assert not (tmp_path / "run" / "draft").exists() and not (tmp_path / "run" / "manifest.json").exists()


def test_a_nan_loss_stops_the_run_and_saves_no_draft(tmp_path):
    store = _store(tmp_path, lambda model: None)
    with pytest.raises(EyasError, match=r"training loss is (nan|inf) at step \d+: .*saves no draft"):
        run_tiny_train(tmp_path / "run", store, max_steps=4, lr=1e20)  # the weights overflow after a step
    assert not (tmp_path / "run" / "draft").exists() and not (tmp_path / "run" / "manifest.json").exists()


def test_steps_without_a_valid_token_are_counted_and_stop_a_run_of_them(tmp_path):
    """The data holds tokens 0..40 only, so the 48-token draft vocabulary is 0..47, and the target's next
    token is always 62 or 63: no step has a valid token."""
    store = _store(tmp_path, _argmax_in_62_63, tokens=41)
    with pytest.raises(EyasError, match=r"4 of the 4 training steps up to step 4 had no valid token .*outside the "
                                        r"draft vocabulary"):
        run_tiny_train(tmp_path / "run", store, max_steps=8, log_every=4)
    assert not (tmp_path / "run" / "draft").exists()
    run_tiny_train(tmp_path / "full", store, max_steps=2, draft_vocab_size=VOCAB)  # a vocabulary that holds them
    assert (tmp_path / "full" / "draft").is_dir()


def test_a_healthy_run_logs_its_empty_steps(tmp_path):
    store = _store(tmp_path, lambda m: None)
    run_tiny_train(tmp_path / "run", store, max_steps=3)
    rows = metric_rows(tmp_path / "run")
    assert [r["empty_steps"] for r in rows] == [0, 0, 0] and all(r["valid_tokens"] > 0 for r in rows)


class _Planted:
    """Unpickling it creates `marker`: the code a planted state.pt would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_resume_never_unpickles_code_and_reads_an_older_checkpoint(tmp_path):
    import random

    store = _store(tmp_path, lambda m: None)
    kw = dict(max_steps=4, save_every=2)
    run_tiny_train(tmp_path / "run", store, stop_after=3, **kw)
    state_pt = tmp_path / "run" / "train_state" / "step-00000002" / "state.pt"
    good = torch.load(state_pt, weights_only=True)
    marker = tmp_path / "ran"
    torch.save({**good, "scheduler": _Planted(marker)}, state_pt)
    with pytest.raises(EyasError, match=r"state.pt holds io.open, not only tensors.*drop --resume"):
        run_tiny_train(tmp_path / "run", store, resume=True, **kw)
    assert not marker.exists()
    # an older eyas kept numpy's generator state as an array: that still resumes
    torch.save({**good, "rng": {**good["rng"], "numpy": np.random.get_state(), "python": random.getstate()}},
               state_pt)
    assert run_tiny_train(tmp_path / "run", store, resume=True, **kw)["steps"] == 4


def _hold_lock(out):
    """Another process that holds `out`'s writer lock until it is killed."""
    import subprocess
    import sys

    code = ("import sys; from eyas.utils.io import writer_lock; lock = writer_lock(sys.argv[1], 'extract'); "
            "lock.__enter__(); print('held', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_one_writer_per_store_and_run_folder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    import os
    import signal
    import socket

    from eyas.recipes.extract import ExtractOptions, run_extract

    store = _store(tmp_path, lambda m: None)
    again = ExtractOptions(prepared=tmp_path / "prepared", out=tmp_path / "store2", model=str(tmp_path / "target"),
                           engine="hf", aux_layer_ids=AUX, dtype="float32", device="cpu", preflight=False)
    for out, start in ((tmp_path / "store2", lambda: run_extract(again)),
                       (tmp_path / "run", lambda: run_tiny_train(tmp_path / "run", store, max_steps=2))):
        holder = _hold_lock(out)
        try:
            with pytest.raises(EyasError, match=rf"is being written by another eyas process \(`eyas extract`, pid "
                                                rf"{holder.pid} on {socket.gethostname()}, started 20"):
                start()
            assert not out.exists()
        finally:
            os.kill(holder.pid, signal.SIGKILL)  # killed: its lock file stays, stale
            holder.wait()
        assert out.with_name(f".{out.name}.lock").is_file()
        start()  # the stale lock is taken over, and removed when the run ends
        assert (out / "manifest.json").is_file() and not out.with_name(f".{out.name}.lock").exists()
