"""Writing a DFlash draft (eyas.model.dflash) for vLLM and SGLang, with the command that serves it.

Both engines load `DFlashDraftModel` from the same folder: a Qwen3 config with a `dflash_config`
block, and the draft's own tensor names (fc, hidden_norm, layers.i.* with q_norm/k_norm, norm).
What they read differently:

| | vLLM (`method: dflash`) | SGLang (`--speculative-algorithm DFLASH`) |
| --- | --- | --- |
| aux layers | `dflash_config.target_layer_ids` = aux id k - 1 (layer k-1's output) | the same |
| mask token | `dflash_config.mask_token_id` (required) | the same (else the token `<|MASK|>`) |
| tokens per step | `num_speculative_tokens` K (block = K + 1) | `--speculative-num-draft-tokens` K + 1 |
| embedding, head | the checkpoint's (`lm_head` + `d2t`), else the target's | the target's (full vocabulary) |
| fc input | n x `target_hidden_size` | n x `hidden_size` |

eyas.model.checkpoints reads the folder back (`import_draft`).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import torch

import eyas
from eyas.export.writers import FamilyWriter, _eyas_block, _llama_fields
from eyas.model.aux_layers import LAYOUT_IDS, OUTPUT, to_layout
from eyas.model.config import DraftConfig
from eyas.model.dflash import DFlashDraft
from eyas.utils.io import EyasError


def dflash_config(cfg: DraftConfig, dtype: str = "bfloat16", verifier: str | None = None,
                  num_speculative_tokens: int = 15, fmt: str = "vllm") -> dict[str, Any]:
    """`DFlashDraftModel`'s config.json, which vLLM (qwen3_dflash.py) and SGLang (models/dflash.py) both read."""
    return {
        "architectures": ["DFlashDraftModel"],
        **_llama_fields(cfg, dtype),
        "model_type": "qwen3",  # the layer is Qwen3's (q_norm, k_norm)
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.target_num_layers,
        # target_layer_ids i means the OUTPUT of decoder layer i (eyas.model.aux_layers)
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size,
                          "target_layer_ids": to_layout(cfg.aux_layer_ids, LAYOUT_IDS["block"][1])},
        "eyas": {**_eyas_block(cfg, fmt, "block"), "family": cfg.family},
    }


def check(cfg: DraftConfig, fmt: str, num_speculative_tokens: int) -> None:
    """Refuse what an engine would serve wrongly rather than export something that serves badly."""
    if min(cfg.aux_layer_ids) < 1:
        raise EyasError(f"DFlash engines read the outputs of target layers (ids k - 1): the embeddings (aux id 0) "
                        f"cannot be one; this draft uses {cfg.aux_layer_ids}")
    if num_speculative_tokens > cfg.block_size - 1:
        raise EyasError(f"this draft was trained for blocks of {cfg.block_size} tokens: num_speculative_tokens can "
                        f"be at most {cfg.block_size - 1}, got {num_speculative_tokens}")
    if cfg.hidden_act != "silu":
        raise EyasError(f"hidden_act {cfg.hidden_act!r} is not supported by the engines' DFlash drafts (silu only)")
    if fmt == "sglang" and cfg.draft_vocab_size != cfg.vocab_size:
        raise EyasError(f"SGLang's DFlash draft uses the target's lm_head over the whole vocabulary; this draft "
                        f"proposes from {cfg.draft_vocab_size} of {cfg.vocab_size} tokens. Export --format vllm, or "
                        f"train it with `eyas train --draft-vocab-size {cfg.vocab_size}`")
    if fmt == "sglang" and cfg.target_hidden_size != cfg.hidden_size:
        raise EyasError(f"SGLang sizes a DFlash fc as n x the draft's hidden size ({cfg.hidden_size}); this draft "
                        f"reads target states of size {cfg.target_hidden_size}: export --format vllm")


def tensors(draft: DFlashDraft, fmt: str, dtype: torch.dtype = torch.bfloat16,
            include_embedding: bool = True) -> dict[str, torch.Tensor]:
    """The draft's own names (both engines read them): floats in `dtype`, d2t int64, t2d bool. SGLang
    skips embed_tokens, lm_head and the maps (it uses the target's); they stay for the way back."""
    out = {}
    for name, t in draft.state_dict().items():
        if name == "embed_tokens.weight" and not include_embedding:
            continue
        t = t.detach().cpu()
        out[name] = (t.to(torch.int64) if name == "d2t" else t.to(torch.bool) if name == "t2d" else t.to(dtype))
    return {k: v.contiguous() for k, v in out.items()}


def serve_readme(fmt: str, out: Path, cfg: DraftConfig, verifier: str | None, k: int) -> str:
    """README.md for an export folder: the exact command that serves it, and what it was made from."""
    target = verifier or "<target model>"
    if fmt == "vllm":
        spec = json.dumps({"method": "dflash", "model": str(out), "num_speculative_tokens": k})
        command = f"vllm serve {target} \\\n  --speculative-config '{spec}'"
        python = f"from vllm import LLM\nllm = LLM(model=\"{target}\",\n          speculative_config={spec})"
    else:
        command = (f"python -m sglang.launch_server --model-path {target} \\\n  --speculative-algorithm DFLASH "
                   f"--speculative-draft-model-path {out} \\\n  --speculative-num-draft-tokens {k + 1}")
        python = None
    lines = [f"# DFlash draft for `{target}` ({fmt} layout)", "",
             f"Exported by eyas {eyas.__version__}. Serve it with:", "", "```bash", command, "```"]
    if python:
        lines += ["", "Offline, from Python:", "", "```python", python, "```"]
    lines += [
        "",
        f"- draft: {cfg.num_hidden_layers} layer(s), hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads / "
        f"{cfg.num_key_value_heads} KV heads, draft vocabulary {cfg.draft_vocab_size} of {cfg.vocab_size}.",
        f"- one draft forward proposes {k} tokens (a block of {k + 1}: the newest token + {k} slots filled with "
        f"token {cfg.mask_token_id}); trained for blocks of {cfg.block_size}.",
        f"- aux layers: `dflash_config.target_layer_ids` = {to_layout(cfg.aux_layer_ids, OUTPUT)} (the outputs of "
        f"those decoder layers = the inputs of layers {cfg.aux_layer_ids}, as in training).",
        f"- target fingerprint (eyas): `{cfg.target_config_sha256 or 'unknown'}`; serving it with another target "
        "gives low acceptance, not an error.",
        "",
    ]
    return "\n".join(lines)


DFLASH = FamilyWriter(configs={"vllm": dflash_config, "sglang": partial(dflash_config, fmt="sglang")}, check=check,
                      tensors=tensors, readme=serve_readme, vllm_method="dflash",
                      default_k=lambda cfg: cfg.block_size - 1)
