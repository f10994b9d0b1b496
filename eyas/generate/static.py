"""Generator "static": eyas' continuous batching over static KV caches, each decode step one CUDA graph
(eyas.generate.graph_decode), with every conversation's next turn queued as soon as its last reply ends.

Every row that frees up takes the next waiting turn. Greedy runs write what "generate" writes; sampled
ones are seeded once per run (a resumed run differs).
"""

from __future__ import annotations

from typing import Any

import torch

from eyas.generate.graph_decode import GraphDecoder, Sampler
from eyas.generate.scheduler import OnChunk, run_streamed
from eyas.generate.turns import Sampling, Turns


class StaticGenerator:
    """Rewrites chunks of conversations through a `GraphDecoder` over a loaded transformers causal LM.

    Refuses up front, before any chunk: a sliding window the longest sequence outgrows, or a transformers
    version whose internals no longer match the decoder (its logits checked on a real prompt)."""

    def __init__(self, model: Any, tokenizer: Any, sampling: Sampling, max_length: int = 4096,
                 kv_cache_gb: float = 0) -> None:
        self.turns = Turns.of_model(model, tokenizer, sampling, max_length)
        sampler = Sampler(sampling.temperature, sampling.top_p, sampling.top_k)
        self.decoder = GraphDecoder(model, max_length, sampling.max_new_tokens, self.turns.eos, tokenizer.pad_token_id,
                                    sampler, max_cache_bytes=kv_cache_gb * 2**30 or None)
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "Hello! Who are you?"}], tokenize=False,
                                              add_generation_prompt=True)
        self.decoder.check_model(tokenizer(probe, add_special_tokens=False)["input_ids"])

    def run(self, convs: list[list[dict]], chunk: int, todo: list[int], seed: int, on_chunk: OnChunk) -> None:
        torch.manual_seed(seed)
        run_streamed(self.turns, self.decoder, convs, chunk, todo, 2 * self.decoder.capacity, on_chunk)
