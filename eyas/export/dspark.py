"""Writing a DSpark draft (eyas.model.dspark) for vLLM (`method: dspark`, `Qwen3DSparkModel`).

The folder is DFlash's (eyas.export.dflash: a Qwen3 config with a `dflash_config`, the draft's own tensor
names) plus the Markov and confidence heads under vLLM's names (`markov_head.markov_w1/w2`,
`confidence_head.proj`) and the fields vLLM's DSpark reads from the config:

- `architectures: ["Qwen3DSparkModel"]`: picks the model and `method: dspark`;
- `sample_from_anchor: true`: the anchor's slot makes the first proposal (a block of K for K proposals);
  vLLM takes a missing one as true, so a draft trained the other way would serve near zero acceptance;
- `markov_rank`: the Markov head's width (vLLM's model has no default);
- `enable_confidence_head`, `confidence_head_with_markov`: the confidence head and what it reads;
  without them vLLM drops the head;
- `block_size`, `dflash_config`: DFlash's: the block, the mask token, the aux layers (outputs of k - 1).

`ENGINE_FIELDS` lists them and `dspark_config` refuses to write a config without one. SGLang's DSpark
reads another layout; only vLLM's is written. eyas.model.dspark reads the folder back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import eyas
from eyas.export.dflash import check as dflash_check
from eyas.export.dflash import dflash_config, tensors
from eyas.export.writers import FamilyWriter
from eyas.model.aux_layers import OUTPUT, to_layout
from eyas.model.config import DraftConfig
from eyas.model.dspark import ARCHITECTURE
from eyas.utils.io import EyasError

ENGINE_FIELDS = ("architectures", "sample_from_anchor", "markov_rank", "enable_confidence_head",
                 "confidence_head_with_markov", "block_size", "dflash_config")


def dspark_config(cfg: DraftConfig, dtype: str = "bfloat16", verifier: str | None = None,
                  num_speculative_tokens: int = 16) -> dict[str, Any]:
    """vLLM's `Qwen3DSparkModel` config.json (qwen3_dspark.py and its speculator)."""
    config = dflash_config(cfg, dtype, verifier, num_speculative_tokens)
    config.update(architectures=[ARCHITECTURE], sample_from_anchor=True, markov_rank=cfg.markov_rank,
                  enable_confidence_head=True, confidence_head_with_markov=True)
    check_engine_fields(config)
    return config


def check_engine_fields(config: dict[str, Any]) -> None:
    """Refuse a config that lacks a field vLLM's DSpark reads: it would fall back to a default silently."""
    missing = [name for name in ENGINE_FIELDS if config.get(name) is None]
    if missing:
        raise EyasError(f"a DSpark config without {missing}: vLLM would serve the draft with its defaults for them "
                        "(a missing sample_from_anchor alone costs nearly all acceptance); not written")


def check(cfg: DraftConfig, fmt: str, num_speculative_tokens: int) -> None:
    """DFlash's checks, with DSpark's K: up to block_size proposals (the anchor's slot proposes too)."""
    dflash_check(cfg, fmt, min(num_speculative_tokens, cfg.block_size - 1))
    if num_speculative_tokens > cfg.block_size:
        raise EyasError(f"this draft was trained for blocks of {cfg.block_size} tokens: num_speculative_tokens can "
                        f"be at most {cfg.block_size}, got {num_speculative_tokens}")


def serve_readme(fmt: str, out: Path, cfg: DraftConfig, verifier: str | None, k: int) -> str:
    """README.md for an export folder: the exact command that serves it, and what it was made from."""
    target = verifier or "<target model>"
    spec = json.dumps({"method": "dspark", "model": str(out), "num_speculative_tokens": k})
    return "\n".join([
        f"# DSpark draft for `{target}` ({fmt} layout)", "",
        f"Exported by eyas {eyas.__version__}. Serve it with:", "", "```bash",
        f"vllm serve {target} \\\n  --speculative-config '{spec}'", "```", "",
        f"- draft: {cfg.num_hidden_layers} layer(s), hidden {cfg.hidden_size}, Markov rank {cfg.markov_rank}, "
        f"draft vocabulary {cfg.draft_vocab_size} of {cfg.vocab_size}.",
        f"- one draft forward proposes {k} tokens (a block of {k}: the newest token + {k - 1} slots filled with "
        f"token {cfg.mask_token_id}), each after the Markov bias of the one before; trained for blocks of "
        f"{cfg.block_size}.",
        f"- aux layers: `dflash_config.target_layer_ids` = {to_layout(cfg.aux_layer_ids, OUTPUT)} (the outputs of "
        f"those decoder layers = the inputs of layers {cfg.aux_layer_ids}, as in training).",
        f"- target fingerprint (eyas): `{cfg.target_config_sha256 or 'unknown'}`.", ""])


DSPARK = FamilyWriter(configs={"vllm": dspark_config}, check=check, tensors=tensors, readme=serve_readme,
                      vllm_method="dspark", default_k=lambda cfg: cfg.block_size)
