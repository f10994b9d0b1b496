"""The draft model: config derived from real target configs, vocab maps, attention patterns, checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

from eyas.model.attention import KVCache, TTTAttention, causal_attend
from eyas.model.config import DraftConfig
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.vocab import build_draft_vocab, draft_to_target_ids, target_to_draft_ids
from eyas.utils.io import EyasError


def tiny_config(**kw) -> DraftConfig:
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=100, draft_vocab_size=40, target_hidden_size=64, aux_layer_ids=[1, 2, 3])
    base.update(kw)
    return DraftConfig(**base)


def test_config_from_smollm2(smollm2_dir):
    cfg = DraftConfig.from_target_config(AutoConfig.from_pretrained(smollm2_dir), [2, 15, 27], 32000)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (576, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.draft_vocab_size == 32000 and cfg.vocab_size == 49152
    assert cfg.max_position_embeddings == 8192


def test_config_keeps_llama3_rope_scaling_and_positions():
    target = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=32,
                         vocab_size=1000, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg = DraftConfig.from_target_config(target, [2, 16, 29], draft_vocab_size=32000, max_position_embeddings=2048)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.max_position_embeddings == 131072  # never below the target's
    assert cfg.draft_vocab_size == 1000  # capped at the target vocab
    draft = Eagle3Draft(cfg)
    # llama3 scaling changes the low frequencies relative to plain rope
    plain = 1.0 / (500000.0 ** (torch.arange(0, 32, 2).float() / 32))
    assert not torch.allclose(draft._inv_freq, plain)


@pytest.mark.parametrize("target", [
    Qwen3MoeConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=6,
                   vocab_size=500, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    DeepseekV3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=61,
                     vocab_size=500, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4,
                     q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32),
])
def test_config_from_moe_targets(target):
    cfg = DraftConfig.from_target_config(target, [2, 3, 4])
    draft = Eagle3Draft(cfg)
    ids = torch.randint(0, 500, (1, 5))
    out = draft(ids, draft.fuse(torch.randn(1, 5, 3 * 128)), torch.arange(5)[None], causal_attend)
    assert out.shape == (1, 5, 128) and torch.isfinite(out).all()


def test_draft_vocab_top_tokens_and_offset_maps():
    counts = torch.zeros(100, dtype=torch.int64)
    counts[[5, 50, 7, 99]] = torch.tensor([10, 30, 20, 1])
    d2t, t2d = build_draft_vocab(counts, 3)
    assert sorted(draft_to_target_ids(d2t).tolist()) == [5, 7, 50]
    assert draft_to_target_ids(d2t).tolist() == [5, 7, 50]  # ascending target ids
    assert t2d.sum() == 3 and t2d[[5, 7, 50]].all()
    inv = target_to_draft_ids(t2d)
    assert inv[50] == 2 and inv[99] == -1


def test_draft_vocab_larger_than_seen_tokens_is_filled():
    counts = torch.zeros(100, dtype=torch.int64)
    counts[[3, 60]] = 5
    d2t, t2d = build_draft_vocab(counts, 10)
    ids = draft_to_target_ids(d2t)
    assert ids.numel() == 10 and t2d.sum() == 10
    assert {3, 60} <= set(ids.tolist()) and len(set(ids.tolist())) == 10


def _brute_ttt(q, keys, values):
    """Each query's visible keys written out one row at a time."""
    B, nh, T, hd = q.shape
    rep = nh // keys[0].shape[1]
    kf = [k.repeat_interleave(rep, 1) for k in keys]
    vf = [v.repeat_interleave(rep, 1) for v in values]
    out = torch.zeros_like(q)
    for t in range(T):
        K = torch.stack([kf[0][:, :, s] for s in range(t + 1)] + [k[:, :, t] for k in kf[1:]], 2)
        V = torch.stack([vf[0][:, :, s] for s in range(t + 1)] + [v[:, :, t] for v in vf[1:]], 2)
        p = torch.softmax(q[:, :, t:t + 1] @ K.transpose(-1, -2) / hd**0.5, -1)
        out[:, :, t] = (p @ V)[:, :, 0]
    return out


@pytest.mark.parametrize(("backend", "steps"), [("math", None), ("flex", None), ("flex", 3), ("flex", 5)])
def test_ttt_attention_matches_brute_force(backend, steps):
    torch.manual_seed(0)
    B, nh, nkv, T, hd = 2, 4, 2, 24, 16
    att = TTTAttention(backend, steps=steps)
    keys, values = [], []
    for step in range(3):
        q = torch.randn(B, nh, T, hd)
        k, v = torch.randn(B, nkv, T, hd), torch.randn(B, nkv, T, hd)
        keys.append(k)
        values.append(v)
        out = att(q, k, v)
        ref = _brute_ttt(q, keys, values)
        assert (out - ref).norm() / ref.norm() < 1e-5, f"step {step}"


def test_kv_cache_decoding_matches_causal_prefill():
    torch.manual_seed(0)
    draft = Eagle3Draft(tiny_config())
    ids = torch.randint(0, 100, (2, 12))
    hidden = draft.fuse(torch.randn(2, 12, 3 * 64))
    pos = torch.arange(12).expand(2, 12)
    full = draft(ids, hidden, pos, causal_attend)
    cache = KVCache()
    parts = [draft(ids[:, a:b], hidden[:, a:b], pos[:, a:b], cache) for a, b in [(0, 7), (7, 8), (8, 12)]]
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-5
    cache.crop(7)
    again = draft(ids[:, 7:], hidden[:, 7:], pos[:, 7:], cache)
    assert (again - full[:, 7:]).abs().max() < 1e-5


def test_eagle31_fc_norm_balances_aux_layers_and_norm_output_bounds_the_feedback():
    """fc_norm: the fused input no longer depends on each aux layer's scale (without it, a late layer
    100x larger changes it); norm_output: a step hands on a state of RMS ~1
    times the final norm's weight whatever its input's scale, and lm_head reads it without a second
    norm (the logits are those of the plain draft's raw output)."""
    torch.manual_seed(0)
    aux = torch.randn(1, 6, 3 * 64)
    scaled = torch.cat([aux[..., :64], aux[..., 64:128], 100 * aux[..., 128:]], dim=-1)
    plain, e31 = Eagle3Draft(tiny_config()), Eagle3Draft(tiny_config(fc_norm=True, norm_output=True))
    e31.load_state_dict(plain.state_dict(), strict=False)  # same weights; the new norms start at 1
    assert torch.allclose(e31.fuse(scaled), e31.fuse(aux), atol=1e-5)
    assert not torch.allclose(plain.fuse(scaled), plain.fuse(aux), atol=1e-2)
    ids, pos = torch.randint(0, 100, (1, 6)), torch.arange(6)[None]
    for scale in (1.0, 1000.0):
        raw = plain(ids, scale * plain.fuse(aux), pos, causal_attend)
        out = e31(ids, scale * plain.fuse(aux), pos, causal_attend)
        assert torch.allclose(out.pow(2).mean(-1).sqrt(), torch.ones(1, 6), atol=1e-3)
        assert torch.allclose(e31.logits(out), plain.logits(raw), atol=1e-5)


def test_checkpoint_roundtrip_and_bad_checkpoints(tmp_path):
    draft = Eagle3Draft(tiny_config())
    counts = torch.arange(100)
    draft.set_vocab(*build_draft_vocab(counts, 40))
    draft.save_pretrained(tmp_path / "d")
    back = Eagle3Draft.from_pretrained(tmp_path / "d")
    for k, v in draft.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k

    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    del state["fc.weight"]
    state["lm_head.weight"] = torch.zeros(41, 64)
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(EyasError, match=r"missing fc.weight.*lm_head.weight has shape \(41, 64\)"):
        Eagle3Draft.from_pretrained(tmp_path / "d")


def test_bf16_cast_keeps_rope_frequencies_exact():
    draft = Eagle3Draft(tiny_config(rope_theta=500000.0)).to(torch.bfloat16)
    assert draft._inv_freq.dtype == torch.float32
