"""SGLang's EAGLE-3 loader rules, written out for tests/test_export.py (SGLang cannot be installed here)."""

from __future__ import annotations

import torch

# SGLang's EAGLE-3 loader, as read in sgl-project/sglang python/sglang/srt/models/llama_eagle3.py
# (LlamaForCausalLMEagle3.load_weights, LlamaModel, LlamaDecoderLayer) and models/llama.py
# (set_eagle3_layers_to_capture); rules written from reading it, not copied:
# 1. The module tree: `model.embed_tokens` [vocab, H]; `model.fc` = Linear(3 x target_hidden_size -> H),
#    three aux states, no bias unless config.bias; `model.midlayer` is the decoder layer, with a fused
#    `self_attn.qkv_proj` whose input is 2H ([embedding ; hidden]), `self_attn.o_proj`, a fused
#    `mlp.gate_up_proj`, `mlp.down_proj`, `input_layernorm`, `hidden_norm`, `post_attention_layernorm`;
#    `model.norm`; `lm_head` [draft_vocab_size, H], which IS embed_tokens when tie_word_embeddings.
# 2. Names: `q_proj`/`k_proj`/`v_proj` load into the shards of `qkv_proj`, `gate_proj`/`up_proj` into
#    `gate_up_proj`; a name is looked up as given, then with `model.` in front; a name found neither
#    way is skipped without a warning (so a `layers.0.*` draft would keep a random decoder layer).
# 3. `d2t` becomes the hot-token table (draft id + d2t), `t2d` is skipped.
# 4. Aux layers: the ids in `eagle_config.eagle_aux_hidden_state_layer_ids` get 1 added before the
#    target captures the input of those layers (its defaults, used when the config has none, are
#    [2, N//2, N-3] with no shift).
SGLANG_STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
                  ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def sglang_params(c: dict) -> dict[str, tuple[int, ...]]:
    """Rule 1: the parameters SGLang's LlamaForCausalLMEagle3 allocates for a config (fused shapes)."""
    h, t = c["hidden_size"], c.get("target_hidden_size", c["hidden_size"])
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv, inter = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["intermediate_size"]
    p = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.fc.weight": (h, 3 * t),
         "model.midlayer.self_attn.qkv_proj.weight": (q + 2 * kv, 2 * h),
         "model.midlayer.self_attn.o_proj.weight": (h, q),
         "model.midlayer.mlp.gate_up_proj.weight": (2 * inter, h), "model.midlayer.mlp.down_proj.weight": (h, inter),
         "model.midlayer.input_layernorm.weight": (h,), "model.midlayer.hidden_norm.weight": (h,),
         "model.midlayer.post_attention_layernorm.weight": (h,), "model.norm.weight": (h,)}
    if not c.get("tie_word_embeddings", False):
        p["lm_head.weight"] = (c["draft_vocab_size"], h)
    return p


def sglang_load(c: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, list[tuple[int, ...]]], list[str]]:
    """Rules 2-3: where each checkpoint tensor lands (param -> shapes of its shards), and what is skipped."""
    params, landed, skipped = sglang_params(c), {}, []
    for name, t in tensors.items():
        if name in ("d2t", "t2d"):
            continue
        for shard, fused in SGLANG_STACKED.items():
            if shard in name:
                name = name.replace(shard, fused)
                break
        target = name if name in params else f"model.{name}"
        if target in params:
            landed.setdefault(target, []).append(tuple(t.shape))
        else:
            skipped.append(name)
    return landed, skipped
