"""eyas eval: speculative decoding (chain and EAGLE-2 tree) is exact, its caches and tree masks are
right, the metrics follow the EAGLE definitions, and the report / CLI work end to end."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eyas.eval import (
    BASELINE,
    ChainSpec,
    EvalResult,
    HFTarget,
    MethodStats,
    SpeculativeDecoder,
    TreeSpec,
    evaluate_draft,
    greedy_acceptance,
    target_generate,
)
from eyas.eval.prompts import chat_file_set, humaneval_set, load_prompt_sets, mtbench_set, render_prompt
from eyas.eval.report import load_report, markdown_summary, write_report
from eyas.eval.spec_decode import Generation
from eyas.eval.target import cache_keep
from eyas.model.attention import KVCache, TTTAttention
from eyas.model.config import DraftConfig
from eyas.model.draft import Eagle3Draft
from eyas.model.vocab import build_draft_vocab
from eyas.train.ttt import shift_left
from eyas.utils.io import EyasError


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small matmuls on a shared 2-core machine: one thread is ~10x faster than two fighting for cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- helpers: a tiny real Llama target and a quick EAGLE-3 training loop (training-time test, 3 steps) --------


def tiny_target(vocab: int = 64, seed: int = 0, layers: int = 4, init: float = 0.1) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      initializer_range=init, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def make_draft(target, aux_ids, draft_vocab: int, seqs=None, seed: int = 0, layers: int = 1,
               eagle31: bool = False) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig.from_target_config(target.config, aux_ids, draft_vocab_size=draft_vocab)
    cfg.num_hidden_layers = layers
    cfg.fc_norm = cfg.norm_output = eagle31
    draft = Eagle3Draft(cfg)
    draft.load_target_embedding(target.get_input_embeddings().weight.detach())
    counts = torch.zeros(cfg.vocab_size, dtype=torch.long)  # no data: the first ids
    if seqs is not None:
        counts = torch.bincount(torch.tensor(sum(seqs, [])), minlength=cfg.vocab_size)
    draft.set_vocab(*build_draft_vocab(counts, cfg.draft_vocab_size))
    return draft.eval()


@torch.no_grad()
def capture(target, seqs, aux_ids):
    """(ids [T], aux [T, k*H], target argmax [T]) per sequence, via output_hidden_states
    (independent of eval's hooks)."""
    out = []
    for s in seqs:
        o = target(torch.tensor([s]), output_hidden_states=True)
        out.append((torch.tensor(s), torch.cat([o.hidden_states[i][0] for i in aux_ids], -1), o.logits[0].argmax(-1)))
    return out


def train_draft(draft: Eagle3Draft, data, steps: int, ttt: int = 3, lr: float = 3e-3) -> float:
    """EAGLE-3 training-time test in its plainest form: row t reads token t+1 and the target's state at t
    and learns the target's next token; step j feeds the draft its own output at position t+j."""
    t2d = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
    t2d[draft.d2t + torch.arange(draft.d2t.numel())] = torch.arange(draft.d2t.numel())
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    draft.train()
    loss = torch.zeros(())
    for step in range(steps):
        ids, aux, tgt = data[step % len(data)]
        T = ids.numel()
        attn, hidden, loss = TTTAttention("math"), draft.fuse(aux[None]), torch.zeros(())
        for j in range(ttt):
            tok = torch.zeros(T, dtype=torch.long)
            tok[: T - 1 - j] = ids[1 + j:]
            lab = torch.full((T,), -1, dtype=torch.long)
            lab[: T - 1 - j] = t2d[tgt[1 + j:]]
            hidden = draft(tok[None], hidden, (torch.arange(T) + j)[None], attn)
            loss = loss + 0.8**j * F.cross_entropy(draft.logits(hidden)[0], lab, ignore_index=-1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.eval()
    return float(loss.detach())


@pytest.fixture(scope="module")
def tiny():
    """A tiny target, 12 prompts with its greedy continuations, and drafts trained on them (vocab 48 of
    64): one decoder layer (EAGLE-3's), two, and EAGLE-3.1's (fc_norm, norm_output)."""
    target = tiny_target()
    aux = [1, 2, 3]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (8,), generator=g).tolist() for _ in range(6)]
    wrapped = HFTarget(target, aux)
    seqs = [p + target_generate(wrapped, p, 40).tokens for p in prompts]
    wrapped.close()
    trained = make_draft(target, aux, 48, seqs)
    train_draft(trained, capture(target, seqs, aux), steps=120)
    two_layers = make_draft(target, aux, 48, seqs, layers=2)
    train_draft(two_layers, capture(target, seqs, aux), steps=120)
    eagle31 = make_draft(target, aux, 48, seqs, eagle31=True)
    train_draft(eagle31, capture(target, seqs, aux), steps=120)
    untrained = make_draft(target, aux, 48, seqs, seed=1)
    return {"target": target, "aux": aux, "prompts": prompts, "trained": trained, "two_layers": two_layers,
            "eagle31": eagle31, "untrained": untrained}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# -- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["trained", "two_layers", "eagle31"])
def test_tiny_trained_draft_accepts_often_and_output_is_the_targets(tiny, which):
    prompts = tiny["prompts"][:4]
    res = evaluate_draft(tiny["target"], None, tiny[which], prompts, chain=[2, 4], tree=["12:4:3"],
                         max_new_tokens=32, progress=False)
    table = res.table()["all"]
    assert table["chain-4"]["identical_to_target"] == 1.0 and table["tree-12:4:3"]["identical_to_target"] == 1.0
    assert table["chain-2"]["identical_to_target"] == 1.0
    assert table["chain-4"]["tau"] > 2.5 and table["tree-12:4:3"]["tau"] > 2.5, table
    assert table["chain-2"]["tau"] <= 3.0  # at most K + 1
    # fewer target forwards than tokens: the point of it all
    assert table["chain-4"]["tokens_per_target_forward"] > 2.0
    # independent reference: transformers' own greedy generate
    wrapped = HFTarget(tiny["target"], tiny["aux"])
    dec = SpeculativeDecoder(wrapped, tiny[which])
    for p in prompts[:2]:
        ref = hf_greedy(tiny["target"], p, 32)
        assert dec.generate(p, ChainSpec(4), 32).tokens == ref
        assert dec.generate(p, TreeSpec(12, 4, 3), 32).tokens == ref
    wrapped.close()


def test_untrained_draft_is_still_exact(tiny):
    res = evaluate_draft(tiny["target"], None, tiny["untrained"], tiny["prompts"][:3], chain=[3], tree=["10:3:4"],
                         max_new_tokens=24, progress=False)
    for m in ("chain-3", "tree-10:3:4"):
        assert res.table()["all"][m]["identical_to_target"] == 1.0
        assert res.overall()[m].new_tokens == 3 * 24


def test_tree_verify_equals_each_path_run_alone(tiny):
    """The 4-D tree mask + depth positions give every node the logits and aux states of its own path."""
    target, aux_ids = tiny["target"], tiny["aux"]
    wrapped = HFTarget(target, aux_ids)
    dec = SpeculativeDecoder(wrapped, tiny["trained"])
    prompt = tiny["prompts"][5]
    with torch.inference_mode():
        cache = wrapped.new_cache()
        n = len(prompt)
        logits, aux = wrapped.forward(torch.tensor([prompt]), torch.arange(n)[None], cache)
        last = logits[-1].argmax().view(1)
        dcache = KVCache()
        root, root_logits = dec.proposer._extend(dcache, torch.cat([torch.tensor(prompt[1:]), last]), aux)
        tokens, parents, depth, scores = dec.proposer._draft_tree(dcache, root, root_logits, TreeSpec(14, 4, 3))
        assert dcache.length == n  # speculative entries dropped
        tree_ids = torch.cat([last, tokens])
        parent_all = torch.cat([torch.zeros(1, dtype=torch.long), parents])
        t_logits, t_aux = dec.verify_tree(cache, tree_ids, parent_all, depth, 4)
        for i in range(len(tree_ids)):
            path, j = [], i
            while j != 0:
                path.append(j)
                j = int(parent_all[j])
            seq = prompt + [int(last)] + [int(tree_ids[k]) for k in reversed(path)]
            o = target(torch.tensor([seq]), output_hidden_states=True)
            ref_aux = torch.cat([o.hidden_states[a][0, -1] for a in aux_ids])
            assert (t_logits[i] - o.logits[0, -1]).abs().max() <= 1e-4 * o.logits[0, -1].abs().max()
            assert (t_aux[i] - ref_aux).abs().max() <= 1e-4 * ref_aux.abs().max()
        # keep one path, then the cache continues exactly like a fresh prefix
        leaf = int(depth.argmax()) + 1
        path, j = [], leaf
        while j != 0:
            path.append(j)
            j = int(parent_all[j])
        path = path[::-1]
        cache_keep(cache, n + 1, n + torch.tensor(path))
        assert cache.get_seq_length() == n + 1 + len(path)
        nxt = 7
        step_logits, _ = wrapped.forward(torch.tensor([[nxt]]), torch.tensor([[n + 1 + len(path)]]), cache)
        seq = prompt + [int(last)] + [int(tree_ids[k]) for k in path] + [nxt]
        ref = target(torch.tensor([seq])).logits[0, -1]
        assert (step_logits[-1] - ref).abs().max() <= 1e-4 * ref.abs().max()
    wrapped.close()


@torch.no_grad()
def ttt_logits(draft, seq: list[int], aux: torch.Tensor, steps: int) -> torch.Tensor:
    """The training-time-test unroll of eyas.train.ttt.TTTModel over one whole sequence: step j, row t reads
    the true token x[t+1+j] and the draft's step j-1 output at t. -> draft logits [steps, T, V_d]."""
    ids = torch.tensor([seq])
    T = ids.shape[1]
    attend, hidden, out = TTTAttention("math"), draft.fuse(aux[None]), []
    for j in range(steps):
        hidden = draft(shift_left(ids, 1 + j), hidden, (torch.arange(T) + j)[None], attend)
        out.append(draft.logits(hidden)[0])
    return torch.stack(out)


@pytest.mark.parametrize("which", ["trained", "two_layers", "eagle31"])
def test_decoding_proposes_what_training_time_test_predicts(tiny, which):
    """What the draft learns is what it proposes: in every round of greedy speculative decoding, the
    draft's logits at the root (the row that reads the newest token with the target's state before it)
    are the training unroll's step-0 logits at that row, and the chain's step j those of step j, as long
    as the tokens before it are the true ones (which training feeds). Training accuracy and acceptance
    measure the same predictions; the reference states come from transformers' output_hidden_states,
    not eval's hooks. With two decoder layers, each keeps its own keys in training and in the cache."""
    target, aux_ids, draft = tiny["target"], tiny["aux"], tiny[which]
    wrapped = HFTarget(target, aux_ids)
    dec = SpeculativeDecoder(wrapped, draft)
    rounds: list[tuple[int, list[torch.Tensor], list[int]]] = []  # (L, logits of steps 0.., proposed tokens)
    chain, tree, step = dec.proposer._draft_chain, dec.proposer._draft_tree, dec.proposer._draft_step

    def record_step(*args):
        out = step(*args)
        rounds[-1][1].append(out[1][-1].clone())
        return out

    def record_chain(cache, root, logits, *args):
        rounds.append((cache.length, [logits.clone()], []))
        dec.proposer._draft_step = record_step
        out = chain(cache, root, logits, *args)
        dec.proposer._draft_step = step
        rounds[-1][2].extend(out[0].tolist())
        return out

    def record_tree(cache, root, logits, spec):
        rounds.append((cache.length, [logits.clone()], []))
        return tree(cache, root, logits, spec)

    dec.proposer._draft_chain, dec.proposer._draft_tree = record_chain, record_tree
    checked = 0
    for prompt in tiny["prompts"][:3]:
        for method in (ChainSpec(4), TreeSpec(12, 4, 3)):
            rounds.clear()
            seq = prompt + dec.generate(prompt, method, 24).tokens
            pred = ttt_logits(draft, seq, capture(target, [seq], aux_ids)[0][1], 4)  # [4, T, V_d]
            for L, logits, proposed in rounds:
                root = L - 1
                for j, got in enumerate(logits):
                    ref = pred[j, root]
                    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), (L, j)
                    checked += 1
                    if j >= len(proposed) or root + 2 + j >= len(seq) or proposed[j] != seq[root + 2 + j]:
                        break  # the next step reads a token that training never feeds there
    wrapped.close()
    assert checked >= 40, checked


def test_dynamic_tree_is_eagle2_selection(tiny):
    """Top `total` nodes by cumulative draft log-prob, closed under ancestors, siblings distinct, depth <= D."""
    wrapped = HFTarget(tiny["target"], tiny["aux"])
    dec = SpeculativeDecoder(wrapped, tiny["untrained"])
    prompt = tiny["prompts"][0]
    spec = TreeSpec(20, 5, 3)
    with torch.inference_mode():
        logits, aux = wrapped.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], wrapped.new_cache())
        dcache = KVCache()
        pending = torch.cat([torch.tensor(prompt[1:]), logits[-1].argmax().view(1)])
        root, root_logits = dec.proposer._extend(dcache, pending, aux)
        tokens, parents, depth, scores = dec.proposer._draft_tree(dcache, root, root_logits, spec)
    assert tokens.numel() == 20 and int(depth.max()) <= 5
    for i in range(20):
        p = int(parents[i])
        assert p <= i  # parents come first (index p-1 < i), 0 is the root
        assert int(depth[i]) == (1 if p == 0 else int(depth[p - 1]) + 1)
        if p:
            assert scores[i] <= scores[p - 1] + 1e-6
    for p in set(parents.tolist()):
        sib = tokens[parents == p].tolist()
        assert len(sib) == len(set(sib))
    # the root's top-k children are the draft's top-k tokens
    first = torch.log_softmax(root_logits, -1).topk(3)
    assert torch.allclose(scores[parents == 0].sort(descending=True).values, first.values, atol=1e-5)


def test_draft_cache_extend_in_pieces_equals_one_pass(tiny):
    draft = tiny["trained"]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (10,), generator=g)
    aux = torch.randn(10, 3 * 64, generator=g)
    wrapped = HFTarget(tiny["target"], tiny["aux"])
    dec = SpeculativeDecoder(wrapped, draft)
    with torch.inference_mode():
        full = KVCache()
        out_all, logits_all = dec.proposer._extend(full, tokens, aux)
        parts = KVCache()
        dec.proposer._extend(parts, tokens[:6], aux[:6])
        out_parts, logits_parts = dec.proposer._extend(parts, tokens[6:], aux[6:])
    wrapped.close()
    assert torch.allclose(out_all, out_parts, atol=1e-5) and torch.allclose(logits_all, logits_parts, atol=1e-4)


@pytest.mark.slow
def test_smollm2_greedy_identical_untrained_and_trained(smollm2_dir):
    """SmolLM2-135M real weights, fp32: speculative greedy output == the target's own greedy output, with a
    random draft and with a draft trained (a few TTT steps) on the target's answers to these prompts."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    aux = [2, 15, 27]
    prompts = [render_prompt(tok, [{"role": "user", "content": q}])
               for q in ("Write a haiku about the sea.", "List three uses of copper.")]
    n = 24
    refs = [hf_greedy(model, p, n) for p in prompts]
    seqs = [p + r for p, r in zip(prompts, refs, strict=True)]
    untrained = make_draft(model, aux, 32000)
    trained = make_draft(model, aux, 256, seqs)
    train_draft(trained, capture(model, seqs, aux), steps=40)
    wrapped = HFTarget(model, aux)
    for draft, min_tau in ((untrained, 1.0), (trained, 2.5)):
        dec = SpeculativeDecoder(wrapped, draft)  # no stop ids: always n tokens, like hf_greedy
        for method in (ChainSpec(4), TreeSpec(16, 4, 4)):
            accepted = []
            for p, ref in zip(prompts, refs, strict=True):
                out = dec.generate(p, method, n)
                assert out.tokens == ref, (method, draft is trained)
                accepted += out.accepted
            tau = 1 + sum(accepted) / len(accepted)
            assert tau >= min_tau, (method, tau)
            if draft is untrained:
                assert tau < 1.5
    wrapped.close()


# -- metrics -------------------------------------------------------------------------------------------


def test_metrics_follow_eagle_definitions():
    s = MethodStats("chain-3", 3)
    s.add(Generation(tokens=list(range(9)), seconds=1.0, target_forwards=4, draft_forwards=9, accepted=[3, 1, 0]))
    s.add(Generation(tokens=list(range(5)), seconds=1.0, target_forwards=3, draft_forwards=6, accepted=[2, 0]),
          identical=True)
    assert s.accept_hist == [2, 1, 1, 1]
    assert s.tau == pytest.approx(1 + 6 / 5)  # bonus token counted
    assert s.accept_rate_by_pos == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    assert s.accept_cond_by_pos == pytest.approx([3 / 5, 2 / 3, 1 / 2])
    assert s.tokens_per_target_forward == pytest.approx(14 / 7)
    assert s.tok_s == pytest.approx(7.0)
    d = s.to_dict(baseline_tok_s=3.5)
    assert d["speedup"] == pytest.approx(2.0) and d["identical_to_target"] == 1.0 and d["compared"] == 1
    assert MethodStats.from_dict(d).to_dict(3.5) == d


def test_greedy_acceptance_counts_like_vllm(tiny):
    res = greedy_acceptance(tiny["target"], None, tiny["trained"], tiny["prompts"][:2], k=3, max_new_tokens=24)
    n = res["num_drafts"]
    assert n > 0 and res["num_draft_tokens"] == 3 * n
    assert res["mean_acceptance_length"] == pytest.approx(1 + res["num_accepted_tokens"] / n)
    pos = res["accepted_per_pos"]
    assert len(pos) == 3 and pos[0] >= pos[1] >= pos[2] and sum(pos) == res["num_accepted_tokens"]


# -- reports, prompts, CLI ----------------------------------------------------------------------------


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_report_json_markdown_plots_and_compare(tiny, tmp_path):
    kw = dict(chain=[1, 3], tree=["8:3:3"], max_new_tokens=12, progress=False)
    good = evaluate_draft(tiny["target"], None, tiny["trained"], tiny["prompts"][:1], **kw)
    bad = evaluate_draft(tiny["target"], None, tiny["untrained"], tiny["prompts"][:1], **kw)
    write_report(bad, tmp_path / "bad", label="untrained")
    out = write_report(good, tmp_path / "good", label="trained", compare=[("untrained", load_report(tmp_path / "bad"))])
    again = load_report(out / "report.json")
    assert again.table() == good.table() and again.methods == ["chain-1", "chain-3", "tree-8:3:3"]
    md = (out / "report.md").read_text()
    assert "| chain-3 |" in md and "tau untrained" in md and "Δ tau" in md
    t_good, t_bad = good.overall()["chain-3"].tau, bad.overall()["chain-3"].tau
    assert f"{t_good - t_bad:+.2f}" in md
    for name in ("acceptance_by_position.png", "tau_by_prompt_set.png", "tau_vs_k.png"):
        w, h = _png_size(out / name)
        assert w >= 600 and h >= 400
    data = json.loads((out / "report.json").read_text())
    assert data["compared"][0]["label"] == "untrained" and data["records"]
    assert data["results"]["all"][BASELINE]["speedup"] == pytest.approx(1.0)
    with pytest.raises(EyasError):
        load_report(tmp_path / "nothing.json")
    assert "tau counts the bonus token" in markdown_summary(good)
    # exact in fp32: no precision note; a bf16 run whose output drifted says why and what to run
    assert "Note:" not in md and good.overall()["chain-3"].identical == good.overall()["chain-3"].compared > 0
    good.meta["dtype"] = "bfloat16"
    next(iter(good.sets.values()))["chain-3"].identical -= 1
    assert "differ from the target's own (chain-3)" in markdown_summary(good)
    assert "--dtype float32" in markdown_summary(good)


def test_prompt_sets(tmp_path):
    mt = mtbench_set()
    assert len(mt.items) == 80 and all(len(it.turns) == 2 for it in mt.items) and mt.num_turns == 160
    he = humaneval_set()
    assert len(he.items) == 164 and he.items[0].turns[0].lstrip().startswith(("def", "from", "import"))
    f = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": "a"}, {"role": "user", "content": f"r{i}"},
                          {"role": "assistant", "content": "b"}]}
            for i in range(5)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = chat_file_set(f, max_prompts=2)
    assert [it.turns for it in s.items] == [["q3", "r3"], ["q4", "r4"]] and s.items[0].system == "be brief"
    sets = load_prompt_sets(f"mtbench,{f}", max_prompts=3, max_turns=1)
    assert [s.name for s in sets] == ["mtbench", "chats"] and sets[0].num_turns == 3
    with pytest.raises(EyasError):
        load_prompt_sets("no-such-set")
    # MT-Bench-style records written raw (ensure_ascii=False): a U+2028 inside a turn is not a line break
    q = tmp_path / "questions.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "turns": [f"a\u2028{i}", "b"]}, ensure_ascii=False) + "\n"
                         for i in (1, 2)), encoding="utf-8")
    assert [(it.id, it.turns) for it in chat_file_set(q).items] == [("1", ["a\u20281", "b"]), ("2", ["a\u20282", "b"])]
    # MT-Bench's own question.jsonl, named, as on a machine without the MT-Bench package
    from eyas.assets import mtbench_path

    (named,) = load_prompt_sets(f"mtbench={mtbench_path()}", max_prompts=80)
    assert named.name == "mtbench"
    assert [(it.id, it.turns) for it in named.items] == [(it.id, it.turns) for it in mt.items]


def test_prepared_dataset_slice_cuts_before_first_answer(tmp_path):
    from safetensors.torch import save_file

    ids = torch.arange(20, dtype=torch.int32)
    mask = torch.zeros(20, dtype=torch.uint8)
    mask[[4, 5, 12, 13, 14]] = 1  # sample 0 = [0, 8): answer at 4; sample 1 = [8, 20): answer at 12
    save_file({"input_ids": ids, "loss_mask": mask, "offsets": torch.tensor([0, 8, 20])},
              str(tmp_path / "shard-00000.safetensors"))
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "eyas.prepared/1", "shards": [
        {"file": "shard-00000.safetensors", "num_samples": 2, "num_tokens": 20}]}))
    (s,) = load_prompt_sets(str(tmp_path), max_prompts=5)
    assert [it.token_ids for it in s.items] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    (last,) = load_prompt_sets(str(tmp_path), max_prompts=1)
    assert [it.id for it in last.items] == ["sample-1"]  # the held-out slice is the tail


@pytest.fixture(scope="module")
def tiny_folder(smollm2_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer and chat template, saved like any HF model."""
    root = tmp_path_factory.mktemp("tinyllm")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    draft = make_draft(model, [1, 2, 3], 4096)
    draft.config.target = str(root / "target")
    draft.save_pretrained(root / "draft")
    return root


def test_cli_eval_end_to_end_reuse_and_resume(tiny_folder, tmp_path):
    from eyas.recipes.evaluate import PARTIAL_SUFFIX, EvalOptions, run_eval

    logs: list[str] = []
    kw = dict(model=str(tiny_folder / "target"), prompts="mtbench", chain="1,2", tree="6:2:3", max_new_tokens=6,
              max_prompts=2, out=tmp_path / "ev")
    out = run_eval(EvalOptions(draft=str(tiny_folder / "draft"), **kw), log=logs.append)
    data = json.loads((out / "report.json").read_text())
    assert set(data["results"]["mtbench"]) == {BASELINE, "chain-1", "chain-2", "tree-6:2:3"}
    assert data["results"]["mtbench"]["chain-2"]["identical_to_target"] == 1.0
    assert len(data["records"]) == 2 * 2 * 4  # 2 questions x 2 turns x (target + 3 methods)
    assert (out / "tau_vs_k.png").is_file() and (out / "manifest.json").is_file()
    assert not (tmp_path / ("ev" + PARTIAL_SUFFIX)).exists()
    # MT-Bench turn 2 is asked after the model's own turn-1 answer, with the chat template
    tok = AutoTokenizer.from_pretrained(tiny_folder / "target")
    q = mtbench_set(1).items[0]
    recs = {(r["turn"], r["method"]): r for r in data["records"] if r["item"] == q.id}
    answer = recs[(0, BASELINE)]["answer"]
    turn2 = render_prompt(tok, [{"role": "user", "content": q.turns[0]}, {"role": "assistant", "content": answer},
                                {"role": "user", "content": q.turns[1]}])
    assert recs[(1, "chain-1")]["prompt_tokens"] == len(turn2)
    # same inputs and options: reused
    logs.clear()
    run_eval(EvalOptions(draft=str(tiny_folder / "draft"), **kw), log=logs.append)
    assert any("up to date" in line for line in logs)
    # a new --compare on an up-to-date run only redraws the report against the other run
    other = write_report(EvalResult.from_dict(data), tmp_path / "other", label="older")
    run_eval(EvalOptions(draft=str(tiny_folder / "draft"), compare=[str(other)], label="newer", **kw),
             log=logs.append)
    assert "tau older" in (out / "report.md").read_text() and "# eyas eval: newer" in (out / "report.md").read_text()
    # a killed run resumes from its partial records
    partial = tmp_path / ("ev" + PARTIAL_SUFFIX)
    manifest = json.loads((out / "manifest.json").read_text())
    kept = data["records"][:5]
    partial.write_text("\n".join(json.dumps(x) for x in [{"options_sha256": manifest["options_sha256"]}, *kept]) + "\n")
    logs.clear()
    run_eval(EvalOptions(draft=str(tiny_folder / "draft"), force=True, **kw), log=logs.append)
    assert any("resuming: 5 generations" in line for line in logs)
    resumed = json.loads((out / "report.json").read_text())
    assert len(resumed["records"]) == 16 and resumed["records"][:5] == kept  # the first five taken from the partial
    assert resumed["results"]["mtbench"][BASELINE]["generations"] == 4


def test_eval_resumes_after_a_torn_line_and_a_second_kill(tiny_folder, tmp_path, monkeypatch):
    """A kill can cut the partial file's last line. The next run keeps what came before it and appends
    on a line of its own, so a second kill loses nothing the resumed run had finished."""
    import eyas.eval.runner as runner
    from eyas.recipes.evaluate import PARTIAL_SUFFIX, EvalOptions, run_eval

    logs: list[str] = []
    kw = dict(model=str(tiny_folder / "target"), prompts="mtbench", chain="1,2", tree="6:2:3", max_new_tokens=6,
              max_prompts=2, out=tmp_path / "ev")
    first = run_eval(EvalOptions(draft=str(tiny_folder / "draft"), **kw), log=logs.append)
    full = json.loads((first / "report.json").read_text())
    sha = json.loads((tmp_path / "ev" / "manifest.json").read_text())["options_sha256"]
    partial = tmp_path / ("ev" + PARTIAL_SUFFIX)
    kept = full["records"][:5]
    torn = json.dumps(full["records"][5])[:40]  # the sixth record, cut by the kill
    partial.write_text("\n".join(json.dumps(x) for x in [{"options_sha256": sha}, *kept]) + "\n" + torn)

    original = runner.evaluate_draft

    def killed_after_three(*args, on_record=None, **kwargs):
        seen = []

        def record(rec):
            on_record(rec)
            seen.append(rec)
            if len(seen) == 3:
                raise KeyboardInterrupt  # the second kill, after three more generations were saved

        return original(*args, on_record=record, **kwargs)

    monkeypatch.setattr(runner, "evaluate_draft", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        run_eval(EvalOptions(draft=str(tiny_folder / "draft"), force=True, **kw), log=logs.append)
    monkeypatch.setattr(runner, "evaluate_draft", original)
    logs.clear()
    run_eval(EvalOptions(draft=str(tiny_folder / "draft"), force=True, **kw), log=logs.append)
    assert any("resuming: 8 generations" in line for line in logs), logs
    resumed = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert len(resumed["records"]) == 16 and resumed["records"][:5] == kept
    assert not partial.exists()


def test_eval_refuses_a_draft_for_another_target(tiny):
    other = tiny_target(vocab=80)
    with pytest.raises(EyasError, match="does not fit this target"):
        evaluate_draft(other, None, tiny["trained"], [[1, 2, 3]], chain=[2], max_new_tokens=4, progress=False)


def test_eval_names_a_missing_draft_folder(tiny_folder, tmp_path):
    """A mistyped --draft is named with what to give instead, not a FileNotFoundError traceback."""
    from eyas.recipes.evaluate import EvalOptions, run_eval

    with pytest.raises(EyasError, match=r"--draft .*nowhere does not exist: give the folder `eyas train` wrote"):
        run_eval(EvalOptions(draft=str(tmp_path / "nowhere"), model=str(tiny_folder / "target"), prompts="mtbench",
                             chain="1", max_new_tokens=2, max_prompts=1, out=tmp_path / "ev"), log=lambda m: None)


def test_tree_spec_parsing():
    assert TreeSpec.parse("60:7:10") == TreeSpec(60, 7, 10) and TreeSpec(60, 7, 10).name == "tree-60:7:10"
    for bad in ("60:7", "a:b:c", "0:7:10"):
        with pytest.raises(ValueError):
            TreeSpec.parse(bad)


def test_evalresult_rejects_foreign_json():
    with pytest.raises(EyasError):
        EvalResult.from_dict({"format": "something-else"})


@pytest.mark.vllm
def test_vllm_backend_counts_what_the_hf_backend_counts(tmp_path, smollm2_dir):
    """`--backend vllm` on a tiny target with a draft trained on its answers: vLLM's own acceptance counters
    give the same steps and accepted-per-position as eyas' chain decoding, and the same greedy text.
    Runs in the vLLM venv:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -m vllm tests/test_eval.py"""
    pytest.importorskip("vllm")
    from eyas.eval.prompts import PromptItem, PromptSet
    from eyas.eval.vllm_backend import evaluate_with_vllm

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    pset = PromptSet("mini", [PromptItem("a", ["Write a haiku about the sea.", "Now one about hills."]),
                              PromptItem("b", ["What is 17 times 23?"])])
    # a draft that accepts often: trained on the target's greedy answers to these very prompts
    base = evaluate_draft(model, tok, make_draft(model, [1, 2, 3], 512), pset, chain=[1], max_new_tokens=24,
                          progress=False)
    answers = {(r["item"], r["turn"]): r for r in base.records if r["method"] == BASELINE}
    seqs = []
    for item in pset.items:
        msgs = []
        for t, turn in enumerate(item.turns):
            msgs.append({"role": "user", "content": turn})
            seqs.append(render_prompt(tok, msgs) + answers[(item.id, t)]["answer_ids"])
            msgs.append({"role": "assistant", "content": answers[(item.id, t)]["answer"]})
    draft = make_draft(model, [1, 2, 3], 512, seqs)
    train_draft(draft, capture(model, seqs, [1, 2, 3]), steps=150)
    draft.config.target = str(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    mine = evaluate_draft(model, tok, draft, pset, chain=[3], max_new_tokens=24, progress=False).table()["all"]
    theirs = evaluate_with_vllm(str(tmp_path / "target"), str(tmp_path / "draft"), [pset], [3], 0.0, 1.0, 24,
                                log=lambda s: None).table()["all"]
    assert theirs["chain-3"]["identical_to_target"] == 1.0
    assert theirs[BASELINE]["new_tokens"] == mine[BASELINE]["new_tokens"]
    assert theirs["chain-3"]["accept_hist"] == mine["chain-3"]["accept_hist"], (theirs["chain-3"], mine["chain-3"])
    assert mine["chain-3"]["tau"] > 2.0
