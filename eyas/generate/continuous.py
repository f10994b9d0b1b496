"""Generator "continuous": every turn streamed through transformers' continuous batching (paged KV cache).

It pays off only with a flash-attention kernel: with the paged-SDPA fallback it is slower than
"generate" (docs/experiments.md). Greedy runs reproduce; sampled ones depend on scheduling.
"""

from __future__ import annotations

from typing import Any

from eyas.generate.scheduler import OnChunk, run_streamed
from eyas.generate.turns import Sampling, Turns
from eyas.utils.io import EyasError


class ContinuousGenerator:
    """Rewrites chunks of conversations with `window` of them in flight at once."""

    def __init__(self, model: Any, tokenizer: Any, sampling: Sampling, max_length: int, window: int) -> None:
        self.model, self.sampling, self.max_length, self.window = model, sampling, max_length, window
        self.turns = Turns.of_model(model, tokenizer, sampling, max_length)
        self.device = next(model.parameters()).device

    def run(self, convs: list[list[dict]], chunk: int, todo: list[int], seed: int, on_chunk: OnChunk) -> None:
        # (no inference_mode here: the manager's worker thread updates its buffers outside of it)
        from transformers import GenerationConfig

        if not hasattr(self.model, "continuous_batching_context_manager"):
            raise EyasError("--engine continuous needs transformers' continuous batching "
                            "(model.continuous_batching_context_manager, transformers >= 5); "
                            "upgrade transformers or use --engine generate")
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        window, eos = self.window, self.turns.eos
        gk = self.sampling.generate_kwargs()
        gcfg = GenerationConfig(**gk, eos_token_id=eos, pad_token_id=self.turns.tok.pad_token_id)
        sizes = {}
        if self.device.type != "cuda":  # it sizes its cache from free GPU memory; on a CPU, from the workload
            sizes = {"num_blocks": -(-min(window * self.max_length, 1 << 16) // 256), "max_batch_tokens": 2048}
        cbcfg = ContinuousBatchingConfig(seed=seed, max_requests_per_batch=min(window, 1024), block_size=256,
                                         **sizes)
        hints = WorkloadHints(max_prompt_length=self.max_length, max_generated_length=gk["max_new_tokens"],
                              num_requests=window)
        with self.model.continuous_batching_context_manager(
                generation_config=gcfg, continuous_batching_config=cbcfg, workload_hints=hints,
                block=True, timeout=10, warmup=self.device.type == "cuda") as mgr:
            requests = _ManagerRequests(mgr, gk["max_new_tokens"], eos)
            run_streamed(self.turns, requests, convs, chunk, todo, window, on_chunk)


class _ManagerRequests:
    """transformers' continuous-batching manager behind the submit/poll interface `run_streamed` drives."""

    def __init__(self, mgr: Any, max_new_tokens: int, eos: list[int]) -> None:
        self.mgr, self.max_new_tokens, self.eos = mgr, max_new_tokens, eos

    def submit(self, key: str, prompt: list[int], rank: int | None = None) -> None:
        if self.mgr.add_request(prompt, request_id=key, max_new_tokens=self.max_new_tokens,
                                eos_token_id=self.eos) is None:
            raise EyasError("transformers' continuous batching refused a request (its worker stopped: see the "
                            "log above); use --engine generate")

    def poll(self) -> list[tuple[str, list[int]]]:
        res = self.mgr.get_result(timeout=1)
        if res is None:
            if not self.mgr.is_running():
                raise EyasError("transformers' continuous batching stopped unexpectedly (see its log "
                                "above); rerun to resume, or use --engine generate")
            return []
        if not res.is_finished():
            return []
        if res.error is not None:
            raise EyasError(f"generation failed for request {res.request_id}: {res.error}")
        return [(res.request_id, list(res.generated_tokens))]
