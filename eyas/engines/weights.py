"""Weights a target's checkpoint lacks, named before any engine runs it.

transformers fills a missing weight with random values and vLLM leaves it uninitialized; either way
every state after it is wrong (or NaN) and nothing says why. The hf engine reads the loader's own
missing keys; an engine that loads the weights itself (vLLM) is checked here first, from names alone:
the checkpoint's tensor names (safetensors headers, no tensor read) renamed as transformers' loader
renames them, against the parameters of the model built on the meta device (no memory).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from eyas.utils.io import EyasError


class MissingWeightsError(EyasError):
    """The checkpoint lacks weights the model has: the engine would run with random or uninitialized ones."""


def check_loaded(model: str, missing: Iterable[str], allow: bool, fills: str = "transformers would fill them with "
                 "random values") -> None:
    """Refuse a checkpoint that lacks weights (`fills`: what the engine would run with instead)."""
    names = sorted(missing)
    if names and not allow:
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        raise MissingWeightsError(
            f"target '{model}' lacks {len(names)} weight(s) its model has: {', '.join(names[:8])}{more}. {fills}, and "
            "every state and logit after them would be wrong. Check that every shard is there "
            "(model.safetensors.index.json); to load it anyway, pass --allow-missing-weights to `eyas extract` "
            "(online `eyas train`: --target-options '{\"allow_missing_weights\": true}')")


def checkpoint_tensor_names(folder: Path) -> dict[str, list[int]]:
    """Every tensor name of a safetensors checkpoint with its shape, read from the headers only."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file() \
        else sorted(folder.glob("*.safetensors"))
    names: dict[str, list[int]] = {}
    for f in files:
        if not f.is_file():
            continue  # a shard the index names but the folder lacks: its weights show up as missing
        with safe_open(str(f), "pt") as sf:
            names.update({k: list(sf.get_slice(k).get_shape()) for k in sf.keys()})  # noqa: SIM118
    return names


def _meta_model(folder: Path, trust_remote_code: bool) -> Any:
    """The target's transformers model on the meta device, or None where transformers cannot build it."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - a config only vLLM reads: nothing to check the names against
        return None
    for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        try:
            with torch.device("meta"):
                return getattr(transformers, auto).from_config(config, trust_remote_code=trust_remote_code)
        except Exception:  # noqa: BLE001 - not this auto class, or an architecture only vLLM implements
            continue
    return None


def missing_weights(folder: str | Path, trust_remote_code: bool = False) -> list[str] | None:
    """The model's parameters that no checkpoint tensor loads into (a merged expert tensor also counts when
    the checkpoint holds fewer experts than it has); None where names cannot tell: no safetensors, a
    quantized checkpoint (packed names only its quantizer's model has), or a model transformers cannot build."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import MergeModulelist, WeightConverter, WeightRenaming
    except ImportError:  # a transformers without the loader's renaming rules
        return None
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config"):
        return None
    names = checkpoint_tensor_names(folder)
    model = _meta_model(folder, trust_remote_code) if names else None
    if model is None:
        return None
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    want = model.state_dict()
    loaded = _sources_per_parameter(names, model, want, renamings, converters, by_pattern)
    missing = []
    for key, param in want.items():
        got = loaded.get(key)
        if not got:
            missing.append(key)
            continue
        conv = by_pattern.get(next(iter(got)) or "")
        if conv is not None and any(isinstance(op, MergeModulelist) for op in conv.operations):
            experts, held = int(param.shape[0]), min(got.get(p, 0) for p in conv.source_patterns)
            if held < experts:
                missing.append(f"{key} ({held} of {experts} experts)")
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
    return [m for m in missing if m not in tied and not any(r.search(m) for r in ignored)]


def _sources_per_parameter(names: Iterable[str], model: Any, want: dict[str, Any], renamings: list, converters: list,
                           by_pattern: dict[str, Any]) -> dict[str, dict[str | None, int]]:
    """For each model parameter, how many checkpoint tensors load into it, per converter source pattern
    (None: a plain rename), the checkpoint's names renamed as transformers' loader renames them."""
    from transformers.core_model_loading import rename_source_key

    counts: dict[str, dict[str | None, int]] = {}
    for name in names:
        key, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, want)
        if key not in want and name in want:
            key, pattern = rename_source_key(name, [], [], model.base_model_prefix, want)
        conv = by_pattern.get(pattern) if pattern is not None else None
        targets = [key]
        if conv is not None and len(conv.target_patterns) > 1 and conv.target_patterns[0] in key:
            targets += [key.replace(conv.target_patterns[0], t) for t in conv.target_patterns[1:]]  # qkv -> q, k, v
        for t in targets:
            if t in want:
                counts.setdefault(t, {}).setdefault(pattern, 0)
                counts[t][pattern] += 1
    return counts
