"""Writing a draft in the layouts vLLM, SGLang and speculators serve, with the command that serves it.

What differs between the layouts, and why each difference matters, is in `eyas.model.layouts`;
the readers that undo these writers are in `eyas.model.checkpoints`. Each draft family has a
`FamilyWriter`: EAGLE-3's is written out below, the others' in their own modules (eyas.export.dflash,
eyas.export.peagle, ...); eyas.export.families picks the draft's and writes the folder.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import eyas
from eyas.model.aux_layers import CONVENTION_KEY, LAYOUT_IDS, OUTPUT, to_layout
from eyas.model.config import DraftConfig
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.layouts import DECODER_PREFIX
from eyas.model.mla import MLA_ARCHITECTURES, deepseek_layer_config
from eyas.utils.io import EyasError

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format we write and test against
EXPORT_FORMAT = "eyas.export/1"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ServeOptions:
    """What the serving folder says about the draft beyond its weights."""

    verifier: str | None = None  # the target's HF id or path as the engine should load it
    dtype: str = "bfloat16"  # floating tensors; d2t stays int64 and t2d bool
    num_speculative_tokens: int | None = None  # None: the family's default (FamilyWriter.default_k)
    include_embedding: bool = True  # the engines fall back to the target's embedding without it


@dataclass(frozen=True)
class FamilyWriter:
    """How one draft family is written for serving."""

    configs: dict[str, Callable[..., dict[str, Any]]]  # format -> config.json (cfg, dtype, verifier=, k=)
    check: Callable[[DraftConfig, str, int], None]  # refuse what `fmt` would serve wrongly (cfg, fmt, k)
    tensors: Callable[[Any, str, torch.dtype, bool], dict[str, torch.Tensor]]  # (draft, fmt, dtype, embedding)
    readme: Callable[[str, Path, DraftConfig, str | None, int], str]  # (fmt, out, cfg, verifier, k)
    vllm_method: str  # vLLM's speculative_config["method"]
    default_k: Callable[[DraftConfig], int]  # num_speculative_tokens when none is given
    vllm_options: dict[str, Any] = field(default_factory=dict)  # more speculative_config keys vLLM needs


def _check_exportable(cfg: DraftConfig, fmt: str, num_speculative_tokens: int) -> None:
    """Refuse what an engine would load wrongly rather than export something that serves badly (any K serves)."""
    k = cfg.num_aux_layers
    if fmt == "sglang" and k != 3:
        raise EyasError(f"SGLang's EAGLE-3 draft reads exactly 3 aux layers (fc input 3 x target hidden); this draft "
                        f"uses {k} ({cfg.aux_layer_ids}). Export --format vllm or speculators, or train with 3 layers.")
    if fmt == "sglang" and min(cfg.aux_layer_ids) < 1:
        raise EyasError(f"SGLang cannot capture the embeddings (layer id 0) as an aux layer: its ids are k - 1; "
                        f"this draft uses {cfg.aux_layer_ids}.")
    n = cfg.target_num_layers
    if fmt == "sglang" and n and max(cfg.aux_layer_ids) >= n:
        raise EyasError(f"SGLang captures the inputs of decoder layers 0..{n - 1} only, not the last layer's output "
                        f"(aux id {n}, which vLLM collects); this draft reads {cfg.aux_layer_ids}. Export --format "
                        f"vllm, or train a draft whose aux ids are at most {n - 1}.")
    if fmt == "sglang" and cfg.num_hidden_layers != 1:
        raise EyasError(f"SGLang's EAGLE-3 draft has one decoder layer (`midlayer`); this draft has "
                        f"{cfg.num_hidden_layers}. Export --format vllm or speculators, which build the later layers.")
    if fmt == "speculators" and cfg.target_hidden_size != cfg.hidden_size:
        raise EyasError(f"speculators sizes fc as {k} x the draft's hidden size ({cfg.hidden_size}), but this draft "
                        f"reads target states of size {cfg.target_hidden_size}: export --format vllm instead.")
    if fmt == "sglang" and (cfg.fc_norm or cfg.norm_output):
        raise EyasError("this is an EAGLE-3.1 draft (fc_norm / norm_output); SGLang releases without those "
                        "switches skip the fc_norm tensors and feed the raw hidden state without a word. "
                        "Export --format vllm or speculators.")
    if cfg.sliding_window and fmt != "vllm":
        raise EyasError(f"this draft attends through a sliding window of {cfg.sliding_window} positions; only vLLM's "
                        f"EAGLE-3 draft is known to serve it (its layer_types and sliding_window fields), and a {fmt} "
                        "draft would attend to everything without a word: export --format vllm")
    if cfg.hidden_act != "silu":
        raise EyasError(f"hidden_act {cfg.hidden_act!r} is not supported by the engines' EAGLE-3 drafts (silu only)")
    if cfg.attention == "mla" and fmt == "speculators":
        raise EyasError("speculators has no EAGLE-3 draft with an MLA layer: export --format vllm or sglang")
    if cfg.attention == "mla" and fmt == "sglang" and not cfg.q_lora_rank:
        raise EyasError("SGLang's MLA draft layer needs a query down-projection (q_lora_rank); this draft has none. "
                        "Export --format vllm, or train it with `eyas train --mla-q-lora-rank N`")


def export_tensors(draft: Eagle3Draft, fmt: str, dtype: torch.dtype = torch.bfloat16,
                   include_embedding: bool = True) -> dict[str, torch.Tensor]:
    """The draft's state dict under `fmt`'s names: floats in `dtype`, d2t int64, t2d bool."""
    prefix, own = DECODER_PREFIX[fmt], DECODER_PREFIX["eyas"]
    tensors: dict[str, torch.Tensor] = {}
    for name, t in draft.state_dict().items():
        if name == "embed_tokens.weight" and not include_embedding:
            continue
        t = t.detach().cpu()
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        else:
            t = t.to(dtype)
        if name.startswith(own):
            name = prefix + name[len(own):]
        tensors[name] = t.contiguous()
    return tensors


def _llama_fields(cfg: DraftConfig, dtype: str) -> dict[str, Any]:
    """The decoder layer as a transformers LlamaConfig (rope in the 4.x spelling every engine reads)."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        # SGLang ties lm_head to embed_tokens when this is true: the draft head would be the target's.
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def _decoder_fields(cfg: DraftConfig, dtype: str, fmt: str) -> dict[str, Any]:
    """The draft's architecture and its decoder layer's config: Llama's, or DeepSeek's for an MLA layer."""
    if cfg.attention == "mla":
        return {"architectures": [MLA_ARCHITECTURES[fmt]], **deepseek_layer_config(cfg, dtype)}
    return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(cfg, dtype)}


def _eyas_block(cfg: DraftConfig, fmt: str, ids_layout: str | None = None) -> dict[str, Any]:
    """What the engines don't need but a later import does: the target's identity, and the aux ids in eyas'
    convention beside the convention of the ids the engine reads (`ids_layout`'s; default `fmt`'s), which
    the reader checks against each other (eyas.model.aux_layers)."""
    return {"format": EXPORT_FORMAT, "layout": fmt, "eyas_version": eyas.__version__,
            "aux_layer_ids": list(cfg.aux_layer_ids), CONVENTION_KEY: LAYOUT_IDS[ids_layout or fmt][1],
            "target": cfg.target, "target_num_layers": cfg.target_num_layers,
            "target_config_sha256": cfg.target_config_sha256}


def vllm_config(cfg: DraftConfig, dtype: str = "bfloat16", verifier: str | None = None,
                num_speculative_tokens: int = 3) -> dict[str, Any]:
    """vLLM's `LlamaForCausalLMEagle3` config (vllm/model_executor/models/llama_eagle3.py), or its
    `Eagle3DeepseekV3ForCausalLM` (deepseek_eagle3.py) for an MLA layer."""
    return {
        **_decoder_fields(cfg, dtype, "vllm"),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # read by the target runner to pick the layers to capture (input of decoder layer k)
        "eagle_aux_hidden_state_layer_ids": to_layout(cfg.aux_layer_ids, LAYOUT_IDS["vllm"][1]),
        # read by the draft to size fc (vLLM assumes 3 without it)
        "num_aux_hidden_states": cfg.num_aux_layers,
        "norm_before_residual": False,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        # vLLM's Llama attention takes a layer's window from these (indexed past the target's layers)
        **({"layer_types": ["sliding_attention"] * cfg.num_hidden_layers, "sliding_window": cfg.sliding_window}
           if cfg.sliding_window else {}),
        "eyas": _eyas_block(cfg, "vllm"),
    }


def sglang_config(cfg: DraftConfig, dtype: str = "bfloat16", verifier: str | None = None,
                  num_speculative_tokens: int = 3) -> dict[str, Any]:
    """SGLang's `LlamaForCausalLMEagle3` config (or `Eagle3DeepseekV2ForCausalLM`, kimi_k25_eagle3.py, for
    an MLA layer): SGLang adds 1 to the ids in `eagle_config`."""
    return {
        **_decoder_fields(cfg, dtype, "sglang"),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": to_layout(cfg.aux_layer_ids, LAYOUT_IDS["sglang"][1]),
                         "use_aux_hidden_state": True},
        "eyas": _eyas_block(cfg, "sglang"),
    }


def speculators_config(cfg: DraftConfig, dtype: str = "bfloat16", verifier: str | None = None,
                       num_speculative_tokens: int = 3) -> dict[str, Any]:
    """speculators' `Eagle3SpeculatorConfig`: `vllm serve <folder>` reads the target from `verifier`."""
    if not verifier:
        raise EyasError("the speculators format names the target model that `vllm serve <draft>` loads: "
                        "pass --verifier <HF id or path of the target>")
    layer = _llama_fields(cfg, dtype)
    layer.pop("torch_dtype")
    if cfg.num_aux_layers != 3:  # vLLM builds its draft from this dict and assumes 3 aux layers without it
        layer["num_aux_hidden_states"] = cfg.num_aux_layers
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": to_layout(cfg.aux_layer_ids, LAYOUT_IDS["speculators"][1]),
        # vLLM's speculators reader defaults this to True when absent: always spell it out
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": _verifier_architectures(verifier)},
        },
        "torch_dtype": dtype,
        "eyas": _eyas_block(cfg, "speculators"),
    }


def _verifier_architectures(verifier: str) -> list[str]:
    path = Path(verifier) / "config.json"
    if path.is_file():
        try:
            return list(json.loads(path.read_text()).get("architectures") or [])
        except (OSError, json.JSONDecodeError):
            return []
    return []


def sglang_eagle_flags(steps: int, top_k: int, draft_tokens: int) -> str:
    """SGLang's EAGLE speculation: `steps` draft steps, `top_k` children per node, `draft_tokens` verified (the
    root included): a chain of K is (K, 1, K + 1), an EAGLE-2 tree TOTAL:DEPTH:TOPK is (DEPTH, TOPK, TOTAL + 1)."""
    return (f"--speculative-num-steps {steps} --speculative-eagle-topk {top_k} "
            f"--speculative-num-draft-tokens {draft_tokens}")


def serve_readme(fmt: str, out: Path, cfg: DraftConfig, verifier: str | None, k: int) -> str:
    """README.md for an export folder: the exact command that serves it, and what it was made from."""
    target = verifier or "<target model>"
    ids = cfg.aux_layer_ids
    if fmt == "vllm":
        spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": k})
        command = f"vllm serve {target} \\\n  --speculative-config '{spec}'"
        python = (f"from vllm import LLM\nllm = LLM(model=\"{target}\",\n          speculative_config={spec})")
        ids_note = f"`eagle_aux_hidden_state_layer_ids` = {ids} (vLLM: input of decoder layer k)."
    elif fmt == "speculators":
        command = f"vllm serve {out}"
        python = f"from vllm import LLM\nllm = LLM(model=\"{out}\")  # loads the target named in config.json"
        ids_note = (f"`eagle_aux_hidden_state_layer_ids` = {ids} (input of decoder layer k); vLLM reads the target "
                    f"`{target}` from `speculators_config.verifier`.")
    else:
        command = (f"python -m sglang.launch_server --model-path {target} \\\n  --speculative-algorithm EAGLE3 "
                   f"--speculative-draft-model-path {out} \\\n  {sglang_eagle_flags(k, 1, k + 1)}")
        python = None
        ids_note = (f"`eagle_config.eagle_aux_hidden_state_layer_ids` = {to_layout(ids, OUTPUT)}: SGLang adds 1, so "
                    f"the target captures the inputs of decoder layers {ids}, as in training.")
    lines = [
        f"# EAGLE-3 draft for `{target}` ({fmt} layout)",
        "",
        f"Exported by eyas {eyas.__version__}. Serve it with:",
        "",
        "```bash",
        command,
        "```",
    ]
    if python:
        lines += ["", "Offline, from Python:", "", "```python", python, "```"]
    lines += [
        "",
        f"- draft: hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, "
        f"draft vocabulary {cfg.draft_vocab_size} of {cfg.vocab_size} (d2t/t2d maps included).",
        f"- aux layers: {ids_note}",
        f"- target fingerprint (eyas): `{cfg.target_config_sha256 or 'unknown'}`; serving it with another target "
        "gives low acceptance, not an error.",
        f"- `num_speculative_tokens` {k} is a starting point: tune it against the acceptance `eyas eval` reports.",
        "",
    ]
    return "\n".join(lines)


EAGLE3 = FamilyWriter(configs={"vllm": vllm_config, "sglang": sglang_config, "speculators": speculators_config},
                      check=_check_exportable, tensors=export_tensors, readme=serve_readme, vllm_method="eagle3",
                      default_k=lambda cfg: 3)
