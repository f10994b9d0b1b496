"""Speculative sampling is lossless: the tokens it emits follow the target's own sampling distribution.

Chi-square tests with fixed seeds on (1) the batched acceptance rules alone (eyas.eval.sampling), many rows
of draws on small random distributions at once, with a wrong rule as a control that the test can fail, and
(2) end to end through the batched decoder on a tiny Llama target (vocab 8) with a random draft of every
family (EAGLE-3 chain and tree, DFlash, P-EAGLE, DSpark), many rows at once, against the exact joint
distribution of the first generated tokens computed from the target itself.
"""

from __future__ import annotations

import pytest
import torch
from _dflash_utils import make_dflash
from _draft_utils import draft_for_target
from _eval_utils import speculate
from _peagle_utils import make_peagle
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.eval import ChainSpec, HFTarget, TreeSpec
from eyas.eval.sampling import accept_chain, accept_tree, draw, target_probs
from eyas.model.config import DraftConfig, DraftOptions
from eyas.model.dspark import DSparkDraft
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


def test_draws_follow_their_distribution():
    g = torch.Generator().manual_seed(5)
    p = _random_dists(1, 8, g)[0]
    assert chi2_pvalue(torch.bincount(draw(p.expand(6000, -1), g), minlength=8), p) > P_MIN


@pytest.mark.parametrize("k", [1, 3])
def test_chain_rule_emits_the_target_distribution(k):
    """6000 rows at once, each its own draft and acceptance: the first token emitted follows p[0]."""
    g = torch.Generator().manual_seed(10 + k)
    V, N = 8, 6000
    p, q = _random_dists(k + 1, V, g), _random_dists(k, V, g)
    d = draw(q.expand(N, -1, -1), g)  # [N, K] one draft token per position, drawn from q
    acc, nxt = accept_chain(d, q.expand(N, -1, -1), p.expand(N, -1, -1), g)
    first = torch.where(acc > 0, d[:, 0], nxt)
    assert chi2_pvalue(torch.bincount(first, minlength=V), p[0]) > P_MIN
    assert 0.1 < acc.sum() / (N * k) < 0.9  # both the accept and the resample branches ran


def test_chain_rule_control_a_wrong_rule_fails():
    """Accepting with probability p(d) (forgetting to divide by q) is biased: the same test catches it."""
    g = torch.Generator().manual_seed(3)
    V, N = 8, 6000
    p, q = _random_dists(2, V, g), _random_dists(1, V, g)
    d = draw(q[0].expand(N, -1), g)
    keep = torch.rand(N, generator=g) < p[0, d]
    first = torch.where(keep, d, draw(p[0].expand(N, -1), g))
    assert chi2_pvalue(torch.bincount(first, minlength=V), p[0]) < 1e-6


def test_tree_rule_emits_the_target_distribution():
    """A fixed tree on 6000 rows: root -> tokens (2, 5, 1); node 1 (token 2) -> tokens (0, 2). First token ~
    p[root]; after token 2 the next one ~ p[node 1] (whether node 1's children are accepted or the residual
    is sampled)."""
    g = torch.Generator().manual_seed(7)
    V, N = 8, 6000
    parents = torch.tensor([0, 0, 0, 1, 1]).expand(N, -1)
    ids = torch.tensor([6, 2, 5, 1, 0, 2]).expand(N, -1)  # ids[0] is the root's own token, unused
    p = _random_dists(6, V, g, scale=1.0)
    acc, path, nxt = accept_tree(ids, parents, p.expand(N, -1, -1), 2, g)
    out = torch.cat([ids.gather(1, path[:, 1:]), nxt[:, None]], dim=1)  # accepted tokens, then the next
    out = out.scatter(1, acc[:, None], nxt[:, None])
    assert chi2_pvalue(torch.bincount(out[:, 0], minlength=V), p[0]) > P_MIN
    second = out[path[:, 1] == 1, 1]
    assert second.numel() > 500 and chi2_pvalue(torch.bincount(second, minlength=V), p[1]) > P_MIN
    assert (acc == 0).any() and (acc == 2).any()  # every branch ran: rejections, a whole path


# -- end to end on a tiny model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair():
    """A tiny target (vocab 8) and a random draft of every family that agrees with it only sometimes."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64, initializer_range=0.5,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    target = LlamaForCausalLM(cfg).eval()
    eagle3 = Eagle3Draft(DraftConfig.from_target_config(cfg, [0, 1], draft_vocab_size=8))
    eagle3.load_target_embedding(target.get_input_embeddings().weight.detach())
    drafts = {"eagle3": eagle3, "dflash": make_dflash(target, [0, 1], 8, block_size=3, mask_token_id=7),
              "peagle": make_peagle(target, [0, 1], 8, mask_token_id=7),
              "dspark": draft_for_target(DSparkDraft, target, [0, 1], DraftOptions(
                  family="dspark", draft_vocab_size=8, block_size=3, mask_token_id=7, markov_rank=4), None, 0)}
    with torch.no_grad():
        for draft in drafts.values():
            for p in draft.parameters():
                if p.requires_grad:
                    p.normal_(0, 0.5)
    return target, {name: d.eval() for name, d in drafts.items()}


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


@pytest.mark.parametrize("family,method,temperature,top_p", [
    ("eagle3", ChainSpec(2), 1.0, 1.0),
    ("eagle3", TreeSpec(6, 2, 3), 0.8, 0.9),
    ("dflash", ChainSpec(2), 1.0, 1.0),
    ("peagle", ChainSpec(2), 0.8, 0.9),
    ("dspark", ChainSpec(3), 1.0, 1.0),
])
def test_speculative_sampling_end_to_end_keeps_the_target_distribution(tiny_pair, family, method, temperature,
                                                                        top_p):
    """3000 generations of 3 tokens, 64 rows at a time through the batched decoder: the first two tokens jointly
    and the third follow the target's own sampling distribution."""
    target, drafts = tiny_pair
    prompt = [1, 5, 3]
    joint = exact_joint(target, prompt, temperature, top_p)  # [8, 8, 8]
    wrapped = HFTarget(target, [0, 1])
    V, N = 8, 3000
    gens = speculate(wrapped, drafts[family], [prompt] * N, method, 3, rows=64, temperature=temperature,
                     top_p=top_p, seed=1)
    wrapped.close()
    assert all(len(g.tokens) == 3 for g in gens)
    counts = torch.zeros(V, V, V)
    for g in gens:
        counts[tuple(g.tokens)] += 1
    assert chi2_pvalue(counts.sum(2), joint.sum(2)) > P_MIN
    assert chi2_pvalue(counts.sum((0, 1)), joint.sum((0, 1))) > P_MIN
    steps = [a for g in gens for a in g.accepted]
    assert 0.1 < sum(steps) / len(steps) < 0.9 * method.max_accept  # drafts were accepted and rejected
