"""The hf engine captures exactly transformers' hidden_states[k] (input of layer k) and the pre-norm final
state, for dense, MoE, MLA and vision-language targets, in ragged batches, without the lm_head."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from eyas.engines import group_batches, load_engine
from eyas.engines.base import parse_layer_ids
from eyas.engines.hf import HFEngine
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")




def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=320)


def tiny_config(kind: str):
    if kind == "llama":
        return tf.LlamaConfig(**SMALL)
    if kind == "qwen2":
        return tf.Qwen2Config(**SMALL)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 decoder_sparse_step=1)
    if kind == "deepseek_v3":  # MoE + MLA (the Kimi-K2.5 text architecture)
        return tf.DeepseekV3Config(**{**SMALL, "num_key_value_heads": 4}, moe_intermediate_size=32,
                                   n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                   first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16,
                                   q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    if kind == "gemma3":  # (1 + w) norms, scaled embeddings, sliding-window layers shorter than the inputs
        return tf.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=4)
    if kind == "gemma3_vl":
        return tf.Gemma3Config(text_config=dict(**SMALL, head_dim=16, sliding_window=4),
                               vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=28, patch_size=14),
                               mm_tokens_per_image=4)
    if kind == "qwen2_vl":
        return tf.Qwen2VLConfig(text_config=dict(**SMALL, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                                vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2))
    raise KeyError(kind)


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tiny_config(kind)
    try:
        return tf.AutoModelForCausalLM.from_config(cfg).eval()
    except ValueError:
        return tf.AutoModelForImageTextToText.from_config(cfg).eval()


def count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def check_against_reference(model, engine: HFEngine, seqs: list[torch.Tensor], bound: float) -> None:
    """Each sequence's captures vs one-at-a-time output_hidden_states (which runs the whole model)."""
    H = engine.hidden_size
    caps = engine.capture(seqs)
    head = engine.target_head()
    assert len(caps) == len(seqs)
    for s, c in zip(seqs, caps, strict=True):
        assert c.aux.shape == (len(s), len(engine.aux_layer_ids) * H) and c.final.shape == (len(s), H)
        with torch.no_grad():
            ref = model(input_ids=s[None], output_hidden_states=True)
        hs = ref.hidden_states
        assert len(hs) == engine.num_layers + 1
        for j, k in enumerate(engine.aux_layer_ids):
            assert rel(c.aux[:, j * H:(j + 1) * H], hs[k][0]) <= bound, f"layer {k}"
        # final state: the target's own norm of it is hidden_states[-1], its head gives the logits
        assert rel(head.norm(c.final), hs[-1][0]) <= bound
        assert rel(head.logits(c.final), ref.logits[0]) <= bound
        if 0 in engine.aux_layer_ids:  # hidden_states[0] is the (scaled) token embedding
            j = engine.aux_layer_ids.index(0)
            assert rel(head.embed_tokens[s] * head.embed_scale, c.aux[:, j * H:(j + 1) * H]) <= bound


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3_moe", "deepseek_v3", "gemma3", "gemma3_vl", "qwen2_vl"])
def test_tiny_models_capture_the_right_layers(kind):
    model = build(kind)
    engine = HFEngine(model, aux_layer_ids=[0, 2, 5], dtype="float32", device="cpu")
    assert engine.num_layers == 6 and engine.hidden_size == 64
    lm_calls = count_calls(model.get_output_embeddings())
    norm_calls = count_calls(engine.norm)
    vision = next((m for n, m in model.named_children() if n in ("vision_tower", "visual")), None) or next(
        (m for n, m in model.model.named_children() if n in ("vision_tower", "visual")), None)
    vision_calls = count_calls(vision) if vision is not None else [0]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in (9, 14, 3)]  # ragged: right padding inside
    engine.capture(seqs)
    assert lm_calls[0] == 0 and norm_calls[0] == 0, "the forward must stop before the final norm and lm_head"
    assert vision_calls[0] == 0, "the vision tower must not run"
    if kind.endswith("_vl"):
        assert vision is not None and type(engine.text_model).__name__.endswith(("TextModel", "Model"))
    check_against_reference(model, engine, seqs, bound=1e-5)
    check_against_reference(model, engine, seqs[1:2], bound=1e-5)  # no padding: the states are views
    head = engine.target_head()
    assert (head.norm_offset, head.embed_scale > 1) == ((1.0, True) if kind.startswith("gemma3") else (0.0, False))


def test_ragged_batch_equals_one_at_a_time():
    model = build("llama")
    engine = HFEngine(model, aux_layer_ids=[1, 3, 5], dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in (17, 4, 11, 17, 1)]
    batch = engine.capture(seqs)
    for s, c in zip(seqs, batch, strict=True):
        alone = engine.capture([s])[0]
        assert rel(c.aux, alone.aux) <= 1e-5 and rel(c.final, alone.final) <= 1e-5
    flat = engine.capture_flat(seqs)
    assert flat.cu_seqlens == [0, 17, 21, 32, 49, 50] and flat.aux.shape == (50, 3 * 64)


def test_load_vision_language_wrapper_from_a_folder(tmp_path):
    """AutoModelForCausalLM refuses Qwen2-VL: the engine falls back to the image-text class, runs only text."""
    model = build("qwen2_vl")
    model.save_pretrained(tmp_path)
    engine = load_engine("hf", str(tmp_path), aux_layer_ids=[1, 4], dtype="float32", device="cpu")
    assert type(engine.text_model).__name__ == "Qwen2VLTextModel" and engine.aux_layer_ids == [1, 4]
    seqs = [torch.arange(5, 12), torch.arange(30, 33)]
    check_against_reference(engine.model, engine, seqs, bound=1e-5)


def test_default_and_bad_aux_layer_ids():
    model = build("llama")
    # [2, N//2, N-3] repeats a layer below 7 layers: the first, middle and last past the embeddings instead
    assert HFEngine(model, dtype="float32", device="cpu").aux_layer_ids == [1, 3, 5]
    with pytest.raises(EyasError, match=r"\[2, 3, 3\]: a layer read twice"):
        HFEngine(model, aux_layer_ids=[2, 3, 3], dtype="float32", device="cpu")
    with pytest.raises(EyasError, match=r"out of range.*6 decoder layers"):
        HFEngine(model, aux_layer_ids=[2, 6], dtype="float32", device="cpu")
    with pytest.raises(EyasError, match=r"in layer order, got \[4, 1\].*write 1,4"):  # vLLM would serve [1, 4]
        HFEngine(model, aux_layer_ids=[4, 1], dtype="float32", device="cpu")
    with pytest.raises(EyasError, match="unknown engine"):
        load_engine("nope", model)
    # the one parser of every --aux-layers / --aux-layer-ids option
    assert parse_layer_ids("2, 15,27") == [2, 15, 27] and parse_layer_ids("") is None
    with pytest.raises(EyasError, match=r"--aux-layer-ids must be comma-separated integers.*'2,x'"):
        parse_layer_ids("2,x", "--aux-layer-ids")


def test_plan_batches_respects_the_budget_with_little_padding():
    lengths = [5, 100, 7, 64, 64, 3, 200, 50, 51, 49]
    batches = group_batches(lengths, token_budget=256)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert max(lengths[i] for i in b) * len(b) <= 256 or len(b) == 1
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    assert padded <= 1.25 * sum(lengths)
    assert group_batches([300], 100) == [[0]]  # longer than the budget: alone
    # a wide spread of lengths: batches split to stay mostly real tokens
    spread = list(range(10, 1010, 10))
    batches = group_batches(spread, token_budget=4000)
    for b in batches:
        pad = max(spread[i] for i in b) * len(b)
        assert pad <= 4000 and (pad - sum(spread[i] for i in b) <= 0.2 * pad
                                or len(b) * max(spread[i] for i in b) < 2000)
    assert group_batches([5] * 10, 100) == [list(range(10))]  # equal lengths: one full batch


@pytest.mark.slow
def test_smollm2_real_weights_fp32_and_bf16(smollm2_dir):
    """Real SmolLM2: fp32 capture within 1e-5 of output_hidden_states; bf16 within 2e-2 of bf16's own
    output_hidden_states, and its aux layers within 2e-2 of the fp32 states."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The capital of France is Paris, and the capital of Italy is Rome.", "def add(a, b):\n    return a + b"]
    seqs = [torch.tensor(tok(t)["input_ids"]) for t in texts]
    eng32 = HFEngine(str(smollm2_dir), dtype="float32", device="cpu")
    assert (eng32.num_layers, eng32.hidden_size, eng32.aux_layer_ids) == (30, 576, [2, 15, 27])
    check_against_reference(eng32.model, eng32, seqs, bound=1e-5)
    ref = eng32.capture(seqs)
    eng16 = HFEngine(str(smollm2_dir), dtype="bfloat16", device="cpu")
    check_against_reference(eng16.model, eng16, seqs, bound=2e-2)
    for a, b in zip(eng16.capture(seqs), ref, strict=True):
        assert a.aux.dtype == torch.bfloat16
        assert rel(a.aux, b.aux) <= 2e-2
        assert rel(a.final, b.final) <= 5e-2  # 30 layers of bf16 rounding drift (measured ~2e-2)
