"""eyas.engines.graph_decode: batched decoding over a static KV cache writes what transformers'
`generate` writes one prompt at a time (greedy, fp32), samples reproducibly, and refuses a model or
a transformers version whose internals break its contract. (The CUDA-graph replay itself needs a GPU:
benchmarks/regenerate.py checks it there against the same eager step.)"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from eyas.engines.graph_decode import GraphDecoder, Sampler, StaticKV
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 9, 13, 2, 40, 41, 7, 3], [11, 12], [3] * 12, [60, 61, 62, 63, 64]]
STOP = 17


def tiny_llama() -> tf.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=256)
    return tf.LlamaForCausalLM(cfg).eval()


def tiny_qwen3() -> tf.Qwen3ForCausalLM:
    torch.manual_seed(1)
    cfg = tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=32, vocab_size=100, max_position_embeddings=256)
    return tf.Qwen3ForCausalLM(cfg).eval()


def one_at_a_time(model, prompts, max_new, stop):
    """transformers' generate on each prompt alone (no padding), cut after the first stop token."""
    out = []
    for p in prompts:
        with torch.no_grad():
            g = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new, eos_token_id=stop,
                               pad_token_id=0)[0, len(p):].tolist()
        out.append(g[:next((i + 1 for i, x in enumerate(g) if x == stop), len(g))])
    return out


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3-gqa4"])
def test_greedy_equals_generate_one_prompt_at_a_time(make):
    model = make()
    want = one_at_a_time(model, PROMPTS, 20, STOP)
    dec = GraphDecoder(model)
    got = dec.generate(PROMPTS, 20, [STOP], pad_id=0)
    assert dec.checked and got == want
    assert model.config._attn_implementation == "sdpa"  # the model's own attention is back afterwards
    # a stop token ends a reply and is kept: pick one the model really produces mid-reply
    stop = want[0][4]
    cut = dec.generate(PROMPTS, 20, [stop], pad_id=0)
    assert cut == one_at_a_time(model, PROMPTS, 20, stop) and cut[0][-1] == stop and len(cut[0]) <= 5


def test_groups_that_fit_a_memory_budget_decode_the_same():
    model = tiny_llama()
    whole = GraphDecoder(model).generate(PROMPTS, 10, [STOP], pad_id=0)
    per_row = 2 * 2 * 2 * 16 * 4 * (12 + 10)  # k+v, 2 layers, 2 kv heads, head_dim 16, fp32, longest row
    split = GraphDecoder(model, max_cache_bytes=2 * per_row)  # at most two rows per group
    assert len(list(split._groups(list(range(4)), PROMPTS, 10))) >= 2
    assert split.generate(PROMPTS, 10, [STOP], pad_id=0) == whole


def test_a_group_that_runs_out_of_memory_is_halved_and_decodes_the_same(monkeypatch):
    """Out of memory in a group (activations beyond the cache estimate): it is split, not fatal."""
    model = tiny_llama()
    dec = GraphDecoder(model)
    whole = dec.generate(PROMPTS, 10, [STOP], pad_id=0)
    real, sizes = GraphDecoder._generate_group, []

    def tight(self, prompts, *args, **kwargs):  # a device that holds at most 2 rows at a time
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, prompts, *args, **kwargs)

    monkeypatch.setattr(GraphDecoder, "_generate_group", tight)
    assert dec.generate(PROMPTS, 10, [STOP], pad_id=0) == whole
    assert sizes == [4, 2, 2]


def test_sampling_is_seeded_and_its_limits_work():
    model = tiny_llama()
    dec = GraphDecoder(model)
    hot = Sampler(temperature=1.5)
    a = dec.generate(PROMPTS, 12, [STOP], 0, hot, seed=1)
    assert a == dec.generate(PROMPTS, 12, [STOP], 0, hot, seed=1)
    assert a != dec.generate(PROMPTS, 12, [STOP], 0, hot, seed=2)
    greedy = dec.generate(PROMPTS, 12, [STOP], 0)
    assert a != greedy
    # keeping only the top token (by count or by mass) is greedy whatever the temperature
    assert dec.generate(PROMPTS, 12, [STOP], 0, Sampler(temperature=1.5, top_k=1), seed=3) == greedy
    assert dec.generate(PROMPTS, 12, [STOP], 0, Sampler(temperature=1.5, top_p=1e-6), seed=3) == greedy
    # top-k 5: every sampled token is among the 5 likeliest at its step
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]).repeat(2000, 1)
    picks = Sampler(temperature=1.0, top_k=5)(logits)
    assert set(picks.tolist()) == {2, 3, 4, 5, 6}
    picks = Sampler(temperature=1.0, top_p=0.5)(logits)  # p(6) = 0.63 alone reaches 0.5
    assert set(picks.tolist()) == {6}


def test_a_broken_cache_contract_is_caught_before_decoding(monkeypatch):
    """If a transformers version stops honouring the cache or the mask, the self-check refuses."""
    model = tiny_llama()
    real = StaticKV.update

    def misplaced(self, key, value, layer_idx, *args, **kwargs):  # keys written one slot too far
        self.pos += 1
        try:
            return real(self, key, value, layer_idx)
        finally:
            self.pos -= 1

    monkeypatch.setattr(StaticKV, "update", misplaced)
    with pytest.raises(EyasError, match="differ from a plain forward.*--engine generate"):
        GraphDecoder(model).generate(PROMPTS, 4, [STOP], pad_id=0)
    assert model.config._attn_implementation == "sdpa"


def test_sliding_windows_are_refused_once_a_sequence_outgrows_them():
    cfg = tf.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=50, sliding_window=16)
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg).eval()
    dec = GraphDecoder(model)
    short = [[3, 4, 5]]
    assert dec.generate(short, 8, [STOP], 0) == one_at_a_time(model, short, 8, STOP)  # 11 tokens: inside the window
    with pytest.raises(EyasError, match="sliding-window attention \\(16 tokens\\).*reaches 17"):
        dec.generate([[3] * 9], 8, [STOP], 0)
