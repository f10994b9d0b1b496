"""Speculative sampling is lossless: the tokens it emits follow the target's own sampling distribution.

Chi-square tests with fixed seeds on (1) the acceptance rules alone, many draws on small random
distributions, with a wrong rule as a control that the test can fail, and (2) end to end on a tiny
Llama target (vocab 8) with a random EAGLE-3 draft, chain and tree, against the exact joint
distribution of the first generated tokens computed from the target itself.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.eval import ChainSpec, HFTarget, SpeculativeDecoder, TreeSpec
from eyas.eval.sampling import sample, target_probs, verify_chain_sampling, walk_tree_sampling
from eyas.model.config import DraftConfig
from eyas.model.eagle3 import Eagle3Draft


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small matmuls on a shared 2-core machine: one thread is ~10x faster than two fighting for cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


P_MIN = 1e-3  # fixed seeds make each test deterministic; a correct sampler passes with ~99.9% of seeds


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 draws are pooled into one."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a draw landed where the target has zero probability"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_chi2_helper_rejects_a_wrong_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    draws = torch.multinomial(p, 3000, replacement=True, generator=g)
    assert chi2_pvalue(torch.bincount(draws, minlength=3), p) > P_MIN
    assert chi2_pvalue(torch.bincount(draws, minlength=3), torch.tensor([0.4, 0.4, 0.2])) < 1e-6


def test_target_probs_temperature_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.allclose(target_probs(logits, 1.0), torch.tensor([0.5, 0.25, 0.15, 0.1]), atol=1e-6)
    # smallest set of top tokens holding >= 0.7 of the mass: {0, 1}
    assert torch.allclose(target_probs(logits, 1.0, top_p=0.7), torch.tensor([2 / 3, 1 / 3, 0, 0]), atol=1e-6)
    assert torch.allclose(target_probs(logits, 1.0, top_p=0.75), torch.tensor([2 / 3, 1 / 3, 0, 0]), atol=1e-6)
    assert torch.allclose(target_probs(logits, 1.0, top_p=0.76), torch.tensor([0.5, 0.25, 0.15, 0]) / 0.9, atol=1e-6)
    assert target_probs(logits, 1.0, top_p=0.1)[0] == 1.0  # the top token always stays
    hot = target_probs(logits, 2.0)
    assert torch.allclose(hot, torch.softmax(logits / 2, -1)) and hot[0] < 0.5


def _random_dists(rows: int, vocab: int, g: torch.Generator, scale: float = 1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, vocab, generator=g) * scale, dim=-1)


@pytest.mark.parametrize("k", [1, 3])
def test_chain_rule_emits_the_target_distribution(k):
    g = torch.Generator().manual_seed(10 + k)
    V, N = 8, 6000
    p, q = _random_dists(k + 1, V, g), _random_dists(k, V, g)
    first, accepted = torch.zeros(V), 0
    for _ in range(N):
        d = sample(q, g)  # [K] one draft token per position, drawn from q
        n, nxt = verify_chain_sampling(d, q, p, g)
        first[int(d[0]) if n > 0 else nxt] += 1
        accepted += n
    assert chi2_pvalue(first, p[0]) > P_MIN
    assert 0.1 < accepted / (N * k) < 0.9  # both the accept and the resample branches ran


def test_chain_rule_control_a_wrong_rule_fails():
    """Accepting with probability p(d) (forgetting to divide by q) is biased: the same test catches it."""
    g = torch.Generator().manual_seed(3)
    V, N = 8, 6000
    p, q = _random_dists(2, V, g), _random_dists(1, V, g)
    first = torch.zeros(V)
    for _ in range(N):
        d = int(sample(q[0], g))
        if torch.rand((), generator=g) < p[0, d]:
            first[d] += 1
        else:
            first[int(sample(p[0], g))] += 1
    assert chi2_pvalue(first, p[0]) < 1e-6


def test_tree_rule_emits_the_target_distribution():
    """A fixed tree: root -> tokens (2, 5, 1); node 1 (token 2) -> tokens (0, 2). First token ~ p[root]; after
    token 2 the next one ~ p[node 1] (whether node 1's children are accepted or the residual is sampled)."""
    g = torch.Generator().manual_seed(7)
    V, N = 8, 6000
    parents = [0, 0, 0, 0, 1, 1]
    tokens = [9, 2, 5, 1, 0, 2]  # tokens[0] is the root's own token, unused
    p = _random_dists(6, V, g, scale=1.0)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(N):
        path, nxt = walk_tree_sampling(parents, tokens, p, g)
        out = [tokens[i] for i in path] + [nxt]
        first[out[0]] += 1
        if path and path[0] == 1:
            second[out[1]] += 1
    assert chi2_pvalue(first, p[0]) > P_MIN
    assert second.sum() > 500 and chi2_pvalue(second, p[1]) > P_MIN


# -- end to end on a tiny model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64, initializer_range=0.5,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    target = LlamaForCausalLM(cfg).eval()
    draft = Eagle3Draft(DraftConfig.from_target_config(cfg, [0, 1], draft_vocab_size=8))
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)  # a random draft that agrees with the target only sometimes
    draft.load_target_embedding(target.get_input_embeddings().weight.detach())
    return target, draft.eval()


@torch.no_grad()
def exact_joint(target, prompt: list[int], temperature: float, top_p: float) -> torch.Tensor:
    """[V, V, V] probability of the first three generated tokens under the target's own sampling."""
    V = target.config.vocab_size
    p1 = target_probs(target(torch.tensor([prompt])).logits[0, -1], temperature, top_p)  # [V]
    a = torch.arange(V)
    two = torch.cat([torch.tensor(prompt).expand(V, -1), a[:, None]], 1)  # [V, n+1]
    p2 = target_probs(target(two).logits[:, -1], temperature, top_p)  # [V, V]
    three = torch.cat([torch.tensor(prompt).expand(V * V, -1),
                       a.repeat_interleave(V)[:, None], a.repeat(V)[:, None]], 1)
    p3 = target_probs(target(three).logits[:, -1], temperature, top_p).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize("method,temperature,top_p", [
    (ChainSpec(2), 1.0, 1.0),
    (TreeSpec(6, 2, 3), 0.8, 0.9),
])
def test_speculative_sampling_end_to_end_keeps_the_target_distribution(tiny_pair, method, temperature, top_p):
    target, draft = tiny_pair
    prompt = [1, 5, 3]
    joint = exact_joint(target, prompt, temperature, top_p)  # [8, 8, 8]
    dec = SpeculativeDecoder(HFTarget(target, [0, 1]), draft)
    V, N = 8, 3000
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V, V, V)
    steps = accepted = 0
    for _ in range(N):
        out = dec.generate(prompt, method, 3, temperature=temperature, top_p=top_p, generator=g)
        assert len(out.tokens) == 3
        counts[tuple(out.tokens)] += 1
        steps += len(out.accepted)
        accepted += sum(out.accepted)
    dec.target.close()
    # the first two tokens jointly (64 cells), and the third one (8 cells), against the exact values
    assert chi2_pvalue(counts.sum(2), joint.sum(2)) > P_MIN
    assert chi2_pvalue(counts.sum((0, 1)), joint.sum((0, 1))) > P_MIN
    assert 0.1 < accepted / steps < 0.9 * method.max_accept  # drafts were accepted and rejected
