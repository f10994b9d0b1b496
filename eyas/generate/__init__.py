"""Generation: the target writes the replies `eyas regenerate` puts in place of the old ones.

A generator turns prompt ids into reply ids and has one method, `run(convs, chunk, todo, seed,
on_chunk)`: rewrite chunks `todo` of `chunk` conversations each, calling `on_chunk(b, conversations,
counts)` as each is done. What to generate and what to do with a reply is `turns.Turns`, shared by
all of them; when each turn runs (in rounds, or streamed) is `scheduler`. The generators:
- "generate" (`padded`): transformers' `generate` on left-padded batches, one round of turns at a time;
- "static" (`static`, `graph_decode`): eyas' continuous batching over static KV caches, each decode
  step one CUDA graph, turns streamed;
- "continuous" (`continuous`): transformers' continuous batching, turns streamed;
- "vllm" (`vllm`): each round of turns sent to vLLM at once (tensor parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from eyas.generate.turns import Sampling, Stats
from eyas.utils.io import EyasError

GENERATORS = ("auto", "generate", "static", "vllm", "continuous")


def resolve_generator(name: str, device: torch.device) -> str:
    """The generator `name` stands for: "auto" is the CUDA-graph one where it pays (a GPU), else
    "generate" (on a CPU both run at the same speed)."""
    if name not in GENERATORS:
        raise EyasError(f"--engine must be one of {', '.join(GENERATORS)}, not {name!r}")
    if name == "auto":
        return "static" if device.type == "cuda" else "generate"
    return name


def run_generator(name: str, model: Any, tokenizer: Any, sampling: Sampling, max_length: int,
                  work: Callable[[Any], None], *, fallback: bool = False, window: int = 512,
                  kv_cache_gb: float = 0, tp: int = 1, dtype: str = "auto", trust_remote_code: bool = False) -> None:
    """Build generator `name` (not "auto") and run `work(generator)`.

    `model` is a loaded causal LM with its `tokenizer`, or for "vllm" the target's folder or hub id
    (vLLM loads it, with `tp`, `dtype` and `trust_remote_code`). With `fallback` ("auto" was asked for),
    a model "static" refuses gets "generate". `window`: "continuous"'s conversations in flight;
    `kv_cache_gb`: "static"'s KV cache (0 = 60% of the free GPU memory)."""
    if name == "vllm":
        from eyas.generate.vllm import run_vllm

        run_vllm(model, sampling, max_length, tp, dtype, trust_remote_code, work)
    elif name == "continuous":
        from eyas.generate.continuous import ContinuousGenerator

        work(ContinuousGenerator(model, tokenizer, sampling, max_length, window))
    else:
        work(_static_or_padded(name, model, tokenizer, sampling, max_length, fallback, kv_cache_gb))


def _static_or_padded(name: str, model: Any, tokenizer: Any, sampling: Sampling, max_length: int, fallback: bool,
                      kv_cache_gb: float) -> Any:
    """Generator "static" or "generate"; with `fallback`, "generate" where "static" refuses the model."""
    from eyas.generate.padded import PaddedGenerator

    if name == "static":
        from eyas.generate.static import StaticGenerator

        try:
            return StaticGenerator(model, tokenizer, sampling, max_length, kv_cache_gb)
        except EyasError as e:  # the decoder's own words name no option (eval runs it too): these do
            if not fallback:
                raise EyasError(f"--engine static: {e}; use --engine generate") from e
            import typer

            typer.echo(f"note: --engine static: {e}: falling back to transformers' generate", err=True)
    return PaddedGenerator(model, tokenizer, sampling, max_length)


def generator_target(name: str, model: Any, tokenizer: Any, dtype: str = "auto", device: str = "auto",
                     trust_remote_code: bool = False) -> tuple[Any, Any]:
    """What generator `name` gets as (model, tokenizer): for "vllm" the target's folder or hub id (vLLM
    loads it itself), else the causal LM with its tokenizer, loaded here when `model` names it."""
    if name == "vllm":
        if not isinstance(model, str):
            raise EyasError("--engine vllm loads the target itself: pass its folder or hub id, not a loaded model")
        return model, None
    if isinstance(model, str):
        return load_generator(model, dtype, device, trust_remote_code)
    if tokenizer is None:
        raise EyasError("run_regenerate(model=<loaded model>) also needs its tokenizer")
    return model, tokenizer


def load_generator(model: str, dtype: str = "auto", device: str = "auto",
                   trust_remote_code: bool = False) -> tuple[Any, Any]:
    """The target as a causal LM with its tokenizer (bf16 on GPU, fp32 on CPU by default, SDPA attention)."""
    from transformers import AutoTokenizer

    from eyas.engines.hf import load_hf_model
    from eyas.utils.devices import resolve_device, resolve_dtype

    dev = resolve_device(device)
    try:
        tok = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
        # a multimodal wrapper (Kimi-K2.5) generates text like a causal LM
        lm = load_hf_model(model, resolve_dtype(dtype, dev), dev, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise EyasError(f"cannot load target '{model}' for generation: {e}") from e
    if tok.chat_template is None:
        raise EyasError(f"{model}: the tokenizer has no chat template; regenerate needs one to build prompts")
    return lm.to(dev).eval(), tok


__all__ = ["GENERATORS", "Sampling", "Stats", "generator_target", "load_generator", "resolve_generator",
           "run_generator"]
