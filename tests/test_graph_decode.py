"""eyas.generate.graph_decode: continuous batching over static KV caches writes what transformers'
`generate` writes one prompt at a time (greedy, fp32) whatever the lanes and however rows are reused,
samples reproducibly, and refuses a model or a transformers version whose internals break its
contract. (The CUDA-graph replay itself needs a GPU: benchmarks/regenerate.py checks it there
against the same eager steps.)"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from eyas.generate.graph_decode import GraphDecoder, Lane, Sampler
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
    dec = GraphDecoder(model, 40, 20, [STOP], pad_id=0)
    got = dec.generate(PROMPTS)
    assert dec.checked and got == want and not dec.busy()
    assert model.config._attn_implementation == "sdpa"  # the model's own attention is back afterwards
    # a stop token ends a reply and is kept: pick one the model really produces mid-reply
    stop = want[0][4]
    cut = GraphDecoder(model, 40, 20, [stop], pad_id=0).generate(PROMPTS)
    assert cut == one_at_a_time(model, PROMPTS, 20, stop) and cut[0][-1] == stop and len(cut[0]) <= 5


def test_rows_are_reused_across_lanes_and_decode_the_same():
    """Three rows for eight prompts, in two lanes: short prompts take the short lane's row (or spill
    to the long lane when it is taken), long ones wait for the long lane's rows; every reply is
    still what generate writes for its prompt alone."""
    model = tiny_llama()
    prompts = [p[:3] for p in PROMPTS] + PROMPTS  # lengths 3, 2, 3, 3, 8, 2, 12, 5
    want = one_at_a_time(model, prompts, 10, STOP)
    dec = GraphDecoder(model, 24, 10, [STOP], pad_id=0, lanes=[(16, 1), (24, 2)], steps_per_poll=3)
    for i, p in enumerate(prompts):
        dec.submit(i, p)
    got, first = {}, True
    while dec.busy():
        for key, toks in dec.poll():
            got[key] = toks
        if first:  # prompt 0 took the short row, 1 and 2 spilled to the long lane, the rest waited
            short, long = dec.lanes
            assert short.keys == [0] and long.keys == [1, 2], (short.keys, long.keys)
            first = False
    assert [got[i] for i in range(len(prompts))] == want


def test_waiting_prompts_take_free_rows_by_rank():
    """A lower rank is admitted first (regenerate ranks a turn by its conversation's place, so the
    earliest conversations finish and are saved first), whatever the order of submission."""
    model = tiny_llama()
    dec = GraphDecoder(model, 40, 6, [STOP], pad_id=0, lanes=[(40, 2)], steps_per_poll=2)
    for key, rank in (("late", 9), ("early", 1), ("unranked", None), ("middle", 5)):
        dec.submit(key, PROMPTS[0], rank=rank)
    dec.poll()
    assert dec.lanes[0].keys == ["early", "unranked"]  # "unranked" has rank 2: its submission number
    assert [q[2] for q in dec.queue] == ["middle", "late"]


def test_prompts_that_do_not_fit_are_refused():
    dec = GraphDecoder(tiny_llama(), 16, 10, [STOP], pad_id=0)
    with pytest.raises(EyasError, match="a prompt of 7 tokens \\+ 10 new ones does not fit in max_length 16"):
        dec.submit(0, [1] * 7)
    with pytest.raises(EyasError, match="must include one of length >= 16"):
        GraphDecoder(tiny_llama(), 16, 4, [STOP], pad_id=0, lanes=[(8, 2)])


def test_default_lanes_split_the_memory_budget():
    model = tiny_llama()
    per_token = 2 * 2 * 2 * 16 * 4  # k+v, 2 layers, 2 kv heads, head_dim 16, fp32
    dec = GraphDecoder(model, 2048, 256, [STOP], pad_id=0, max_cache_bytes=2048 * per_token * 100)
    assert dec.lane_shapes == [(512, 60), (1024, 70), (2048, 50)]
    assert GraphDecoder(model, 2048, 256, [STOP], 0).lane_shapes == [(2048, 16)]  # a CPU without a budget


def test_sampling_is_seeded_and_its_limits_work():
    model = tiny_llama()

    def gen(sampler=None, seed=0):
        return GraphDecoder(model, 40, 12, [STOP], 0, sampler, lanes=[(40, 3)]).generate(PROMPTS, seed)

    hot = Sampler(temperature=1.5)
    a = gen(hot, seed=1)
    assert a == gen(hot, seed=1)
    assert a != gen(hot, seed=2)
    greedy = gen()
    assert a != greedy
    # keeping only the top token (by count or by mass) is greedy whatever the temperature
    assert gen(Sampler(temperature=1.5, top_k=1), seed=3) == greedy
    assert gen(Sampler(temperature=1.5, top_p=1e-6), seed=3) == greedy
    # top-k 5: every sampled token is among the 5 likeliest at its step
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]).repeat(2000, 1)
    picks = Sampler(temperature=1.0, top_k=5)(logits)
    assert set(picks.tolist()) == {2, 3, 4, 5, 6}
    picks = Sampler(temperature=1.0, top_p=0.5)(logits)  # p(6) = 0.63 alone reaches 0.5
    assert set(picks.tolist()) == {6}


def test_a_broken_cache_contract_is_caught_before_decoding(monkeypatch):
    """If a transformers version stops honouring the cache or the mask, the self-check refuses."""
    model = tiny_llama()
    real = Lane.update

    def misplaced(self, key, value, layer_idx, *args, **kwargs):  # decode keys written one slot too far
        self.pos += 1
        try:
            return real(self, key, value, layer_idx)
        finally:
            self.pos -= 1

    monkeypatch.setattr(Lane, "update", misplaced)
    with pytest.raises(EyasError, match="static KV caches with .*differ from a plain forward"):
        GraphDecoder(model, 40, 4, [STOP], pad_id=0).generate(PROMPTS)
    assert model.config._attn_implementation == "sdpa"


def test_sliding_windows_are_refused_when_sequences_can_outgrow_them():
    cfg = tf.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=50, sliding_window=16)
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg).eval()
    short = [[3, 4, 5]]
    got = GraphDecoder(model, 16, 8, [STOP], 0).generate(short)
    assert got == one_at_a_time(model, short, 8, STOP)  # 11 tokens: inside the window
    with pytest.raises(EyasError, match="sliding-window attention \\(16 tokens\\).*reach 17 tokens"):
        GraphDecoder(model, 17, 8, [STOP], 0)
