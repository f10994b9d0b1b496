"""An EAGLE-3 draft whose decoder layer uses DeepSeek's latent attention (`--draft-attention mla`,
eyas.model.mla): its attention against transformers' own DeepseekV3Attention (plain rope and
DeepSeek's yarn, with and without a query down-projection), the training-time-test unroll against
inference replayed with the KV cache (math and flex), its dims from an MLA target and the refusals,
and the export for vLLM and SGLang read back exactly. vLLM serving it: tests/test_mla_engines.py."""

from __future__ import annotations

import json

import pytest
import torch
from test_ttt import V_D, H, V, assert_unroll_matches_replay, fast_loss, rel

from eyas.engines.head import TargetHead
from eyas.model.attention import causal_attend
from eyas.model.config import DraftConfig, DraftOptions
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.mla import MLAAttention
from eyas.model.vocab import build_draft_vocab
from eyas.utils.io import EyasError

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
MLA = dict(q_lora_rank=24, kv_lora_rank=40, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10)


def deepseek_config(q_lora_rank: int | None = 24, yarn: bool = False, **over):
    from transformers import DeepseekV3Config

    rope = {"rope_theta": 1000.0, **(YARN if yarn else {"rope_type": "default"})}
    kw = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=4, first_k_dense_replace=4, max_position_embeddings=128, rms_norm_eps=1e-6,
              rope_parameters=rope, tie_word_embeddings=False, **{**MLA, "q_lora_rank": q_lora_rank})
    return DeepseekV3Config(**{**kw, **over})


def mla_draft(target_config, seed: int = 0, layers: int = 1, **opts) -> Eagle3Draft:
    """A random MLA draft for `target_config`, weights larger than the 0.02 init (the tests must see signal)."""
    cfg = DraftConfig.from_target_config(target_config, [1, 2, 3], options=DraftOptions(
        draft_vocab_size=V_D, draft_attention="mla", draft_layers=layers, **opts))
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    for p in draft.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    draft.set_vocab(*build_draft_vocab(torch.randint(0, 100, (V,)), V_D))
    return draft


@pytest.mark.parametrize(("q_lora_rank", "yarn"), [(24, False), (24, True), (None, False)],
                         ids=["q-lora", "yarn", "no-q-lora"])
def test_mla_attention_is_transformers_deepseek_attention(q_lora_rank, yarn):
    """The draft's attention with transformers' weights computes DeepseekV3Attention's output: rope on
    interleaved pairs, yarn's frequencies, cos/sin and softmax scales, no query down-projection."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = deepseek_config(q_lora_rank, yarn)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = DeepseekV3Attention(config, layer_idx=0).eval()
    for p in theirs.parameters():
        p.data.normal_(0, 0.3)
    draft = mla_draft(config)
    mine = draft.layers[0].self_attn
    assert isinstance(mine, MLAAttention) and draft.config.head_dim == 14 and draft.config.rope_dim == 6
    if yarn:
        assert draft.config.rope_scaling["rope_type"] == "yarn" and mine.q_scale > 1.2
    mine = MLAAttention(draft.config, H)  # a later layer's attention reads H, as transformers' does
    mine.load_state_dict(theirs.state_dict())

    T = 40  # past original_max_position_embeddings: yarn's interpolated frequencies count
    x = torch.randn(2, T, H)
    pos = torch.arange(T)[None].expand(2, T)
    with torch.no_grad():
        rope = DeepseekV3RotaryEmbedding(config)(x, pos)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        want = theirs(x, rope, mask)[0]
        cos, sin = draft.rotary(pos, x.dtype)
        got = mine(x, cos, sin, causal_attend)
    assert rel(got, want) < 1e-5


def make_mla_setup(seed: int = 0, layers: int = 1, yarn: bool = False):
    """test_ttt's setup (same vocabulary, head and packs) with an MLA draft."""
    draft = mla_draft(deepseek_config(yarn=yarn), seed, layers)
    head = TargetHead(torch.randn(V, H), 1 + 0.1 * torch.randn(H), torch.randn(V, H), 1e-6)
    draft.load_target_embedding(head.embed_tokens)
    return draft, head


@pytest.mark.parametrize(("steps", "layers", "yarn"), [(3, 1, False), (3, 2, True)])
def test_mla_ttt_matches_inference_replay(steps, layers, yarn):
    """The TTT unroll of an MLA draft (keys and values of its own width) equals inference replayed
    with the KV cache, loss, statistics and gradients; flex attention gives math's loss."""
    draft, head = make_mla_setup(layers=layers, yarn=yarn)
    pack, loss, stats = assert_unroll_matches_replay(draft, head, steps)
    with torch.no_grad():
        flex_loss, flex_stats = fast_loss(draft, head, pack, steps, attention="flex")
    assert rel(flex_loss, loss.detach()) < 1e-5 and torch.allclose(flex_stats, stats, rtol=1e-5, atol=1e-4)


def test_mla_dims_come_from_the_target_or_the_options():
    cfg = DraftConfig.from_target_config(deepseek_config(), [1, 2, 3], options=DraftOptions(draft_attention="mla"))
    assert (cfg.attention, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim) == ("mla", 24, 40, 8, 6, 10)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rope_dim) == (4, 14, 6)
    given = DraftConfig.from_target_config(deepseek_config(q_lora_rank=None), [1, 2, 3], options=DraftOptions(
        draft_attention="mla", mla_kv_lora_rank=16, mla_v_head_dim=4))
    assert (given.q_lora_rank, given.kv_lora_rank, given.v_head_dim, given.qk_nope_head_dim) == (0, 16, 4, 8)

    # a Llama-style draft's config reads (and fingerprints) as before MLA existed
    llama = DraftConfig.from_target_config(deepseek_config(), [1, 2, 3])
    assert not {"attention", "kv_lora_rank", "q_lora_rank"} & set(llama.to_dict()) and llama.rope_dim == llama.head_dim


def test_mla_refusals():
    from transformers import LlamaConfig

    llama = LlamaConfig(vocab_size=V, hidden_size=H, num_attention_heads=4, num_hidden_layers=4, intermediate_size=64)
    with pytest.raises(EyasError, match="no MLA attention.*--mla-q-lora-rank, --mla-kv-lora-rank"):
        DraftConfig.from_target_config(llama, [1, 2, 3], options=DraftOptions(draft_attention="mla"))
    dims = {f"mla_{k}": v for k, v in MLA.items()}
    on_llama = DraftConfig.from_target_config(llama, [1, 2, 3], options=DraftOptions(draft_attention="mla", **dims))
    assert (on_llama.attention, on_llama.kv_lora_rank) == ("mla", 40)
    with pytest.raises(EyasError, match="add --draft-attention mla"):
        DraftOptions(mla_kv_lora_rank=512)
    with pytest.raises(EyasError, match="dflash draft has none"):
        DraftOptions(draft_attention="mla", family="dflash")
    with pytest.raises(EyasError, match="--mla-v-head-dim 0"):
        DraftOptions(draft_attention="mla", mla_v_head_dim=0)
    with pytest.raises(EyasError, match="odd"):
        DraftConfig.from_target_config(deepseek_config(), [1, 2, 3],
                                       options=DraftOptions(draft_attention="mla", mla_qk_rope_head_dim=5))
    linear = deepseek_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0})
    with pytest.raises(EyasError, match="rope scaling"):
        DraftConfig.from_target_config(linear, [1, 2, 3], options=DraftOptions(draft_attention="mla"))


def test_mla_draft_saves_and_loads(tmp_path):
    draft = mla_draft(deepseek_config(yarn=True), layers=2)
    draft.save_pretrained(tmp_path / "d")
    again = Eagle3Draft.from_pretrained(tmp_path / "d")
    assert again.config == draft.config
    assert json.loads((tmp_path / "d" / "config.json").read_text())["attention"] == "mla"
    for k, v in draft.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


KIMI_CHATS = [[{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1 2 3 4 5"}],
              [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sea."}],
              [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there, how are you?"}]]


@pytest.mark.usefixtures("one_thread")
def test_mla_draft_for_kimi_trains_exports_imports_and_decodes(tmp_path):
    """On a tiny Kimi-K2.5 the MLA draft takes the target's dims, trains, exports for vLLM and SGLang
    (speculators has no MLA layer: skipped), reads back identical from both, and decodes losslessly."""
    from _kimi import make_kimi

    from eyas.model.checkpoints import import_draft
    from eyas.recipes.evaluate import EvalOptions, run_eval
    from eyas.recipes.export import ExportOptions, run_export
    from eyas.recipes.extract import ExtractOptions, run_extract
    from eyas.recipes.prepare import PrepareOptions, run_prepare
    from eyas.recipes.train import TrainOptions, run_train

    kimi = make_kimi(tmp_path / "target")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in KIMI_CHATS))
    prepared = run_prepare(PrepareOptions(inputs=[str(chats)], model=str(kimi), out=tmp_path / "p", num_workers=1))
    store = run_extract(ExtractOptions(prepared=prepared, out=tmp_path / "store", model=str(kimi),
                                       aux_layer_ids=[1, 2, 3], dtype="float32", device="cpu"))
    run_train(TrainOptions(store=store, out=tmp_path / "train", draft_attention="mla", draft_vocab_size=64,
                           ttt_steps=2, token_budget=512, num_workers=0, max_steps=3, log_every=1, save_every=0,
                           report_to="none"))
    draft_dir = tmp_path / "train" / "draft"
    cfg = json.loads((draft_dir / "config.json").read_text())
    assert (cfg["attention"], cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == ("mla", 64, 512, 64)
    trained = import_draft(draft_dir)

    logs: list[str] = []
    written = run_export(ExportOptions(draft=draft_dir, format="all", out=tmp_path / "export", model=kimi,
                                       dtype="float32"), log=logs.append)
    assert {p.name for p in written} == {"vllm", "sglang"}
    assert any("speculators: skipped" in line and "MLA" in line for line in logs), logs
    served = {p.name: json.loads((p / "config.json").read_text()) for p in written}
    assert served["vllm"]["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
    assert served["sglang"]["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert {c["model_type"] for c in served.values()} == {"deepseek_v2"}  # vLLM rewrites deepseek_v3 into MTP
    for fmt in ("vllm", "sglang"):
        back = import_draft(tmp_path / "export" / fmt, target=kimi)
        assert back.config.to_dict() == trained.config.to_dict(), fmt
        for k, v in trained.state_dict().items():
            assert torch.equal(back.state_dict()[k], v), (fmt, k)

    report = run_eval(EvalOptions(draft=str(draft_dir), model=str(kimi), prompts=str(prepared), max_prompts=1,
                                  max_turns=1, max_new_tokens=6, chain="2", tree="4:2:2", out=tmp_path / "eval",
                                  device="cpu", dtype="float32"))
    overall = json.loads((report / "report.json").read_text())["results"]["all"]
    assert all(overall[m]["identical_to_target"] for m in ("chain-2", "tree-4:2:2"))  # greedy: lossless
