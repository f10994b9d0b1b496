"""Quantized tiny targets made inside the tests, each with a twin holding its dequantized weights (the
reference its captures must match):

- Kimi-K2.5's own scheme: compressed-tensors W4A16 `pack-quantized` (int4, symmetric, groups of 32,
  bf16 scales) on the routed experts only, everything else bf16; made with the compressed-tensors
  library (the one vLLM and transformers read it with).
- DeepSeek-V3's release scheme: block FP8 (e4m3 weights, one `weight_scale_inv` per 128x128 block),
  written by hand (no library makes it). transformers dequantizes it on a CPU only when every
  quantized weight's dims are multiples of 128, hence the wider tiny model.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GROUP = 32
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
ATTENTION = re.compile(r"\.self_attn\.\w+_proj(_with_mqa)?\.weight$")
# Kimi-K2.5's quantization_config: only routed experts are int4 (module names match with a `re:` prefix)
W4A16_IGNORE = ["lm_head", "re:.*lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]


def _rewrite(src: Path, out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> Path:
    """A copy of the folder `src` with other weights (and a quantization_config)."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = quantization_config
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def w4a16_args():
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP,
                            dynamic=False, observer="minmax")


def quantize_w4a16(src: Path, out: Path, twin: Path, attention: bool = False) -> tuple[Path, Path]:
    """`src` (a bf16 folder) with its routed experts (and with `attention`, its attention projections too)
    packed to int4 -> `out`; the same weights dequantized back to bf16 -> `twin`."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = w4a16_args()
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = load_file(str(src / "model.safetensors"))
    packed, dequantized = {}, {}
    for name, w in state.items():
        if not (ROUTED_EXPERT.search(name) or (attention and ATTENTION.search(name))):
            packed[name] = dequantized[name] = w
            continue
        groups = w.float().reshape(w.shape[0], -1, GROUP)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        scale = scale.to(w.dtype)  # [out, in / GROUP]
        stem = name[: -len("weight")]
        for k, t in PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme).items():
            packed[stem + k] = t  # weight_packed int32 [out, in/8], weight_scale, weight_shape
        dequantized[name] = dequantize(quantize(w, scale, None, args), scale, None, args).to(w.dtype)
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(mode="json"),
                                            "input_activations": None, "output_activations": None}},
              "ignore": [i for i in W4A16_IGNORE if not (attention and "self_attn" in i)], "kv_cache_scheme": None}
    return _rewrite(src, out, packed, config), _rewrite(src, twin, dequantized, None)


def to_bf16(src: Path, out: Path) -> Path:
    """The folder with every float32 weight stored as bf16 (what Kimi-K2.5 ships its unquantized parts in)."""
    state = load_file(str(src / "model.safetensors"))
    return _rewrite(src, out, {k: v.to(torch.bfloat16) if v.dtype == torch.float32 else v for k, v in state.items()},
                    None)


BLOCK = 128
FP8_SKIP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "e_score_correction_bias", "kv_a_proj_with_mqa")


def _block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale_inv [out/128, in/128], the weight it dequantizes to)."""
    rows, cols = w.shape
    blocks = w.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
    back = (q.float() * scale_inv[:, None, :, None]).reshape(rows, cols)
    return q.reshape(rows, cols), scale_inv, back


def quantize_block_fp8(src: Path, out: Path, twin: Path) -> tuple[Path, Path]:
    """`src`'s 2-D linear weights (all dims multiples of 128) in block FP8 -> `out`; dequantized -> `twin`."""
    state = load_file(str(src / "model.safetensors"))
    packed, dequantized = {}, {}
    for name, w in state.items():
        if w.ndim != 2 or not name.endswith(".weight") or any(s in name for s in FP8_SKIP):
            packed[name] = dequantized[name] = w
            continue
        q, scale_inv, back = _block_fp8(w)
        packed[name], packed[name[: -len("weight")] + "weight_scale_inv"] = q, scale_inv
        dequantized[name] = back.to(w.dtype)
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
              "modules_to_not_convert": ["kv_a_proj_with_mqa", "lm_head"]}
    return _rewrite(src, out, packed, config), _rewrite(src, twin, dequantized, None)


def make_deepseek_v3_128(out: Path, seed: int = 0) -> Path:
    """A tiny DeepseekV3 (MLA + MoE) whose quantized dims are all multiples of 128 (block FP8 on a CPU)."""
    from _kimi import KIMI_SPECIALS, MLA_DIMS, byte_tokenizer
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    tok = byte_tokenizer(KIMI_SPECIALS, bos_token="[BOS]", eos_token="[EOS]", pad_token="[EOS]")
    cfg = DeepseekV3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                           num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                           max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
                           **{**MLA_DIMS, "q_lora_rank": 128})
    torch.manual_seed(seed)
    DeepseekV3ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return Path(out)
