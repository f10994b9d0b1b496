"""Regenerate's preflight: the generator's own greedy reply to a few real prompts must be the target's own
next token at every step, by a plain transformers forward over prompt + reply (teacher forcing).

A generator that runs the target wrongly (left padding or position ids, a KV-cache or kernel bug, a bad
quantization or tensor-parallel setup) writes plausible-looking replies for hours; a few greedy tokens
show it. The reference is the loaded model itself, or for `--engine vllm` a float32 CPU copy of a
small enough target (`eyas.engines.preflight.load_reference_copy`). "static" checks its own prefill and
decode logits against a plain forward when it starts; "continuous" has no one-call greedy path here.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from eyas.engines.preflight import (
    EXACT,
    HALF,
    MAX_DISAGREE,
    Fault,
    PreflightError,
    load_reference_copy,
    misses_argmax,
)
from eyas.generate.turns import Conversation, Sampling, Turns, turn_counts

NEW_TOKENS = 4  # greedy tokens per prompt
NUM_PROMPTS = 4
MAX_PROMPT_TOKENS = 512


def first_prompts(turns: Turns, convs: list[list[dict]], n: int = NUM_PROMPTS) -> list[list[int]]:
    """The prompt ids of the first reply of up to `n` of the first conversations (short ones)."""
    prompts = []
    for messages in convs[:4 * n]:
        opened = turns.open(Conversation(messages), turn_counts())
        if opened is not None and len(opened[1]) <= MAX_PROMPT_TOKENS:
            prompts.append(opened[1])
        if len(prompts) == n:
            break
    return prompts


def preflight_generator(gen: Any, target: nn.Module | str, convs: list[list[dict]], *,
                        trust_remote_code: bool = False, log: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Check `gen`'s greedy replies against the target's own argmax; raise PreflightError when they part."""
    say = log or (lambda _msg: None)
    name = type(gen).__name__
    if not hasattr(gen, "decode"):
        say(f"preflight: {name} is not checked here (static checks its logits against a plain forward when it "
            "starts; continuous has no one-call greedy path)")
        return {"skipped": [name]}
    t0 = time.perf_counter()
    prompts = first_prompts(gen.turns, convs)
    twin = copy.copy(gen)  # the same running target, greedy for a few tokens
    twin.sampling = Sampling(temperature=0.0, max_new_tokens=NEW_TOKENS)
    replies = twin.decode(prompts, 0) if prompts else []
    model, why = (target, "") if isinstance(target, nn.Module) else load_reference_copy(target, trust_remote_code)
    if model is None or not prompts:
        say(f"preflight: {name}'s greedy replies not checked ({why or 'no prompt fits'})")
        return {"skipped": [name]}
    exact = isinstance(target, nn.Module) and next(model.parameters()).dtype == torch.float32
    misses = _misses(model, prompts, replies, set(gen.turns.eos), (EXACT if exact else HALF).tie)
    if misses is None:
        raise PreflightError(f"the {name} generator", [Fault("final_head", (
            "the target's own logits over its prompts are not finite (NaN/inf): its weights are damaged (a NaN "
            "final norm or lm_head), so every reply would be garbage"))])
    if misses.float().mean() > MAX_DISAGREE:
        raise PreflightError(f"the {name} generator", [Fault("generator_greedy", (
            f"its greedy replies to {len(prompts)} prompts pick the target's own next token (plain transformers "
            f"forward over prompt + reply) at only {int((~misses).sum())} of {misses.numel()} steps: the generator "
            "does not run this target faithfully (padding or positions, KV cache, kernels, quantization or tensor "
            "parallel)"))])
    seconds = time.perf_counter() - t0
    say(f"preflight: {name}'s greedy replies to {len(prompts)} prompts are the target's own next tokens "
        f"({misses.numel()} steps, {seconds:.1f}s)")
    return {"seconds": seconds, "skipped": []}


@torch.inference_mode()
def _misses(model: nn.Module, prompts: list[list[int]], replies: list[list[int]], eos: set[int],
            tie: float) -> torch.Tensor | None:
    """[steps] True where a reply token is not the reference's argmax (a stop token where the reference
    also stops counts as agreeing: generators may write a different stop id); None when the reference's
    logits are not finite (their argmax would agree with anything)."""
    device = model.get_input_embeddings().weight.device
    out = []
    for prompt, reply in zip(prompts, replies, strict=True):
        if not reply:
            continue
        ids = torch.tensor([prompt + reply[:-1]], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:].float().cpu()  # [len(reply), V]
        if not bool(torch.isfinite(logits).all()):
            return None
        picks = torch.tensor(reply)
        both_stop = torch.tensor([t in eos and int(a) in eos for t, a in zip(reply, logits.argmax(-1), strict=True)])
        out.append(misses_argmax(logits, picks, tie) & ~both_stop)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)
