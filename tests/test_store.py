"""The hidden-state store: exact roundtrip, fp8 with per-token scales, resume after a crash with identical
bytes, checksum verification and the disk-space refusal."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eyas.engines.head import TargetHead
from eyas.store import (
    HiddenStore,
    StoreMeta,
    StoreWriter,
    check_disk_for,
    partial_dir,
    prepare_partial,
    quantize_fp8,
    split_shards,
    verify_store,
)
from eyas.utils.io import EyasError

K, H, V = 3, 64, 50


def meta(dtype: str = "bfloat16") -> StoreMeta:
    return StoreMeta(target="tiny", target_config_sha256="c" * 64, num_layers=8, aux_layer_ids=[2, 4, 5],
                     hidden_size=H, vocab_size=V, dtype=dtype, prepared="prep", prepared_sha256="p" * 64,
                     norm_eps=1e-5, options_sha256=f"opts-{dtype}")


def sample(i: int, n: int) -> dict[str, torch.Tensor]:
    """Deterministic fake states for sample i, with a few large outliers to stress the fp8 scales."""
    g = torch.Generator().manual_seed(i)
    aux = torch.randn(n, K * H, generator=g)
    aux[:, :H] *= 30.0  # layer 0 much larger than the others: per-layer scales keep them precise
    return {"input_ids": torch.randint(0, V, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) < 0.5,
            "aux": aux, "final": torch.randn(n, H, generator=g) * 4}


def head() -> TargetHead:
    g = torch.Generator().manual_seed(7)
    return TargetHead(torch.randn(V, H, generator=g), torch.rand(H, generator=g), torch.randn(V, H, generator=g), 1e-5)


def write_store(out, lengths, m: StoreMeta, on_shard=None, shard_bytes=6000, num_writers=2):
    """What `extract` does, with fake states: plan, fill each shard's buffer, write, finalize."""
    lengths = np.asarray(lengths)
    plan = prepare_partial(out, m, split_shards(lengths, m.bytes_per_token(), shard_bytes))
    w = StoreWriter(out, m, lengths, plan, on_shard=on_shard, num_writers=num_writers)
    try:
        for shard in w.todo():
            buf = w.acquire(shard)
            for local in range(shard.num_samples):
                i = shard.first_sample + local
                s, a = sample(i, int(lengths[i])), int(buf.offsets[local])
                rows = slice(a, a + int(lengths[i]))
                buf.input_ids[rows], buf.loss_mask[rows] = s["input_ids"].int(), s["loss_mask"].to(torch.uint8)
                if m.fp8:
                    buf.aux[rows], buf.aux_scale[rows] = quantize_fp8(s["aux"], K)
                    buf.final[rows], buf.final_scale[rows] = quantize_fp8(s["final"], 1)
                else:
                    buf.aux[rows], buf.final[rows] = s["aux"].bfloat16(), s["final"].bfloat16()
            w.submit(buf)
        w.close()
    except BaseException:
        w.abort()
        raise
    w.finalize(head())
    return plan


LENGTHS = [5, 9, 1, 12, 7, 3, 8, 8, 2, 10, 6]


def shard_hashes(path) -> list[str]:
    return [s["sha256"] for s in json.loads((path / "manifest.json").read_text())["shards"]]


def test_roundtrip_bf16(tmp_path):
    out = tmp_path / "store"
    plan = write_store(out, LENGTHS, meta())
    assert len(plan) > 2 and not partial_dir(out).exists()
    store = HiddenStore(out)
    m = store.manifest
    assert m["format"] == "eyas.hidden/1" and m["num_samples"] == len(LENGTHS) and m["num_tokens"] == sum(LENGTHS)
    assert m["aux_layer_ids"] == [2, 4, 5] and m["dtype"] == "bfloat16" and m["norm_eps"] == 1e-5
    assert [s["first_sample"] for s in m["shards"]] == [p.first_sample for p in plan]
    assert list(store.lengths) == LENGTHS and len(store) == len(LENGTHS)
    for i, n in enumerate(LENGTHS):
        s, r = sample(i, n), store[i]
        assert torch.equal(r["input_ids"], s["input_ids"]) and torch.equal(r["loss_mask"], s["loss_mask"])
        assert torch.equal(r["aux_hidden"], s["aux"].bfloat16())
        assert torch.equal(r["final_hidden"], s["final"].bfloat16())
    assert torch.equal(store[-1]["final_hidden"], store[len(LENGTHS) - 1]["final_hidden"])
    with pytest.raises(IndexError):
        store[len(LENGTHS)]
    # shard files are plain safetensors with the documented tensors
    t = load_file(str(out / m["shards"][0]["file"]))
    assert set(t) == {"input_ids", "loss_mask", "offsets", "aux_hidden", "final_hidden"}
    assert t["input_ids"].dtype == torch.int32 and t["loss_mask"].dtype == torch.uint8 and t["offsets"][0] == 0
    th, ref = store.target_head(), head()
    assert torch.equal(th.lm_head, ref.lm_head.bfloat16()) and th.norm_eps == 1e-5
    assert store.verify() == len(plan) + 1
    clone = pickle.loads(pickle.dumps(store))  # DataLoader workers get a copy that reopens the shards
    assert torch.equal(clone[3]["aux_hidden"], store[3]["aux_hidden"])


def test_reading_some_of_the_layers(tmp_path):
    """HiddenStore(path, ids) hands out those layers' columns only (bf16 and fp8), survives pickling for
    the DataLoader workers, and refuses layers the store lacks or ids out of layer order, by name."""
    for dtype in ("bfloat16", "float8_e4m3fn"):
        out = tmp_path / dtype
        write_store(out, LENGTHS, meta(dtype))
        full, some = HiddenStore(out), HiddenStore(out, [2, 5])
        assert some.aux_layer_ids == [2, 5] and full.aux_layer_ids == [2, 4, 5]
        for i in range(len(LENGTHS)):
            a, b = full[i]["aux_hidden"], some[i]["aux_hidden"]
            assert b.shape == (LENGTHS[i], 2 * H)
            assert torch.equal(b[:, :H], a[:, :H]) and torch.equal(b[:, H:], a[:, 2 * H:])
            assert torch.equal(some[i]["final_hidden"], full[i]["final_hidden"])
        assert torch.equal(pickle.loads(pickle.dumps(some))[4]["aux_hidden"], some[4]["aux_hidden"])
        assert torch.equal(HiddenStore(out, [4])[3]["aux_hidden"], full[3]["aux_hidden"][:, H:2 * H])
    with pytest.raises(EyasError, match=r"holds aux layers \[2, 4, 5\], not \[3\].*--aux-layers 2,3"):
        HiddenStore(out, [2, 3])
    with pytest.raises(EyasError, match=r"must be in layer order, got \[5, 2\].*write 2,5"):
        HiddenStore(out, [5, 2])
    # id 8 = N, the last layer's output: the store's final state, never an aux layer extract captures, so the
    # error names the range extract takes rather than advising `extract --aux-layers 2,8`
    with pytest.raises(EyasError, match=r"--aux-layers for the store .* \[2, 8\]: \[8\] out of range .*valid: 0\.\.7"):
        HiddenStore(out, [2, 8])


def test_fp8_per_token_scales_halve_the_disk(tmp_path):
    write_store(tmp_path / "bf16", LENGTHS, meta(), shard_bytes=1 << 20)
    write_store(tmp_path / "fp8", LENGTHS, meta("float8_e4m3fn"), shard_bytes=1 << 20)
    store = HiddenStore(tmp_path / "fp8")
    for i, n in enumerate(LENGTHS):
        s, r = sample(i, n), store[i]
        assert r["aux_hidden"].dtype == torch.bfloat16 and r["aux_hidden"].shape == (n, K * H)
        for j in range(K):  # each layer keeps its own precision despite layer 0's 30x scale
            a, b = r["aux_hidden"][:, j * H:(j + 1) * H].float(), s["aux"][:, j * H:(j + 1) * H]
            assert ((a - b).norm() / b.norm()).item() < 4e-2
        assert ((r["final_hidden"].float() - s["final"]).norm() / s["final"].norm()).item() < 4e-2
    t = load_file(str(tmp_path / "fp8" / store.manifest["shards"][0]["file"]))
    assert t["aux_hidden"].dtype == torch.float8_e4m3fn and t["aux_scale"].shape == (t["aux_hidden"].shape[0], K)
    assert t["final_scale"].shape == (t["final_hidden"].shape[0], 1)
    size = {d: sum(f.stat().st_size for f in (tmp_path / d).glob("shard-*")) for d in ("bf16", "fp8")}
    assert size["fp8"] < 0.6 * size["bf16"]


def test_resume_after_a_crash_gives_identical_bytes(tmp_path):
    write_store(tmp_path / "clean", LENGTHS, meta())

    def crash(shard):
        if shard.index == 1:
            raise KeyboardInterrupt("killed after shard 1")

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):  # one writer: with two, the other may finish every shard first
        write_store(out, LENGTHS, meta(), on_shard=crash, num_writers=1)
    part = partial_dir(out)
    assert not out.exists() and (part / "shard-00001.safetensors").is_file()
    (part / ".tmp-shard-00002.safetensors").write_bytes(b"half a shard")  # a write the kill cut short
    m = meta()
    plan = prepare_partial(out, m, split_shards(np.asarray(LENGTHS), m.bytes_per_token(), 6000))
    w = StoreWriter(out, m, np.asarray(LENGTHS), plan)
    todo = [s.index for s in w.todo()]
    assert todo and 0 not in todo and 1 not in todo  # finished shards are kept, the rest is redone
    w.close()
    assert not (part / ".tmp-shard-00002.safetensors").exists()
    write_store(out, LENGTHS, meta())
    assert shard_hashes(out) == shard_hashes(tmp_path / "clean")
    for a, b in zip(sorted(out.glob("shard-*")), sorted((tmp_path / "clean").glob("shard-*")), strict=True):
        assert a.read_bytes() == b.read_bytes()
    # a partial state from other options is discarded, not mixed in
    with pytest.raises(KeyboardInterrupt):
        write_store(tmp_path / "x", LENGTHS, meta(), on_shard=crash)
    other = meta()
    other.options_sha256 = "other"
    prepare_partial(tmp_path / "x", other, split_shards(np.asarray(LENGTHS), other.bytes_per_token(), 6000))
    assert not (partial_dir(tmp_path / "x") / "shard-00000.safetensors").exists()


def test_verify_detects_corruption(tmp_path):
    out = tmp_path / "store"
    write_store(out, LENGTHS, meta())
    assert verify_store(out) > 1
    f = out / "shard-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the states: the file still parses
    f.write_bytes(bytes(data))
    HiddenStore(out)[2]  # still readable ...
    with pytest.raises(EyasError, match="shard-00001.safetensors: sha256 differs"):
        HiddenStore(out).verify()  # ... but verification catches it
    (out / "shard-00000.safetensors").unlink()
    with pytest.raises(EyasError, match=r"2 bad file\(s\)"):
        verify_store(out)


def test_refuses_when_the_disk_is_too_small(tmp_path, capsys):
    m = meta()
    lengths = np.asarray([10**9] * 4000)  # ~ 3e14 bytes of states: no disk has that free
    plan = prepare_partial(tmp_path / "huge", m, split_shards(lengths, m.bytes_per_token(), 1 << 40))
    w = StoreWriter(tmp_path / "huge", m, lengths, plan)
    lines = []
    with pytest.raises(EyasError, match=r"needs about .*TiB.* but only .* is free"):
        check_disk_for(w, lines.append)
    w.close()
    assert "needs about" in lines[0] and "free" in lines[0]


def test_plan_shards_is_contiguous_and_sized():
    lengths = np.asarray([4, 4, 4, 10, 1, 1, 1, 30, 2])
    plan = split_shards(lengths, bytes_per_token=10, shard_bytes=100)  # ~10 tokens per shard
    assert plan[0].first_sample == 0 and sum(s.num_samples for s in plan) == len(lengths)
    for a, b in zip(plan[:-1], plan[1:], strict=True):
        assert b.first_sample == a.first_sample + a.num_samples
    for s in plan:
        assert s.num_tokens == lengths[s.first_sample:s.first_sample + s.num_samples].sum()
        last = lengths[s.first_sample + s.num_samples - 1]
        assert s.num_tokens - last < 10  # closes at the sample that reaches the size
    assert len(split_shards(np.full(20, 5), 10, 10**9)) == 1
    assert len(split_shards(np.full(20, 5), 10, 10**9, min_shards=4)) == 4  # every rank gets a shard


def test_a_damaged_or_truncated_file_is_one_clear_error_on_opening(tmp_path):
    """Opening checks every file's header and size (cheap): a damaged header, a truncated shard or head
    is one EyasError naming the file, what is wrong and what to do; flipped bytes in the data pass that
    check and are caught by the sha256 check `verify=True` asks for."""
    clean = tmp_path / "clean"
    write_store(clean, LENGTHS, meta())
    shard = "shard-00001.safetensors"

    def damaged(name: str, damage) -> Path:
        out = tmp_path / name
        shutil.copytree(clean, out)
        f = out / shard
        f.write_bytes(damage(f.read_bytes()))
        return out

    fix = r"eyas extract --out .* --verify.*rerun the `eyas extract` command"
    header = damaged("header", lambda b: b[:12] + b"#" * 8 + b[20:])
    with pytest.raises(EyasError, match=rf"{shard} is damaged: the header is not valid JSON.*{fix}"):
        HiddenStore(header)
    cut = damaged("cut", lambda b: b[:len(b) // 2])
    with pytest.raises(EyasError, match=rf"{shard} is damaged: the file is .* bytes but its header describes .* "
                                        rf"\(truncated\).*{fix}"):
        HiddenStore(cut)
    flipped = damaged("flipped", lambda b: b[:-3] + bytes([b[-3] ^ 0xFF]) + b[-2:])
    HiddenStore(flipped)  # header and size are fine ...
    with pytest.raises(EyasError, match=rf"{shard}: sha256 differs"):
        HiddenStore(flipped, verify=True)  # ... the checksum is not
    head = clean / "target_head.safetensors"
    head.write_bytes(head.read_bytes()[:-10])
    with pytest.raises(EyasError, match=r"target_head.safetensors is damaged: .*truncated"):
        HiddenStore(clean)
