"""Shared by the vLLM engine tests (tests/test_*_engines.py): serve a target with an eyas draft in a fresh
in-process vLLM, read its speculative-decoding counters (`vllm:spec_decode_*`) and hold them against what
eyas predicts (eyas.eval.greedy_acceptance); and the tiny confident Llama target those tests draft for."""

from __future__ import annotations

import gc

import torch

VOCAB = 2048


def run_vllm(prompts: list[list[int]], max_tokens: int, tokenizer: bool = False,
             **llm_kwargs) -> tuple[list[list[int]], dict]:
    """Greedy generation (ignore_eos) with a fresh in-process LLM; returns outputs and the spec-decode counters.
    Without `tokenizer` vLLM loads none: token ids in, token ids out."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    ids_only = {} if tokenizer else {"skip_tokenizer_init": True}
    llm = LLM(enforce_eager=True, dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=512, seed=0,
              disable_log_stats=False, **ids_only, **llm_kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                **({} if tokenizer else {"detokenize": False}))
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        metrics = {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", None) or getattr(m, "value", None)
                   for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    return tokens, metrics


def check_counters(m: dict, mine: dict, draft_tokens: bool = True, partly_accepted: bool = True) -> None:
    """vLLM's counters `m` equal eyas' prediction `mine` (same draft, same greedy target, the same step
    structure): drafts, (with `draft_tokens`) draft tokens and accepted tokens per position. With
    `partly_accepted`, the agreement is not about zeros: every position is accepted sometimes, not always."""
    assert m["num_drafts"] == mine["num_drafts"], (m, mine)
    if draft_tokens:
        assert m["num_draft_tokens"] == mine["num_draft_tokens"], (m, mine)
    assert m["num_accepted_tokens_per_pos"] == mine["accepted_per_pos"], (m, mine)
    if partly_accepted:
        assert all(n > 0 for n in m["num_accepted_tokens_per_pos"]), m
        assert m["num_accepted_tokens"] < m["num_draft_tokens"], m


def confident_llama(path):
    """A tiny random Llama (vocabulary VOCAB, no tokenizer) saved under `path`, its head scaled up so that
    its greedy choices are learnable."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)  # confident enough that its greedy choices are learnable
    target.save_pretrained(path)
    return target


def prompts_and_continuations(target, new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """4 random prompts (BOS first) and the target's greedy continuations of them, exactly `new_tokens` long."""
    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 9, 12, 7)]
    with torch.no_grad():
        seqs = [target.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0)[0].tolist() for p in prompts]
    return prompts, seqs
