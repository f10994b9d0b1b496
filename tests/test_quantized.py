"""Quantized targets in the hf engine: Kimi-K2.5's own scheme (compressed-tensors W4A16 pack-quantized
routed experts, made here with the compressed-tensors library) and DeepSeek-V3's block FP8.

The reference is each checkpoint's dequantized twin (the same weights, already dequantized, in a plain
checkpoint) run by the same engine in the same dtype, not the unquantized original: int4 rounding moves
the states by ~5e-2 and fp8's by ~2e-1 (a tiny random MoE re-routes some tokens), which says nothing
about capture. transformers dequantizes both schemes exactly when it loads them (w = q * scale is
representable in the scale's dtype), so the engine must give the twin's states to float rounding:
tolerance 1e-5, the same as every unquantized capture test (measured: 0.0).

One trap the engine handles: the dequantized experts keep their scales' dtype (bf16) whatever dtype is
asked for, so a float32 engine would silently compute them in bf16 (~1e-2 off the float32 twin); it
upcasts them.
"""

from __future__ import annotations

import pytest
import torch
from _kimi import make_kimi
from _quant import make_deepseek_v3_128, quantize_block_fp8, quantize_w4a16, to_bf16
from safetensors import safe_open

from eyas.engines.hf import HFEngine
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def kimi_w4a16(tmp_path_factory):
    root = tmp_path_factory.mktemp("w4a16")
    original = to_bf16(make_kimi(root / "fp32"), root / "bf16")  # Kimi-K2.5 ships its unquantized parts in bf16
    quantized, twin = quantize_w4a16(original, root / "w4a16", root / "dequantized")
    return original, quantized, twin


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def captures(folder, dtype: str, aux=(1, 2, 3)) -> list:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 260, (n,), generator=g) for n in (23, 9, 16)]  # ragged: padding inside
    return HFEngine(str(folder), aux_layer_ids=list(aux), dtype=dtype, device="cpu").capture(seqs)


def worst(a: list, b: list) -> float:
    return max(max(rel(x.aux, y.aux), rel(x.final, y.final)) for x, y in zip(a, b, strict=True))


def test_kimi_w4a16_loads_and_matches_its_dequantized_twin(kimi_w4a16):
    original, quantized, twin = kimi_w4a16
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        packed = [k for k in f.keys() if k.endswith("weight_packed")]  # noqa: SIM118
        assert len(packed) == 3 * 3 * 4 and f.get_tensor(packed[0]).dtype == torch.int32  # 3 MoE layers x 4 experts
    for dtype in ("float32", "bfloat16"):
        got, want = captures(quantized, dtype), captures(twin, dtype)
        assert got[0].aux.dtype == getattr(torch, dtype)  # float32 asked: float32 computed, experts included
        assert worst(got, want) <= 1e-5, dtype
    assert worst(captures(quantized, "float32"), captures(original, "float32")) > 1e-3  # int4 really applied


def test_a_missing_quantization_package_is_named(kimi_w4a16, monkeypatch):
    import transformers.quantizers.quantizer_compressed_tensors as ct

    monkeypatch.setattr(ct, "is_compressed_tensors_available", lambda: False)
    with pytest.raises(EyasError, match=r"quantized \(compressed-tensors\).*pip install compressed-tensors"):
        HFEngine(str(kimi_w4a16[1]), aux_layer_ids=[1, 2], dtype="float32", device="cpu")


def test_block_fp8_deepseek_v3_matches_its_dequantized_twin(tmp_path):
    original = make_deepseek_v3_128(tmp_path / "ds3")
    quantized, twin = quantize_block_fp8(original, tmp_path / "fp8", tmp_path / "dequantized")
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.float8_e4m3fn
    got = captures(quantized, "float32", aux=(1, 2))
    assert worst(got, captures(twin, "float32", aux=(1, 2))) <= 1e-5
    assert worst(got, captures(original, "float32", aux=(1, 2))) > 1e-3


def test_w4a16_with_its_attention_quantized_loads_and_matches_its_twin(kimi_w4a16, tmp_path):
    """transformers cannot run packed int4 attention layers (`'Linear' object has no attribute 'weight'`):
    the engine has them dequantized at load, and the states are the dequantized twin's."""
    quantized, twin = quantize_w4a16(kimi_w4a16[0], tmp_path / "w4a16", tmp_path / "dequantized", attention=True)
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        assert any("self_attn.q_b_proj.weight_packed" in k for k in f.keys())  # noqa: SIM118
    assert worst(captures(quantized, "float32"), captures(twin, "float32")) <= 1e-5
