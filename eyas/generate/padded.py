"""Generator "generate": transformers' `generate` on left-padded batches, one round of turns at a time.

It runs on any transformers version and its sampling is bit-reproducible (seeded per chunk and round),
but on a GPU it launches every layer's kernels from Python at each step: the streaming generators
("static", "continuous") keep the GPU busier (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch

from eyas.generate.scheduler import OnChunk, run_in_rounds
from eyas.generate.turns import Sampling, Turns


class PaddedGenerator:
    """Rewrites chunks of conversations with a loaded transformers causal LM and its tokenizer."""

    def __init__(self, model: Any, tokenizer: Any, sampling: Sampling, max_length: int = 4096) -> None:
        self.model, self.sampling = model, sampling
        self.turns = Turns.of_model(model, tokenizer, sampling, max_length)
        self.device = next(model.parameters()).device

    def run(self, convs: list[list[dict]], chunk: int, todo: list[int], seed: int, on_chunk: OnChunk) -> None:
        run_in_rounds(self.turns, self.decode, convs, chunk, todo, seed, on_chunk)

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """Replies (token ids, the stop token kept when one ended them) to left-padded prompts."""
        torch.manual_seed(seed)
        tok = self.turns.tok
        enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        out = self.model.generate(input_ids=ids, attention_mask=mask, pad_token_id=tok.pad_token_id,
                                  eos_token_id=self.turns.eos, **self.sampling.generate_kwargs())
        return out[:, ids.shape[1]:].tolist()  # [B, <=max_new_tokens]
