"""`eyas extract` end to end on a tiny real model: the store holds the engine's states, a killed run resumes
to identical bytes, two torchrun ranks on gloo give the single-process store, fp8 stays close."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers as tf

from eyas.data.prepared import PreparedDataset, PreparedWriter
from eyas.engines.hf import HFEngine
from eyas.recipes.extract import ExtractOptions, run_extract
from eyas.store import HiddenStore, partial_dir
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")

SHARD_MB = 0.02  # ~80 tokens per shard: several shards, several batches per shard
OPTS = dict(dtype="float32", device="cpu", token_budget=64, shard_mb=SHARD_MB)




@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny Llama folder (8 layers: default aux ids [2, 4, 5]) and a prepared dataset of 24 samples."""
    root = tmp_path_factory.mktemp("extract")
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
                        ).save_pretrained(root / "model")
    rng = np.random.default_rng(0)
    w = PreparedWriter(root / "prepared", vocab_size=300, shard_tokens=200)
    for n in rng.integers(3, 40, size=24):
        w.add(rng.integers(0, 300, size=n), (rng.random(n) < 0.5).astype(np.uint8))
    w.finish(tokenizer="test", chat_template_sha256="", max_length=64, skipped={}, truncated=0,
             options_sha256="test", sources=[])
    ref = run_extract(ExtractOptions(prepared=root / "prepared", out=root / "reference",
                                     model=str(root / "model"), **OPTS))
    return root, ref


def hashes(store) -> list[str]:
    return [s["sha256"] for s in json.loads((store / "manifest.json").read_text())["shards"]]


def free_port() -> int:
    """A port nothing listens on now (a fixed one collides with other test runs on the machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, torchrun: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "EYAS_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            "-m", "eyas.cli"] if torchrun else [sys.executable, "-m", "eyas.cli"]
    return subprocess.run([*head, "extract", *args], capture_output=True, text=True, timeout=180, env=env)


def test_store_holds_the_engines_states(assets):
    root, ref = assets
    store, ds = HiddenStore(ref), PreparedDataset(root / "prepared")
    m = store.manifest
    assert m["aux_layer_ids"] == [2, 4, 5] and m["num_layers"] == 8 and m["hidden_size"] == 32
    assert m["num_samples"] == 24 and m["num_tokens"] == int(ds.lengths.sum()) and len(m["shards"]) > 3
    assert m["target_config_sha256"] and m["prepared_sha256"] and m["vocab_size"] == 300
    engine = HFEngine(str(root / "model"), dtype="float32", device="cpu")
    caps = engine.capture([ds[i]["input_ids"] for i in range(24)])
    for i in range(24):
        r = store[i]
        assert torch.equal(r["input_ids"], ds[i]["input_ids"]) and torch.equal(r["loss_mask"], ds[i]["loss_mask"])
        # bf16 storage of fp32 states: rounding only
        assert torch.allclose(r["aux_hidden"].float(), caps[i].aux, rtol=8e-3, atol=1e-5)
        assert torch.allclose(r["final_hidden"].float(), caps[i].final, rtol=8e-3, atol=1e-5)
    head = store.target_head()
    assert head.lm_head.shape == (300, 32) and head.norm_eps == engine.target_head().norm_eps
    # same inputs and options: reused without loading the model
    before = (ref / "manifest.json").stat().st_mtime_ns
    assert run_extract(ExtractOptions(prepared=root / "prepared", out=ref, model=str(root / "model"), **OPTS)) == ref
    assert (ref / "manifest.json").stat().st_mtime_ns == before


def test_resume_after_kill_gives_identical_store(assets):
    root, ref = assets
    out = root / "resumed"

    def kill(shard):
        if shard.index == 1:
            raise KeyboardInterrupt("simulated kill after shard 1")

    with pytest.raises(KeyboardInterrupt):
        run_extract(ExtractOptions(prepared=root / "prepared", out=out, model=str(root / "model"), **OPTS),
                    on_shard=kill)
    assert not out.exists() and {"shard-00000.safetensors", "shard-00001.safetensors"} <= {
        p.name for p in partial_dir(out).iterdir()}
    run_extract(ExtractOptions(prepared=root / "prepared", out=out, model=str(root / "model"), **OPTS))
    assert hashes(out) == hashes(ref) and not partial_dir(out).exists()
    assert (out / "manifest.json").read_text() == (ref / "manifest.json").read_text()


def test_fp8_store_is_close_to_bf16(assets):
    root, ref = assets
    out = run_extract(ExtractOptions(prepared=root / "prepared", out=root / "fp8", model=str(root / "model"),
                                     fp8=True, **OPTS))
    a, b = HiddenStore(out), HiddenStore(ref)
    assert a.manifest["dtype"] == "float8_e4m3fn"
    for i in (0, 11, 23):
        for key in ("aux_hidden", "final_hidden"):
            x, y = a[i][key].float(), b[i][key].float()
            assert ((x - y).norm() / y.norm()).item() < 4e-2


def test_compiled_target_gives_the_eager_states(assets):
    """--compile: each decoder layer torch.compiled; the states match eager to fp32 rounding, ragged
    batches included, and the model leaves the engine uncompiled."""
    root, ref = assets
    ds = PreparedDataset(root / "prepared")
    seqs = [ds[i]["input_ids"] for i in range(6)]  # ragged: a mask, and a different graph from ...
    model = tf.LlamaForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    batches = (seqs, [seqs[0], seqs[0]])  # ... a batch of equal lengths, which has none
    plain = HFEngine(model, dtype="float32", device="cpu")
    eager = [plain.capture_flat(batch) for batch in batches]
    plain.close()
    engine = HFEngine(model, dtype="float32", device="cpu", compile=True)
    assert all("forward" in vars(layer) for layer in model.model.layers)
    for batch, want in zip(batches, eager, strict=True):
        got = engine.capture_flat(batch)
        assert torch.allclose(got.aux, want.aux, atol=1e-5) and torch.allclose(got.final, want.final, atol=1e-5)
        assert not torch.equal(got.aux, torch.zeros_like(got.aux))
    engine.close()
    assert all("forward" not in vars(layer) for layer in model.model.layers)
    out = run_extract(ExtractOptions(prepared=root / "prepared", out=root / "compiled", model=str(root / "model"),
                                     compile=True, **OPTS))
    a, b = HiddenStore(out), HiddenStore(ref)
    for i in range(len(b)):
        for key in ("aux_hidden", "final_hidden"):  # bf16 storage: at most one rounding step apart
            assert torch.allclose(a[i][key].float(), b[i][key].float(), rtol=8e-3, atol=1e-5)
    with pytest.raises(EyasError, match="--compile are for the hf engine"):
        ExtractOptions(prepared=root / "prepared", out=root / "x", engine="vllm", compile=True)


def test_a_target_that_does_not_compile_runs_uncompiled_with_a_warning(assets, monkeypatch):
    """A compile that fails (here: a backend that raises when the compiled layer first runs) costs a warning,
    not the run: the engine puts the eager layers back and captures the same states."""
    root, _ = assets
    model = tf.LlamaForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    seqs = [PreparedDataset(root / "prepared")[i]["input_ids"] for i in range(4)]
    eager = HFEngine(model, dtype="float32", device="cpu").capture_flat(seqs)

    def broken_backend(gm, example_inputs):
        raise RuntimeError("this backend cannot lower the layer")

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=broken_backend))
    engine = HFEngine(model, dtype="float32", device="cpu", compile=True)
    with pytest.warns(UserWarning, match="torch.compile failed .* running them uncompiled"):
        got = engine.capture_flat(seqs)
    assert torch.equal(got.aux, eager.aux) and torch.equal(got.final, eager.final)
    assert all("forward" not in vars(layer) for layer in model.model.layers)
    assert torch.equal(engine.capture_flat(seqs).aux, eager.aux)  # and stays uncompiled, without a warning


def test_cli_extract_and_verify(assets):
    root, ref = assets
    out = root / "cli"
    r = cli("--prepared", str(root / "prepared"), "--model", str(root / "model"), "--out", str(out), "--dtype",
            "float32", "--device", "cpu", "--token-budget", "64", "--shard-mb", str(SHARD_MB), "--verify")
    assert r.returncode == 0, r.stderr
    assert "needs about" in r.stderr and "files OK" in r.stderr
    assert hashes(out) == hashes(ref)
    r = cli("--out", str(root / "missing"), "--verify")
    assert r.returncode == 2 and "nothing to verify" in r.stderr


def test_two_torchrun_ranks_write_one_store(assets):
    root, ref = assets
    out = root / "dist"
    r = cli("--prepared", str(root / "prepared"), "--model", str(root / "model"), "--out", str(out), "--dtype",
            "float32", "--device", "cpu", "--token-budget", "64", "--shard-mb", str(SHARD_MB), torchrun=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 0:" in r.stderr and "rank 1:" in r.stderr  # both ranks extracted a share
    assert hashes(out) == hashes(ref)  # same shards, byte for byte, as one process
    assert not partial_dir(out).exists()


def test_bad_inputs_fail_fast_with_clear_messages(assets, tmp_path):
    root, _ = assets
    with pytest.raises(EyasError, match="not a prepared dataset"):
        run_extract(ExtractOptions(prepared=tmp_path / "nope", out=tmp_path / "s", model=str(root / "model"), **OPTS))
    with pytest.raises(EyasError, match="out of range"):
        run_extract(ExtractOptions(prepared=root / "prepared", out=tmp_path / "s", model=str(root / "model"),
                                   aux_layer_ids=[1, 8], **OPTS))


@contextlib.contextmanager
def small_disk(path, size: str):
    """A real filesystem of `size` (tmpfs) at `path`: mounting needs root, as CI has; skipped elsewhere."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a {size} tmpfs here ({r.stderr.strip() or r.returncode}): the full-disk tests "
                    "need root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_the_disk_estimate_counts_the_target_head(assets, tmp_path):
    """A target whose head (2 x vocab x hidden in bf16: 2 MiB here) outweighs the shards (~0.15 MiB): a 1 MiB
    disk holds the shards but not the head, so extract must refuse before it starts, not die at its last
    step with an ENOSPC traceback."""
    root, _ = assets
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                       num_attention_heads=2, num_key_value_heads=1, vocab_size=16384)
                        ).save_pretrained(tmp_path / "wide")
    prepared = shutil.copytree(root / "prepared", tmp_path / "prepared")  # the same ids, prepared for this target
    manifest = json.loads((prepared / "manifest.json").read_text())
    (prepared / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 16384}))
    with small_disk(tmp_path / "disk", "1m") as disk:
        with pytest.raises(EyasError, match=r"needs about 2\.\d MiB on .* but only .* is free"):
            run_extract(ExtractOptions(prepared=prepared, out=disk / "store", model=str(tmp_path / "wide"),
                                       **OPTS))
        assert not list(partial_dir(disk / "store").glob("shard-*"))  # refused before the first shard


def test_a_disk_filled_by_another_writer_names_the_need_keeps_shards_and_resumes(assets, tmp_path, capsys):
    root, ref = assets
    with small_disk(tmp_path / "disk", "4m") as disk:
        filler = disk / "another-writer.bin"

        def fill_the_disk(shard):  # after shard 1, someone else takes every free byte
            if shard.index == 1 and not filler.exists():
                with contextlib.suppress(OSError), open(filler, "wb") as f:
                    while True:
                        f.write(b"\0" * (1 << 16))

        opts = ExtractOptions(prepared=root / "prepared", out=disk / "store", model=str(root / "model"), **OPTS)
        with pytest.raises(EyasError, match=r"no space left writing .*store\.partial/.*: the store needs about .* "
                                            r"more and .* is free\. Free some space and rerun the same command: the "
                                            r"\d+ finished shard\(s\) in .*store\.partial are kept") as e:
            run_extract(opts, on_shard=fill_the_disk)
        kept = int(str(e.value).split(" finished shard")[0].rsplit(" ", 1)[1])
        assert kept >= 2 and len(list(partial_dir(disk / "store").glob("shard-*.safetensors"))) == kept
        assert not list(partial_dir(disk / "store").glob(".tmp-*"))  # the half-written shard is gone
        filler.unlink()
        capsys.readouterr()
        run_extract(opts)  # resumes: the kept shards are not redone
        assert f"resuming: {kept}/" in capsys.readouterr().err
        assert hashes(disk / "store") == hashes(ref) and not partial_dir(disk / "store").exists()
