"""Shared by the eval tests: a tiny real Llama target, EAGLE-3 drafts for it, and a plain training-time-test
loop that trains them in seconds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.eval import BatchDecoder, Generation, HFTarget
from eyas.eval.proposers import make_proposer
from eyas.model.attention import TTTAttention
from eyas.model.config import DraftConfig
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.vocab import build_draft_vocab

# -- helpers: a tiny real Llama target and a quick EAGLE-3 training loop (training-time test, 3 steps) --------


def tiny_target(vocab: int = 64, seed: int = 0, layers: int = 4, init: float = 0.1) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      initializer_range=init, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def save_tiny_chat_target(folder, tokenizer) -> None:
    """A tiny random Llama (hidden 32, 4 layers) over a real tokenizer (SmolLM2's: its chat template and stop
    tokens), saved with it like any transformers folder: a target every stage runs in seconds."""
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                      eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def save_tiny_target_and_draft(root, tokenizer) -> None:
    """root/target, a tiny random Llama (hidden 64, 4 layers) over a real tokenizer and chat template, and
    root/draft, an untrained EAGLE-3 draft for it: the folders `eyas eval` reads, made in a second."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    draft = make_draft(model, [1, 2, 3], 4096)
    draft.config.target = str(root / "target")
    draft.save_pretrained(root / "draft")


@torch.inference_mode()
def target_generate(target: HFTarget, prompt: list[int], max_new_tokens: int,
                    stop_ids: set[int] | frozenset = frozenset()) -> Generation:
    """The greedy reference: the target alone over transformers' own DynamicCache, one token per forward (no
    static cache, no batching: independent of eyas' decoder)."""
    capture, target.capture = target.capture, False
    cache, ids, pos, out = target.new_cache(), torch.tensor([prompt]), torch.arange(len(prompt))[None], []
    try:
        while True:
            logits, _ = target.forward(ids, pos, cache, last_logits_only=True)
            out.append(int(logits[-1].argmax()))
            if out[-1] in stop_ids or len(out) >= max_new_tokens:
                return Generation(out, 0.0, len(out))
            ids, pos = torch.tensor([[out[-1]]]), pos[:, -1:] + 1
    finally:
        target.capture = capture


def speculate(target: HFTarget, draft, prompts: list[list[int]], method, max_new_tokens: int, rows: int = 1,
              stop_ids=(), proposer=None, **sampling) -> list[Generation]:
    """eyas' decoder (eyas.eval.batch_decode) on `prompts` with the draft's family proposer (or `proposer`),
    `rows` at once; `sampling`: temperature, top_p, seed."""
    if method is not None and proposer is None:
        proposer = make_proposer(draft)
    length = max(map(len, prompts)) + max_new_tokens + BatchDecoder.margin(method)
    return BatchDecoder(target, proposer, method, rows, length, max_new_tokens, list(stop_ids), **sampling).run(prompts)


def target_and_continuations(prompt_ids: int = 64) -> tuple[LlamaForCausalLM, list[int], list[list[int]],
                                                             list[list[int]]]:
    """tiny_target(), its aux layers [1, 2, 3], 6 prompts of 8 ids below `prompt_ids`, and each prompt followed by
    the target's greedy continuation (40 tokens): what the decoding tests train their drafts on."""
    target = tiny_target()
    aux = [1, 2, 3]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, prompt_ids, (8,), generator=g).tolist() for _ in range(6)]
    wrapped = HFTarget(target, aux)
    seqs = [p + target_generate(wrapped, p, 40).tokens for p in prompts]
    wrapped.close()
    return target, aux, prompts, seqs


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


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_speed_words(words: str, report: dict) -> None:
    """`eyas run`'s closing words name the speedup measured at each batch size (the fastest method's), and on a
    CPU where the draft paid at no batch size, say why; a batch size whose timing was too noisy (a machine shared
    with other work) is named as such, with no number."""
    from eyas.eval.serving import best_speedups

    best = best_speedups(report["serving"])
    for b in {r["batch_size"] for r in report["serving"] if r.get("speedup_note")}:
        assert f"At batch size {b} the timing was too noisy to give a speedup" in words, words
    if not best:
        assert "too noisy" in words, (words, report["serving"])
        return
    for b, m, s in best:
        assert f"{s:.2f}x at batch size {b} ({m})" in words, (words, best)
    assert f"on {report['meta'].get('gpu') or report['meta']['device']}" in words
    cpu = report["meta"]["device"].startswith("cpu")
    why = "on a CPU a forward over a few tokens costs far more than over one" in words
    assert why == (cpu and all(s <= 1 for *_, s in best)), words
    assert ("slower here" in words) == all(s <= 1 for *_, s in best), words
