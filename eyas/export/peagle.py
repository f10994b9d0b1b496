"""Writing a P-EAGLE draft (eyas.model.peagle) for vLLM, with the command that serves it.

vLLM 0.32 serves P-EAGLE as an EAGLE-3 draft with parallel drafting: the EAGLE-3 export (eyas.export.writers)
plus `mask_token_id` in config.json and the `mask_hidden` tensor [1, k*H_t], served with
`speculative_config={"method": "eagle3", "parallel_drafting": true, ...}`. The config cannot turn parallel
drafting on by itself: without that key vLLM ignores `mask_hidden` (one warning) and runs the draft as an
EAGLE-3 chain, which it was not trained for. The learned mask embedding is written into the row
`mask_token_id` of the checkpoint's embed_tokens: vLLM keeps a draft embedding that differs from the
target's and reads that row at every mask slot.

| layout | config.json | vLLM starts it with |
| --- | --- | --- |
| vllm | `LlamaForCausalLMEagle3` + `mask_token_id` | `speculative_config` method eagle3 + `parallel_drafting` |
| speculators | `speculators_model_type: "peagle"` + `mask_token_id` | `LLM(D)` / `vllm serve D` (it adds both) |

Not `architectures: ["PEagleDraftModel"]` (SpecForge's name): vLLM 0.32 prefixes it to
`Eagle3PEagleDraftModel` and refuses to start ("Model architectures ['Eagle3PEagleDraftModel'] are not
supported"). SGLang does not serve P-EAGLE. eyas.model.checkpoints reads both layouts back (`import_draft`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import eyas
from eyas.export.writers import FamilyWriter, _check_exportable, export_tensors, speculators_config, vllm_config
from eyas.model.config import DraftConfig
from eyas.model.peagle import PEagleDraft
from eyas.utils.io import EyasError


def peagle_vllm_config(cfg: DraftConfig, dtype: str = "bfloat16", verifier: str | None = None,
                       num_speculative_tokens: int = 7) -> dict[str, Any]:
    """vLLM's EAGLE-3 config and the mask token its parallel drafting fills the open slots with."""
    config = vllm_config(cfg, dtype, verifier=verifier, num_speculative_tokens=num_speculative_tokens)
    config["mask_token_id"] = cfg.mask_token_id
    config["eyas"] = {**config["eyas"], "family": "peagle"}
    return config


def peagle_speculators_config(cfg: DraftConfig, dtype: str = "bfloat16", verifier: str | None = None,
                              num_speculative_tokens: int = 7) -> dict[str, Any]:
    """speculators' `PEagleSpeculatorConfig`: `vllm serve <folder>` turns it into eagle3 + parallel drafting."""
    config = speculators_config(cfg, dtype, verifier=verifier, num_speculative_tokens=num_speculative_tokens)
    config.update(architectures=["PEagleSpeculator"], speculators_model_type="peagle", mask_token_id=cfg.mask_token_id,
                  embed_requires_grad=True)  # speculators trains P-EAGLE's embedding (the mask row must move)
    config["speculators_config"]["algorithm"] = "peagle"
    config["eyas"] = {**config["eyas"], "family": "peagle"}
    return config


def check(cfg: DraftConfig, fmt: str, num_speculative_tokens: int) -> None:
    """EAGLE-3's checks, and what vLLM's P-EAGLE paths do not read."""
    _check_exportable(cfg, fmt, num_speculative_tokens)
    if fmt == "speculators" and cfg.fc_norm:
        raise EyasError("vLLM's speculators reader for peagle drafts does not read fc_norm (its eagle3 one does): "
                        "export --format vllm, which serves it")


def tensors(draft: PEagleDraft, fmt: str, dtype: torch.dtype = torch.bfloat16,
            include_embedding: bool = True) -> dict[str, torch.Tensor]:
    """EAGLE-3's tensors with `mask_hidden` [1, k*H_t], and the learned mask embedding in embed_tokens' row
    `mask_token_id` (vLLM has no tensor of its own for it)."""
    if not include_embedding:
        raise EyasError("a peagle draft's mask embedding is learned and travels in embed_tokens: export it with the "
                        "embedding (without it vLLM would read the target's row of the mask token)")
    out = export_tensors(draft, fmt, dtype, include_embedding=True)
    mask_embed = out.pop("mask_embed")
    out["embed_tokens.weight"] = out["embed_tokens.weight"].clone()
    out["embed_tokens.weight"][draft.config.mask_token_id] = mask_embed
    return out


def serve_readme(fmt: str, out: Path, cfg: DraftConfig, verifier: str | None, k: int) -> str:
    """README.md for an export folder: the exact command that serves it, and what it was made from."""
    target = verifier or "<target model>"
    if fmt == "vllm":
        spec = {"method": "eagle3", "parallel_drafting": True, "model": str(out), "num_speculative_tokens": k}
        command = f"vllm serve {target} \\\n  --speculative-config '{json.dumps(spec)}'"
        python = f"from vllm import LLM\nllm = LLM(model=\"{target}\",\n          speculative_config={spec!r})"
        how = ("`\"parallel_drafting\": true` is required: without it vLLM drops `mask_hidden` and runs the draft as "
               "an EAGLE-3 chain it was not trained for.")
    else:
        command = f"vllm serve {out}"
        python = f"from vllm import LLM\nllm = LLM(model=\"{out}\")  # loads the target named in config.json"
        how = "vLLM turns `speculators_model_type: peagle` into method eagle3 with parallel drafting."
    lines = [f"# P-EAGLE draft for `{target}` ({fmt} layout)", "",
             f"Exported by eyas {eyas.__version__}. Serve it with:", "", "```bash", command, "```", "",
             "Offline, from Python:", "", "```python", python, "```", "",
             f"- one draft forward proposes {k} tokens: the newest token's position and {k - 1} mask slots (token "
             f"{cfg.mask_token_id}, its learned embedding in embed_tokens, and fc(mask_hidden)). {how}",
             f"- draft: {cfg.num_hidden_layers} layer(s), hidden {cfg.hidden_size}, draft vocabulary "
             f"{cfg.draft_vocab_size} of {cfg.vocab_size}; aux layers `eagle_aux_hidden_state_layer_ids` = "
             f"{cfg.aux_layer_ids} (input of decoder layer k).",
             f"- target fingerprint (eyas): `{cfg.target_config_sha256 or 'unknown'}`; serving it with another target "
             "gives low acceptance, not an error.", ""]
    return "\n".join(lines)


PEAGLE = FamilyWriter(configs={"vllm": peagle_vllm_config, "speculators": peagle_speculators_config}, check=check,
                      tensors=tensors, readme=serve_readme, vllm_method="eagle3",
                      default_k=lambda cfg: 7, vllm_options={"parallel_drafting": True})
