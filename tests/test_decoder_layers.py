"""One decoder-layer finder for every target family: extraction and online training (HFEngine) and eval
(HFTarget) hook the very same modules, and for a multimodal wrapper those are the text decoder's layers,
never a vision tower's: what the engine captures there is transformers' hidden_states[k]. Every model is
tiny and random (hidden 64, 3 text layers; vision towers of 1 small layer, so a tower's layer count never
matches the text decoder's)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from eyas.engines.decoder import find_text_decoder
from eyas.engines.hf import HFEngine
from eyas.eval.target import HFTarget

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 3
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MLA = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
           first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=16)  # DeepSeek-V3's MLA + MoE (also Kimi-K2.5's text model)
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3]}
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

CONFIGS = {
    "llama": lambda: tf.LlamaConfig(**TEXT),
    "qwen2": lambda: tf.Qwen2Config(**TEXT),
    "qwen3": lambda: tf.Qwen3Config(**TEXT, head_dim=16),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**TEXT, head_dim=16, **MOE),
    "mistral": lambda: tf.MistralConfig(**TEXT),
    "mixtral": lambda: tf.MixtralConfig(**TEXT, num_local_experts=4, num_experts_per_tok=2),
    "gemma2": lambda: tf.Gemma2Config(**TEXT, head_dim=16),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**TEXT, head_dim=16, sliding_window=4),
    "gemma3": lambda: tf.Gemma3Config(
        text_config=dict(**TEXT, head_dim=16, sliding_window=4), mm_tokens_per_image=4,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14)),
    "phi3": lambda: tf.Phi3Config(**TEXT, pad_token_id=0),
    "deepseek_v3": lambda: tf.DeepseekV3Config(**TEXT, **MLA),
    "gpt_oss": lambda: tf.GptOssConfig(**TEXT, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=4),
    "glm4_moe": lambda: tf.Glm4MoeConfig(**TEXT, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1),
    "llama4": lambda: tf.Llama4Config(
        text_config=dict(**TEXT, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                         intermediate_size_mlp=128, interleave_moe_layer_step=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14, vision_output_dim=64, projector_input_dim=64,
                           projector_output_dim=64)),
    "mistral3": lambda: tf.Mistral3Config(
        text_config=dict(model_type="mistral", **TEXT), spatial_merge_size=1,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           head_dim=16, image_size=28, patch_size=14)),
    "qwen2_5_vl": lambda: tf.Qwen2_5_VLConfig(text_config=dict(**TEXT, rope_scaling=MROPE),
                                              vision_config=dict(**QWEN_VISION, fullatt_block_indexes=[0])),
    "qwen3_vl": lambda: tf.Qwen3VLConfig(text_config=dict(**TEXT, head_dim=16, rope_scaling=MROPE),
                                         vision_config=dict(**QWEN_VISION, deepstack_visual_indexes=[0])),
    "qwen3_vl_moe": lambda: tf.Qwen3VLMoeConfig(text_config=dict(**TEXT, head_dim=16, **MOE, rope_scaling=MROPE),
                                                vision_config=dict(**QWEN_VISION, deepstack_visual_indexes=[0])),
    "kimi_k25": lambda: tf.Kimi_K25Config(  # the default vision tower alone is ~440M parameters
        text_config=dict(**TEXT, **MLA), projection_hidden_size=32,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)),
}


def build(family: str) -> torch.nn.Module:
    """The model a checkpoint of this family loads as: the whole vision-language wrapper when there is one."""
    torch.manual_seed(0)
    cfg = CONFIGS[family]()
    auto = tf.AutoModelForImageTextToText if hasattr(cfg, "vision_config") else tf.AutoModelForCausalLM
    return auto.from_config(cfg).eval()


def hooked_modules(model: torch.nn.Module) -> set[int]:
    return {id(m) for m in model.modules() if m._forward_pre_hooks or m._forward_hooks}


# HFEngine moves a given model to its dtype, which casts Llama-4's complex vision rope buffer (never run here)
@pytest.mark.filterwarnings("ignore:Casting complex values to real")
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_consumer_hooks_the_text_decoders_layers(family):
    model = build(family)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000, "keep the model tiny"
    text_model, layers, norm = find_text_decoder(model)
    name = next(n for n, m in model.named_modules() if m is layers)
    assert len(layers) == model.config.get_text_config().num_hidden_layers == LAYERS
    assert not any(t in name for t in ("vision", "visual")), name
    assert text_model.layers is layers and norm is not None

    aux = [0, 1, LAYERS - 1]
    engine = HFEngine(model, aux_layer_ids=aux, dtype=torch.float32, device="cpu")
    by_engine = hooked_modules(model)
    ids = torch.arange(1, 6)
    cap = engine.capture([ids])[0]
    engine.close()
    target = HFTarget(model, aux)
    by_eval = hooked_modules(model)
    target.close()
    assert engine.layers is layers and target.layers is layers
    assert by_eval == {id(layers[k]) for k in aux}
    assert by_engine == by_eval | {id(norm)}  # the engine also stops the forward at the final norm
    assert not hooked_modules(model)
    # and they are the layers a text forward runs: the engine captured transformers' hidden_states[k]
    with torch.no_grad():
        states = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    for j, k in enumerate(aux):
        torch.testing.assert_close(cap.aux[:, j * TEXT["hidden_size"]:(j + 1) * TEXT["hidden_size"]], states[k][0])
