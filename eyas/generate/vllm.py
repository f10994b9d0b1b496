"""Generator "vllm": each round of turns goes to vLLM in one call (its own continuous batching and paged
attention, tensor parallel with --tp); vLLM loads the target itself, from its folder or hub id."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eyas.generate.scheduler import OnChunk, run_in_rounds
from eyas.generate.turns import Sampling, Turns, stop_ids


class VllmGenerator:
    """Rewrites chunks of conversations with a running `vllm.LLM`."""

    def __init__(self, llm: Any, tokenizer: Any, sampling: Sampling, max_length: int, eos: list[int]) -> None:
        self.llm, self.sampling = llm, sampling
        self.turns = Turns(tokenizer, sampling, max_length, eos)

    def run(self, convs: list[list[dict]], chunk: int, todo: list[int], seed: int, on_chunk: OnChunk) -> None:
        run_in_rounds(self.turns, self.decode, convs, chunk, todo, seed, on_chunk)

    def decode(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """Replies (token ids, ending with a stop token when one ended them) to `prompts`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s, eos = self.sampling, self.turns.eos
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or -1,
                                max_tokens=s.max_new_tokens, seed=seed, stop_token_ids=eos, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        replies = []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            if c.finish_reason == "stop" and (not toks or toks[-1] not in eos):
                toks.append(eos[0])  # vLLM may leave the stop token out; Turns.close looks for it
            replies.append(toks)
        return replies


def run_vllm(model: str, sampling: Sampling, max_length: int, tp: int, dtype: str, trust_remote_code: bool,
             work: Callable[[VllmGenerator], None]) -> None:
    """Run `work(VllmGenerator)` on a vLLM engine for `model`, torn down afterwards."""
    from transformers import AutoTokenizer, GenerationConfig

    from eyas.engines.vllm.runtime import import_vllm, llm_kwargs, run_llm

    import_vllm("--engine vllm", "use --engine generate")
    tok = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos alone
        eos = None
    stop = stop_ids(eos, tok)
    extra = {"tensor_parallel_size": tp, "trust_remote_code": trust_remote_code}
    extra |= {} if dtype == "auto" else {"dtype": dtype}
    run_llm(llm_kwargs(model, sampling.seed, max_model_len=max_length, **extra),
            lambda llm: work(VllmGenerator(llm, tok, sampling, max_length, stop)))
