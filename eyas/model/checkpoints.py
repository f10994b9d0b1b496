"""Reading draft checkpoints in any EAGLE-3 layout (eyas, vLLM, speculators, SGLang/SpecForge, EAGLE) and
DFlash's (eyas, vLLM/SGLang `DFlashDraftModel`, SpecForge).

Train (`--init-draft`), eval and `eyas export --import` read drafts through `import_draft`, which
undoes each layout's conventions (`eyas.model.layouts`) and refuses a draft made for another target.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open

from eyas.model.aux_layers import check_aux_layer_ids, default_aux_layer_ids, stated_aux_layer_ids
from eyas.model.config import (
    DraftConfig,
    target_config_sha256,
    target_fingerprint_differs,
    target_rope,
    text_config,
)
from eyas.model.draft import DraftModel, check_state_dict
from eyas.model.families import build_draft, draft_class
from eyas.model.family_facts import FAMILIES, family_part
from eyas.model.layouts import DECODER_PREFIX, FORMATS, LAYOUTS
from eyas.model.mla import mla_fields
from eyas.utils.io import EyasError

# Tensors some writers add that the draft itself does not use (speculators keeps the verifier's head
# for its training loss; SGLang-style multi-layer drafts would use `midlayers.N`).
_IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")
_OWN_PREFIX, _MIDLAYER_PREFIX = DECODER_PREFIX["eyas"], DECODER_PREFIX["sglang"]


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise EyasError(f"{path} is not a draft checkpoint: it has no config.json")
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EyasError(f"cannot read {file}: {e}") from e
    if not isinstance(data, dict):
        raise EyasError(f"{file} is not a JSON object")
    return data


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: model.safetensors, sharded safetensors, or pytorch_model.bin."""
    path = Path(path)
    files: list[Path] = []
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise EyasError(f"cannot read {index}: {e}") from e
            files = [path / f for f in sorted(set(weight_map.values()))]
            break
    if not files and (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]  # a training folder may hold other safetensors next to it
    if not files:
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise EyasError(f"{path} has no weights (model.safetensors or pytorch_model.bin)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as f:
                    tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
            else:
                tensors.update(torch.load(file, map_location="cpu", weights_only=True))
        except EyasError:
            raise
        except Exception as e:  # safetensors and torch raise their own types on corrupt files
            raise EyasError(f"cannot read weights {file}: {e}. The file is damaged or incomplete: copy it again, or "
                            "train or export the draft again") from e
    return tensors


def detect_layout(config: dict[str, Any], names: Iterable[str]) -> str:
    """Which writer made a checkpoint: "eyas", "vllm", "speculators", "sglang" (also SpecForge) or "eagle"."""
    if "speculators_model_type" in config:
        return "speculators"
    block = config.get("eyas")
    if isinstance(block, dict) and block.get("layout") in FORMATS:
        return block["layout"]
    if "aux_layer_ids" in config and "target_hidden_size" in config and "architectures" not in config:
        return "eyas"
    names = list(names)
    if any(_strip_model(n).startswith(_MIDLAYER_PREFIX) for n in names):
        return "sglang" if isinstance(config.get("eagle_config"), dict) else "eagle"
    if any(_strip_model(n).startswith(_OWN_PREFIX) for n in names):
        return "vllm"
    raise EyasError("cannot tell which EAGLE-3 layout this is: no `midlayer.*` or `layers.0.*` tensors and no "
                    "eyas or speculators config")


def _strip_model(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def import_draft(path: str | Path, target: str | Path | None = None, aux_layer_ids: list[int] | None = None,
                 layout: str = "auto", force_aux_layer_ids: bool = False,
                 log: Callable[[str], None] | None = None) -> DraftModel:
    """Read a draft in any layout (EAGLE-3: eyas, vLLM, speculators, SGLang/SpecForge, EAGLE; DFlash: eyas,
    vLLM/SGLang, SpecForge; P-EAGLE: eyas, vLLM, speculators) as the model of its family.

    `target` (a transformers folder) is checked against the draft (vocabulary, hidden size, layer
    count, fingerprint), supplies the embedding when the checkpoint left it out (SpecForge and EAGLE
    do), and the layer count EAGLE's hard-coded aux layers derive from. `aux_layer_ids` (eyas'
    convention: input of decoder layer k, eyas.model.aux_layers) names the layers of a checkpoint that
    says none; one that disagrees with the checkpoint's own is refused unless `force_aux_layer_ids`
    (relabeling a draft's layers serves it the wrong states); a forced relabel is told to `log`.
    """
    path = Path(path)
    where = str(path)
    if not path.is_dir():
        raise EyasError(f"{path} is not a folder: give the folder holding config.json and the weights")
    config = read_config(path)
    tensors = read_tensors(path)
    if layout == "auto":
        layout = detect_layout(config, tensors)
    elif layout not in LAYOUTS:
        raise EyasError(f"unknown layout {layout!r}: choose one of auto, {', '.join(LAYOUTS)}")
    target_config = _load_target_config(target) if target is not None else None

    if layout == "eyas":
        cfg = DraftConfig.load(path / "config.json")
    elif (cfg := _family_config(config, where, target_config, str(target) if target else "")) is None:
        cfg = _config_from_foreign(config, layout, where, target_config, str(target) if target else "")  # EAGLE-3
        cfg = dataclasses.replace(cfg, **mla_fields(config, where))  # a DeepSeek (MLA) decoder layer
    if aux_layer_ids is not None:
        stated = cfg.aux_layer_ids if layout == "eyas" else stated_aux_layer_ids(config, layout, where)
        cfg.aux_layer_ids = _given_aux_ids(cfg, stated, aux_layer_ids, force_aux_layer_ids, target_config, where,
                                           log)
    if target_config is not None:
        check_draft_target(cfg, target_config, where, str(target))
    state = _normalize_names(tensors, where)
    _fill_missing(state, cfg, target, where)
    if layout != "eyas" and "mask_hidden" in state:  # P-EAGLE: an EAGLE-3 layout and the mask slots' inputs
        cfg = _as_peagle(config, cfg, state, where)
    model = build_draft(cfg)
    check_state_dict(model, state, where)
    check_vocab_maps(state["d2t"], state["t2d"], where)
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in state.items()})
    return model


def _family_config(config: dict[str, Any], where: str, target_config: Any, target: str) -> DraftConfig | None:
    """The config of a family that has a layout of its own (DFlash's `DFlashDraftModel`, ...), read by that
    family's reader (eyas.model.family_facts); None for EAGLE-3's layouts."""
    for fam in FAMILIES.values():
        if "reader" in fam.parts:
            cfg = family_part(fam.name, "reader")(config, where, target_config, target)
            if cfg is not None:
                return cfg
    return None


def _as_peagle(c: dict[str, Any], cfg: DraftConfig, state: dict[str, torch.Tensor], where: str) -> DraftConfig:
    """A P-EAGLE draft read from vLLM's or speculators' layout (eyas.export.peagle): the mask token's id, its
    learned embedding (the checkpoint's embed_tokens row) and mask_hidden (any shape of k*H_t values)."""
    mask = c.get("mask_token_id", c.get("pard_token"))
    if mask is None or not 0 <= int(mask) < cfg.vocab_size:
        raise EyasError(f"{where}: a P-EAGLE draft (it has mask_hidden) needs the id of its mask token: add "
                        f"mask_token_id to config.json (got {mask!r})")
    state["mask_hidden"] = state["mask_hidden"].reshape(1, -1)
    state["mask_embed"] = state["embed_tokens.weight"][int(mask)].clone()
    return dataclasses.replace(cfg, family="peagle", mask_token_id=int(mask))


def _config_from_foreign(c: dict[str, Any], layout: str, where: str, target_config: Any, target: str) -> DraftConfig:
    """DraftConfig from a vLLM / speculators / SGLang / EAGLE config.json, refusing variants eyas can't run."""
    block = c.get("eyas") if isinstance(c.get("eyas"), dict) else {}
    layer = c.get("transformer_layer_config") if layout == "speculators" else c
    if not isinstance(layer, dict):
        raise EyasError(f"{where}/config.json: speculators config without a transformer_layer_config")
    if layout == "speculators" and c.get("speculators_model_type") not in ("eagle3", "peagle"):
        raise EyasError(f"{where}: speculators model type {c.get('speculators_model_type')!r} is not eagle3 or "
                        "peagle")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in layer]
    if missing:
        raise EyasError(f"{where}/config.json: missing {missing}: not an EAGLE-3 draft config")
    # Variants of the decoder layer that Eagle3Draft does not compute: loading them would be silently wrong.
    unsupported = {"norm_before_residual": c.get("norm_before_residual", False),
                   "norm_before_fc": c.get("norm_before_fc", False),
                   "attention_bias": layer.get("attention_bias", False), "mlp_bias": layer.get("mlp_bias", False)}
    if layout == "speculators" and "norm_before_residual" not in c and c.get("speculators_model_type") == "eagle3":
        unsupported["norm_before_residual"] = True  # what vLLM assumes when speculators' eagle3 leaves it out
    bad = [k for k, v in unsupported.items() if v]
    num_layers = int(layer.get("num_hidden_layers", 1))
    if num_layers != 1 and layout not in ("vllm", "speculators"):  # SGLang and EAGLE: one `midlayer`
        bad.append(f"num_hidden_layers={num_layers}")
    if layer.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={layer['hidden_act']}")
    if bad:
        raise EyasError(f"{where}: this EAGLE-3 variant is not supported by eyas' draft model ({', '.join(bad)})")

    hidden = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    vocab = int(layer["vocab_size"])
    theta, scaling = target_rope(SimpleNamespace(**{k: v for k, v in layer.items()
                                                    if k in ("rope_theta", "rope_scaling", "rope_parameters")}))
    target_layers = int(block.get("target_num_layers") or 0)
    if target_config is not None:
        target_layers = int(text_config(target_config).num_hidden_layers)
    return DraftConfig(
        hidden_size=hidden,
        intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        vocab_size=vocab,
        draft_vocab_size=int(c.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab),
        target_hidden_size=int(c.get("target_hidden_size") or layer.get("target_hidden_size") or hidden),
        aux_layer_ids=_foreign_aux_ids(c, layout, where, target_layers),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        num_hidden_layers=num_layers,
        fc_norm=bool(c.get("fc_norm", False)),
        norm_output=bool(c.get("norm_output", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings") or 4096),
        hidden_act="silu",
        sliding_window=_sliding_window(layer, where),
        target=str(block.get("target") or (c.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")
                   or target or ""),
        target_num_layers=target_layers,
        target_config_sha256=str(block.get("target_config_sha256") or
                                 (target_config_sha256(target_config) if target_config is not None else "")),
    )


def _sliding_window(layer: dict[str, Any], where: str) -> int:
    """The draft's window as vLLM reads it (layer_types + sliding_window); 0 = full attention."""
    kinds = set(layer.get("layer_types") or ["full_attention"])
    if kinds == {"full_attention"}:
        return 0
    if kinds != {"sliding_attention"} or not layer.get("sliding_window"):
        raise EyasError(f"{where}/config.json: layer_types {layer.get('layer_types')} with sliding_window "
                        f"{layer.get('sliding_window')}: eyas' draft takes one window for every layer, or none")
    return int(layer["sliding_window"])


def _foreign_aux_ids(c: dict[str, Any], layout: str, where: str, target_layers: int) -> list[int]:
    """Aux layer ids in eyas' convention, read the way the layout's own engine reads them."""
    ids = stated_aux_layer_ids(c, layout, where)
    if ids is not None:
        return ids
    if target_layers > 0:  # EAGLE hard-codes the default rule; so do vLLM and SGLang without ids
        return default_aux_layer_ids(target_layers)
    raise EyasError(f"{where}: the checkpoint does not say which target layers it reads (EAGLE's own checkpoints "
                    "never do): pass --model <target model folder> to use the default [2, N//2, N-3], or "
                    "--aux-layers")


def _normalize_names(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Foreign names -> eyas names: drop `model.`, `midlayer.` -> `layers.0.`, leave out verifier copies."""
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        name = _strip_model(name)
        if name in _IGNORED:
            continue
        if name.startswith(_MIDLAYER_PREFIX):
            name = _OWN_PREFIX + name[len(_MIDLAYER_PREFIX):]
        if name.startswith(("midlayers.", "additional_layers.")):
            raise EyasError(f"{where}: SGLang-style drafts with more than one decoder layer are not supported ({name})")
        if name in state:
            raise EyasError(f"{where}: tensor {name} appears twice under different spellings")
        state[name] = t
    return state


def _fill_missing(state: dict[str, torch.Tensor], cfg: DraftConfig, target: str | Path | None, where: str) -> None:
    """Rebuild what writers leave out: the embedding (from the target), one vocab map from the other."""
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    if "embed_tokens.weight" not in state:
        if target is None:
            raise EyasError(f"{where}: the checkpoint has no embed_tokens (SpecForge and EAGLE leave the target's "
                            "embedding out): pass --model <target model folder> to copy it from the target")
        state["embed_tokens.weight"] = target_embedding(target)
    if "lm_head.weight" not in state and draft_class(cfg).head_from_target:  # the engines use the target's then
        if target is None or Vd != V:
            raise EyasError(f"{where}: the DFlash checkpoint has no lm_head (it shares the target's): pass --model "
                            "<target model folder> to copy it from the target")
        state["lm_head.weight"] = target_lm_head(target)
    if "d2t" not in state and "t2d" not in state:
        if Vd != V:
            raise EyasError(f"{where}: missing d2t and t2d, needed for a draft vocabulary of {Vd} < {V} tokens")
        state["d2t"] = torch.zeros(Vd, dtype=torch.int64)
        state["t2d"] = torch.ones(V, dtype=torch.bool)
    elif "t2d" not in state:
        t2d = torch.zeros(V, dtype=torch.bool)
        ids = torch.arange(state["d2t"].numel()) + state["d2t"].to(torch.int64)
        if ids.numel() and (ids.min() < 0 or ids.max() >= V):
            raise EyasError(f"{where}: d2t maps draft ids outside the target vocabulary [0, {V})")
        t2d[ids] = True
        state["t2d"] = t2d
    elif "d2t" not in state:
        chosen = torch.nonzero(state["t2d"].to(torch.bool)).flatten()
        state["d2t"] = chosen - torch.arange(chosen.numel())


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    """d2t and t2d must describe the same set of distinct target ids, or the draft proposes wrong tokens."""
    V, Vd = t2d.numel(), d2t.numel()
    ids = torch.arange(Vd) + d2t.to(torch.int64).cpu()
    if Vd and (ids.min() < 0 or ids.max() >= V):
        raise EyasError(f"{where}: d2t maps draft ids to target ids outside [0, {V}): the vocab maps are corrupt")
    if torch.unique(ids).numel() != Vd:
        raise EyasError(f"{where}: d2t maps two draft ids to the same target id: the vocab maps are corrupt")
    t2d = t2d.to(torch.bool).cpu()
    if int(t2d.sum()) != Vd or not bool(t2d[ids].all()):
        raise EyasError(f"{where}: t2d marks {int(t2d.sum())} target ids but d2t maps {Vd} others: the two vocab "
                        "maps disagree (re-export the draft)")


# -- the target ------------------------------------------------------------------------------------


def _load_target_config(target: str | Path | Any) -> Any:
    if not isinstance(target, (str, Path)):
        return target  # already a config object
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(target), local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError variants
        raise EyasError(f"cannot read the target's config from {target}: {e}") from e


def _given_aux_ids(cfg: DraftConfig, stated: list[int] | None, given: list[int], force: bool, target_config: Any,
                   where: str, log: Callable[[str], None] | None) -> list[int]:
    """--aux-layers for a draft: refused where it relabels the checkpoint's own ids unless forced (then the
    change is logged), and checked against the target's layer count (the draft's recorded one without a
    target; a target is needed where neither says it)."""
    ids = [int(i) for i in given]
    if stated is not None and ids != list(stated) and not force:
        raise EyasError(f"{where}: the draft was trained on aux layers {list(stated)}; --aux-layers {ids} would "
                        "relabel them and serve it states of other layers. Drop --aux-layers, or add "
                        "--force-aux-layers if the checkpoint's ids are wrong")
    layers = int(text_config(target_config).num_hidden_layers) if target_config is not None else cfg.target_num_layers
    if not layers and force:
        raise EyasError(f"{where}: the draft does not record its target's layer count, so --force-aux-layers {ids} "
                        "cannot be checked: pass --model with the target")
    check_aux_layer_ids(ids, layers or max(ids + [0]), f"{where}: --aux-layers")  # without a count: no upper bound
    if stated is not None and ids != list(stated) and log is not None:
        log(f"--force-aux-layers: relabelled the draft's aux layer ids {list(stated)} -> {ids} (input of decoder "
            "layer k); the served draft reads those target layers")
    return ids


def check_draft_target(cfg: DraftConfig, target_config: Any, where: str, target_name: str = "") -> None:
    """Refuse a draft made for another target, naming what differs (the engines would only lose acceptance)."""
    c = text_config(target_config)
    name = target_name or getattr(c, "_name_or_path", "") or "the target"
    problems = []
    if int(c.vocab_size) != cfg.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target's {c.vocab_size}")
    if int(c.hidden_size) != cfg.target_hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != target's hidden_size {c.hidden_size}")
    try:
        check_aux_layer_ids(cfg.aux_layer_ids, int(c.num_hidden_layers), "aux_layer_ids")
    except EyasError as e:
        problems.append(str(e))
    sha = target_config_sha256(target_config)
    if target_fingerprint_differs(cfg.target_config_sha256, target_config, where):
        problems.append(f"target_config_sha256 {cfg.target_config_sha256[:12]}... != target's {sha[:12]}... "
                        f"(the draft was trained for {cfg.target or 'another target'})")
    if problems:
        raise EyasError(f"{where}: this draft does not fit {name}: " + "; ".join(problems)
                        + ". Use the target it was trained for, or train a draft for this one.")


_EMBEDDING_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight",
                    "language_model.model.embed_tokens.weight", "transformer.wte.weight")


def target_embedding(target: str | Path) -> torch.Tensor:
    """The target's input embedding [V, H], read from its safetensors without loading the model."""
    return _target_tensor(Path(target), _EMBEDDING_NAMES, "embedding")


def target_lm_head(target: str | Path) -> torch.Tensor:
    """The target's lm_head [V, H] (its embedding when the two are tied), read from its safetensors."""
    names = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")
    return _target_tensor(Path(target), names + _EMBEDDING_NAMES, "lm_head")


def _target_tensor(target: Path, names: tuple[str, ...], what: str) -> torch.Tensor:
    """The first of `names` found in the target's safetensors files."""
    files = sorted(target.glob("*.safetensors"))
    if not files:
        raise EyasError(f"{target} has no *.safetensors to take the target's {what} from")
    found: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            found.update({k: file for k in f.keys() if k in names})  # noqa: SIM118
    for name in names:
        if name in found:
            with safe_open(str(found[name]), framework="pt") as f:
                return f.get_tensor(name)
    raise EyasError(f"{target}: no {what} tensor ({', '.join(names[:2])}, ...) in its safetensors files")
