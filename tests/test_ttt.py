"""Training-time test: the batched TTT forward (TTTAttention + fused loss) against a slow reference
that replays inference row by row with the draft's KV cache, and flex against math attention."""

from __future__ import annotations

import pytest
import torch
from _train_utils import first_reply_openings, plain_reply_positions

from eyas.engines.head import TargetHead
from eyas.model.attention import KVCache, TTTAttention
from eyas.model.config import DraftConfig
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.vocab import build_draft_vocab, draft_to_target_ids, target_to_draft_ids
from eyas.train.loss import opening_mask, reply_start_weights, step_validity, target_distribution, tau_sim
from eyas.train.ttt import TTTConfig, TTTModel, summarize

V, V_D, H, K = 50, 30, 32, 3


def make_setup(seed: int = 0, layers: int = 1):
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=V, draft_vocab_size=V_D, target_hidden_size=H,
                      aux_layer_ids=[1, 2, 3], rope_theta=10000.0, num_hidden_layers=layers)
    draft = Eagle3Draft(cfg)
    for p in draft.parameters():  # larger weights than the 0.02 init: the test must see real signal
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    head = TargetHead(torch.randn(V, H), 1 + 0.1 * torch.randn(H), torch.randn(V, H), 1e-6)
    draft.load_target_embedding(head.embed_tokens)
    draft.set_vocab(*build_draft_vocab(torch.randint(0, 100, (V,)), V_D))
    return draft, head


def make_pack(doc_lengths: list[int], pad: int, seed: int = 1):
    """One packed row: documents side by side, then `pad` padding tokens."""
    g = torch.Generator().manual_seed(seed)
    N = sum(doc_lengths) + pad
    ids = torch.randint(0, V, (N,), generator=g)
    mask = torch.rand(N, generator=g) < 0.8
    pos, docs = torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.long)
    a = 0
    for d, n in enumerate(doc_lengths):
        pos[a:a + n] = torch.arange(n)
        docs[a:a + n] = d
        a += n
    mask[a:] = False
    docs[a:] = len(doc_lengths)
    pos[a:] = torch.arange(pad)
    aux = torch.randn(N, K * H, generator=g)
    final = 3 * torch.randn(N, H, generator=g)
    return ids, mask, pos, docs, aux, final


def fast_loss(draft, head, pack, steps, attention="math", fused=True, docs=True, **ttt):
    ids, mask, pos, doc, aux, final = pack
    tgt = target_distribution(head, final, draft_to_target_ids(draft.d2t), target_to_draft_ids(draft.t2d),
                              pad_rows=steps + 1, chunk_elems=7 * V)  # small chunks: exercise chunking
    model = TTTModel(draft, TTTConfig(steps=steps, attention=attention, fused_loss=fused, loss_chunk_elems=5 * V_D,
                                      **ttt))
    return model(ids[None], aux[None], pos[None], mask[None], tgt.probs, tgt.ids, doc[None] if docs else None)


def reference_loss(draft, head, pack, doc_lengths, steps, decay=0.8, token_weights=None, window=0):
    """Inference replayed: for every document, a causal prefill with a KV cache gives step 0; then
    for every row t, the cache is cut to rows 0..t and the draft decodes `steps - 1` more tokens
    (the true ones) at positions t+1, t+2, ... Each prediction is scored against the target's
    full-vocabulary softmax restricted to the draft vocabulary, computed here without chunks, and
    weighted by `token_weights[predicted token]` when given; `window`: the draft's sliding window, as the
    KV cache of inference applies it."""
    ids, mask, pos, doc, aux, final = pack
    vocab = draft_to_target_ids(draft.d2t)
    logits = head.logits(final)  # [N, V]
    in_vocab = draft.t2d[logits.argmax(-1)]
    probs = torch.softmax(logits[:, vocab], -1)
    t2d_index = target_to_draft_ids(draft.t2d)
    loss = torch.zeros(())
    stats = torch.zeros(steps, 3)
    start = 0
    for L in doc_lengths:
        d_ids = ids[start:start + L]
        inp0 = torch.cat([d_ids[1:], torch.zeros(1, dtype=torch.long)])
        cache = KVCache(window)
        h0 = draft(inp0[None], draft.fuse(aux[start:start + L][None]), torch.arange(L)[None], cache)
        for t in range(L):
            c = KVCache(window)
            for i in range(draft.config.num_hidden_layers):  # every layer's cache cut to rows 0..t
                c.layer(i).k, c.layer(i).v = cache.layer(i).k[:, :, :t + 1], cache.layer(i).v[:, :, :t + 1]
            hidden = h0[:, t:t + 1]
            for j in range(steps):
                if j > 0:
                    tok = d_ids[t + 1 + j] if t + 1 + j < L else torch.tensor(0)
                    hidden = draft(tok.view(1, 1), hidden, torch.tensor([[t + j]]), c)
                p = t + 1 + j  # the target position this step predicts
                if not (p + 1 < L and mask[start + p + 1] and in_vocab[start + p]):
                    continue
                logq = torch.log_softmax(draft.logits(hidden)[0, 0], -1)
                ce = -(probs[start + p] * logq).sum()
                w = 1.0 if token_weights is None else token_weights[start + p + 1]
                loss = loss + decay**j * w * ce
                correct = float(logq.argmax() == t2d_index[logits[start + p].argmax()])
                stats[j] += torch.tensor([ce.item(), correct, 1.0])
        start += L
    return loss, stats


def grads(draft, loss):
    draft.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize(("steps", "layers"), [(1, 1), (3, 1), (3, 2)])
def test_fast_ttt_matches_inference_replay(steps, layers):
    draft, head = make_setup(layers=layers)
    assert_unroll_matches_replay(draft, head, steps)


def assert_unroll_matches_replay(draft, head, steps: int):
    """The fast TTT unroll equals inference replayed step by step: loss, statistics and gradients. Returns
    (pack, loss, stats) for further checks."""
    lengths = [9, 7]
    pack = make_pack(lengths, pad=4)
    loss, stats = fast_loss(draft, head, pack, steps)
    ref_loss, ref_stats = reference_loss(draft, head, pack, lengths, steps)
    assert ref_stats[:, 2].min() >= 2, "the test batch must train every step"
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    assert torch.allclose(stats, ref_stats, rtol=1e-5, atol=1e-4)
    g_fast, g_ref = grads(draft, loss), grads(draft, ref_loss)
    for name in g_ref:
        assert rel(g_fast[name], g_ref[name]) < 1e-4, name
    return pack, loss, stats


def test_fused_loss_matches_plain_autograd_and_rows_are_independent():
    """Two rows without document ids (one document each, padded at the end) equal the fused/plain
    losses, and equal the sum of the rows run alone."""
    draft, head = make_setup(1)
    a, b = make_pack([12], pad=0, seed=2), make_pack([9], pad=3, seed=3)
    batch = [torch.stack([x, y]) for x, y in zip(a, b, strict=True)]
    ids, mask, pos, doc, aux, final = batch
    steps = 3
    tgt = target_distribution(head, final.reshape(-1, H), draft_to_target_ids(draft.d2t),
                              target_to_draft_ids(draft.t2d), pad_rows=steps + 1)
    out = {}
    for fused in (True, False):
        model = TTTModel(draft, TTTConfig(steps=steps, attention="math", fused_loss=fused))
        loss, stats = model(ids, aux, pos, mask, tgt.probs, tgt.ids, None)
        out[fused] = (loss, stats, grads(draft, loss))
    assert rel(out[True][0], out[False][0]) < 1e-6 and torch.allclose(out[True][1], out[False][1])
    for name, g in out[False][2].items():
        assert rel(out[True][2][name], g) < 1e-5, name
    alone = sum(fast_loss(draft, head, p, steps, docs=False)[0] for p in (a, b))
    assert rel(out[True][0], alone) < 1e-6


def test_fused_head_keeps_no_logits_for_backward_and_its_gradients_are_exact_in_fp64():
    """The fused lm_head + soft CE over all TTT steps keeps, for the backward pass, exactly the gradients wrt
    the steps' hidden states and the head (S x [N, H] + [V_d, H]), never an [N, V_d] tensor, while plain
    autograd keeps logits-sized tensors for every step; in float64 both give the same loss and gradients."""
    from eyas.train.loss import TargetDist, fused_draft_ce, reference_draft_ce

    S, N, Hd, Vd = 3, 64, 16, 512  # a vocabulary far wider than the hidden size, as in real drafts
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(Vd, Hd, generator=g, dtype=torch.float64)
    hiddens = [torch.randn(N, Hd, generator=g, dtype=torch.float64) for _ in range(S)]
    probs = torch.softmax(2 * torch.randn(N + S + 1, Vd, generator=g, dtype=torch.float64), -1)
    target = TargetDist(probs, probs.argmax(-1))
    wvalid = (torch.rand(S, N, generator=g) < 0.8).double() * torch.tensor([1.0, 0.8, 0.64])[:, None].double()
    results = {}
    for name, fn in (("fused", lambda w, hs: fused_draft_ce(w, hs, target, wvalid, chunk_elems=20 * Vd)),
                     ("plain", lambda w, hs: reference_draft_ce(w, hs, target, wvalid))):
        w = weight.clone().requires_grad_()
        hs = [h.clone().requires_grad_() for h in hiddens]
        saved: list[torch.Size] = []

        def keep(t: torch.Tensor, saved: list[torch.Size] = saved) -> torch.Tensor:
            saved.append(t.shape)
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss, stats = fn(w, hs)
        loss.backward()
        results[name] = (loss.detach(), stats, w.grad, [h.grad for h in hs], saved)
    (lf, sf, wf, hf, saved_fused), (lp, sp, wp, hp, saved_plain) = results["fused"], results["plain"]
    assert sorted(saved_fused) == sorted([torch.Size([Vd, Hd])] + [torch.Size([N, Hd])] * S)
    assert sum(1 for shape in saved_plain if shape == torch.Size([N, Vd])) >= S
    assert rel(lf, lp) < 1e-12 and torch.allclose(sf, sp.to(sf.dtype))
    assert rel(wf, wp) < 1e-12 and all(rel(a, b) < 1e-12 for a, b in zip(hf, hp, strict=True))


def reply_start_token_weights(mask, docs, weight, tokens):
    """Per token, the plain way: `weight` among the first `tokens` of its reply, else 1."""
    return [weight if 0 <= pos < tokens else 1.0 for pos, _ in plain_reply_positions(mask, docs)]


def test_reply_start_weights_weight_the_loss_of_early_reply_tokens_only():
    """--reply-start-weight: the fast TTT loss equals the inference replay with each prediction
    weighted by its token's place in its reply; the logged statistics stay unweighted."""
    draft, head = make_setup(5)
    lengths, steps, weight, tokens = [14, 11], 3, 3.0, 2
    pack = make_pack(lengths, pad=4, seed=6)
    mask, docs = pack[1], pack[3]
    mask[10:17] = True  # a run of trained tokens across the document boundary at 14: two replies
    ref_w = reply_start_token_weights(mask.tolist(), docs.tolist(), weight, tokens)
    assert ref_w.count(weight) >= 6 and ref_w.count(1.0) >= 10, "the pack must hold early and late tokens"
    w = reply_start_weights(mask, docs, steps, weight, tokens)
    N = mask.numel()
    for j in range(steps):  # step j at row t predicts token t + 2 + j
        assert w[j].tolist() == [ref_w[t + 2 + j] if t + 2 + j < N else 1.0 for t in range(N)], j
    loss, stats = fast_loss(draft, head, pack, steps, reply_start_weight=weight, reply_start_tokens=tokens)
    ref_loss, ref_stats = reference_loss(draft, head, pack, lengths, steps, token_weights=ref_w)
    plain_loss, plain_stats = fast_loss(draft, head, pack, steps)
    assert rel(loss, ref_loss) < 1e-5 and rel(loss, plain_loss) > 0.05
    assert torch.allclose(stats, ref_stats, rtol=1e-5, atol=1e-4) and torch.equal(stats, plain_stats)
    g_fast, g_ref = grads(draft, loss), grads(draft, ref_loss)
    for name in g_ref:
        assert rel(g_fast[name], g_ref[name]) < 1e-4, name


def test_opening_mask_keeps_the_start_of_each_documents_first_reply():
    """Documents with two replies, a reply shorter than the window, one reply running across a document
    boundary (the next document's first reply starts there), padding: the plain loop's answer."""
    docs = torch.tensor([0] * 12 + [1] * 9 + [2] * 7 + [3] * 4)
    mask = torch.zeros(32, dtype=torch.bool)
    for a, b in ((3, 6), (7, 12), (12, 17), (18, 20), (23, 28)):
        mask[a:b] = True
    for tokens in (1, 2, 4, 100):
        ref = first_reply_openings(mask.tolist(), docs.tolist(), tokens)
        assert opening_mask(mask, docs, tokens).tolist() == ref, tokens
    assert sum(ref) == 3 + 5 + 5 < mask.sum()  # the documents' first replies only, whole at 100 tokens


@pytest.mark.parametrize("layers", [1, 2])
def test_flex_matches_math_on_packed_documents(layers):
    """flex (block mask over documents + log-sum-exp merge of later steps) == math, forward only:
    flex has no backward on CPU (the GPU benchmark checks gradients)."""
    draft, head = make_setup(2, layers=layers)
    pack = make_pack([20, 5, 11], pad=4, seed=4)
    with torch.no_grad():
        lm, sm = fast_loss(draft, head, pack, 3, attention="math")
        lf, sf = fast_loss(draft, head, pack, 3, attention="flex")
    assert rel(lf, lm) < 1e-5 and torch.allclose(sf, sm, atol=1e-3)


@pytest.mark.parametrize("layers", [1, 2])
def test_a_windowed_draft_trains_on_what_its_windowed_inference_sees(layers):
    """--draft-window: the TTT unroll with a sliding window (one mask per step: step j's query sits j positions
    further on) equals inference replayed with the windowed KV cache, in loss, statistics and gradients;
    the window binds (the loss differs from full attention's), and flex's windowed masks equal math's."""
    draft, head = make_setup(layers=layers)
    steps, lengths = 3, [9, 7]
    pack = make_pack(lengths, pad=4)
    full_loss, _ = fast_loss(draft, head, pack, steps)
    draft.config.sliding_window = 4
    loss, stats = fast_loss(draft, head, pack, steps)
    ref_loss, ref_stats = reference_loss(draft, head, pack, lengths, steps, window=4)
    assert rel(loss, ref_loss) < 1e-5 and rel(loss, full_loss) > 1e-3
    assert torch.allclose(stats, ref_stats, rtol=1e-5, atol=1e-4)
    g_fast, g_ref = grads(draft, loss), grads(draft, ref_loss)
    for name in g_ref:
        assert rel(g_fast[name], g_ref[name]) < 1e-4, name
    with torch.no_grad():
        flex_loss, flex_stats = fast_loss(draft, head, pack, steps, attention="flex")
    assert rel(flex_loss, loss.detach()) < 1e-5 and torch.allclose(flex_stats, stats, atol=1e-3)


def test_ttt_attention_document_mask_flex_equals_math():
    torch.manual_seed(0)
    B, nh, nkv, T, hd = 1, 4, 2, 30, 8
    docs = torch.tensor([[0] * 11 + [1] * 13 + [2] * 6])
    att_m, att_f = TTTAttention("math", document_ids=docs), TTTAttention("flex", document_ids=docs)
    for step in range(3):
        q = torch.randn(B, nh, T, hd)
        k, v = torch.randn(B, nkv, T, hd), torch.randn(B, nkv, T, hd)
        om, of = att_m(q, k, v), att_f(q, k, v)
        assert rel(of, om) < 1e-5, step
    # row 11 (first of document 1) at step 0 sees only itself
    q, k, v = torch.randn(B, nh, T, hd), torch.randn(B, nkv, T, hd), torch.randn(B, nkv, T, hd)
    out = TTTAttention("math", document_ids=docs)(q, k, v)
    assert torch.allclose(out[0, :, 11], v[0].repeat_interleave(2, 0)[:, 11], atol=1e-6)


def test_reused_block_mask_follows_new_documents_in_place():
    """What a CUDA-graphed step relies on (eyas.train.graphed): one block mask object whose mask
    reads a fixed document-id buffer; a new batch's ids are written into that buffer and a fresh
    mask's block tables copied in place. Flex over the reused mask == math over the new documents."""
    from eyas.model.attention import document_block_mask
    from eyas.train.graphed import _copy_block_mask

    torch.manual_seed(1)
    B, nh, nkv, T, hd = 1, 4, 2, 300, 8  # 3 blocks of 128: the block tables matter
    docs = torch.zeros(1, T, dtype=torch.long)
    docs[0, 200:] = 1
    mask = document_block_mask(docs)  # built for the first batch's documents
    new = torch.tensor([[0] * 40 + [1] * 150 + [2] * 60 + [3] * 50])
    docs.copy_(new)
    assert _copy_block_mask(mask, document_block_mask(docs))
    q, k, v = torch.randn(B, nh, T, hd), torch.randn(B, nkv, T, hd), torch.randn(B, nkv, T, hd)
    of = TTTAttention("flex", document_ids=docs, block_mask=mask)(q, k, v)
    om = TTTAttention("math", document_ids=new.clone())(q, k, v)
    assert rel(of, om) < 1e-5
    stale = TTTAttention("flex", document_ids=docs, block_mask=document_block_mask(torch.zeros(1, T, dtype=torch.long)))
    assert rel(stale(q, k, v), om) > 1e-2  # the check above can fail: a mask left as it was is wrong
    assert not _copy_block_mask(mask, document_block_mask(torch.zeros(1, 2 * T, dtype=torch.long)))


def test_target_distribution_chunks_and_masks():
    draft, head = make_setup(3)
    final = torch.randn(23, H)
    vocab, index = draft_to_target_ids(draft.d2t), target_to_draft_ids(draft.t2d)
    one = target_distribution(head, final, vocab, index, pad_rows=2, chunk_elems=10**9)
    many = target_distribution(head, final, vocab, index, pad_rows=2, chunk_elems=3 * V)
    assert torch.equal(one.ids, many.ids) and torch.allclose(one.probs, many.probs)
    logits = head.logits(final)
    expect = torch.where(draft.t2d[logits.argmax(-1)], index[logits.argmax(-1)], -1)
    assert torch.equal(one.ids[:23], expect) and (one.ids[23:] == -1).all()
    assert (expect == -1).any() and (expect >= 0).any()
    assert torch.allclose(one.probs[:23].sum(-1), torch.ones(23)) and one.probs[23:].abs().sum() == 0


def test_label_temperature_sharpens_to_the_argmax():
    """T = 0.5 is softmax(2 * logits) over the draft vocabulary; T = 0 a one-hot on the target's
    argmax (zero where that lies outside the draft vocabulary), whatever the chunking."""
    draft, head = make_setup(3)
    final = torch.randn(23, H)
    vocab, index = draft_to_target_ids(draft.d2t), target_to_draft_ids(draft.t2d)
    logits = head.logits(final)
    half = target_distribution(head, final, vocab, index, pad_rows=2, label_temperature=0.5)
    assert torch.allclose(half.probs[:23], torch.softmax(2 * logits[:, vocab], -1), atol=1e-6)
    hard = target_distribution(head, final, vocab, index, pad_rows=2, chunk_elems=3 * V, label_temperature=0)
    assert torch.equal(hard.ids, half.ids)
    inside = hard.ids[:23] >= 0
    assert inside.any() and (~inside).any()
    assert torch.equal(hard.probs[:23][inside].argmax(-1), hard.ids[:23][inside])
    assert torch.equal(hard.probs[:23].sum(-1), inside.float()) and hard.probs[23:].abs().sum() == 0
    assert set(hard.probs.unique().tolist()) == {0.0, 1.0}


def test_step_validity_rules():
    # two documents [0..4] and [5..7], padding row 8; token 6 not trained; target 2's argmax outside
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 0, 1, 0]).bool()
    docs = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 2])
    tids = torch.tensor([3, 3, -1, 3, 3, 3, 3, 3, -1, -1, -1, -1, -1])
    v = step_validity(mask, docs, tids, steps=2)
    # step 0: row t predicts token t+2 from target t+1 (row 4: next document; row 5: token 7 of its own)
    assert v[0].tolist() == [1, 0, 1, 0, 0, 1, 0, 0, 0]
    # step 1: row t predicts token t+3 from target t+2
    assert v[1].tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0]


def test_tau_sim_and_summary():
    assert tau_sim([1.0, 1.0]) == 3.0 and abs(tau_sim([0.5, 0.5]) - 1.75) < 1e-12
    s = summarize(torch.tensor([[4.0, 2.0, 4.0], [2.0, 1.0, 2.0]]), [1.0, 0.8])
    assert s["acc"] == [0.5, 0.5] and abs(s["loss"] - (4.0 + 0.8 * 2.0) / 4.0) < 1e-9
    assert s["step_loss"] == [1.0, 1.0] and s["tau_sim"] == 1.75


@pytest.mark.parametrize("backend,docs", [("math", False), ("math", True), ("flex", True)])
def test_every_ttt_step_returns_one_memory_layout(backend, docs):
    """The trainer compiles the layer's second half (`finish`) with static shapes: an attention output
    whose strides differ between step 0 and later steps would compile it twice (a stride guard)."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    B, T, nh, g, hd = 1, 32, 4, 2, 8
    doc = torch.tensor([[0] * 12 + [1] * 20]) if docs else None
    att = TTTAttention(backend, document_ids=doc)
    counter = CompileCounter()
    finish = torch.compile(lambda a: a.transpose(1, 2).reshape(B, T, nh * hd) * 2, backend=counter, dynamic=False)
    layouts = set()
    for _ in range(3):  # q/k/v as the draft projects them: [B, T, heads, hd] viewed as [B, heads, T, hd]
        q = torch.randn(B, T, nh, hd).transpose(1, 2)
        k, v = (torch.randn(B, T, g, hd).transpose(1, 2) for _ in range(2))
        out = att(q, k, v)
        layouts.add(out.stride())
        finish(out)
    assert len(layouts) == 1 and counter.frame_count == 1
