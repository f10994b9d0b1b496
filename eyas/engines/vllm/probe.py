"""Which of the vLLM APIs the `vllm` engine relies on does the installed vLLM have?

Checked before any model loads, so an incompatible vLLM fails with a list of what is missing
instead of wrong states.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eyas.utils.io import EyasError

MIN_VLLM_VERSION = (0, 10, 0)  # V1 engine + LLM.collective_rpc with callables (the hooks path)
TESTED_VLLM_VERSION = "0.32.0"
EXAMPLE_CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"

# What each path relies on: {module: [attribute or Class.attribute, ...]}.
COMMON_API: dict[str, list[str]] = {
    "vllm": ["__version__", "LLM", "SamplingParams", "LLM.generate"],
    "vllm.inputs": ["TokensPrompt"],
}
NATIVE_API: dict[str, list[str]] = {
    "vllm.v1.spec_decode.extract_hidden_states": ["ExtractHiddenStatesProposer"],
    "vllm.model_executor.models.extract_hidden_states": ["CacheOnlyAttentionLayer"],
    "vllm.model_executor.models.interfaces": ["EagleModelMixin._maybe_add_hidden_state"],
    "vllm.config.kv_transfer": ["KVTransferConfig.kv_connector_module_path", "KVTransferConfig.get_from_extra_config"],
    "vllm.distributed.kv_transfer.kv_connector.v1.base": [
        "KVConnectorBase_V1.has_connector_metadata", "KVConnectorBase_V1._get_connector_metadata"],
    EXAMPLE_CONNECTOR_MODULE: [
        "ExampleHiddenStatesConnector",
        "ExampleHiddenStatesConnector.request_finished",
        "ExampleHiddenStatesConnector.build_connector_meta",
        "ExampleHiddenStatesConnector.register_kv_caches",
        "ExampleHiddenStatesConnector.get_finished",
        "ExampleHiddenStatesConnectorMetadata.pending_saves",
        "PendingSave.req_id",
        "PendingSave.filename",
        "PendingSave.token_ids",
        "PendingSave.block_ids",
        "extract_from_kv_cache",
    ],
}
HOOKS_API: dict[str, list[str]] = {
    "vllm": ["LLM.collective_rpc"],
    "vllm.distributed.parallel_state": ["get_tensor_model_parallel_rank"],
}


@dataclass
class VllmProbe:
    """What `probe_vllm` found: the version and, per capture path, the missing names."""

    version: str
    missing_common: list[str] = field(default_factory=list)
    missing_native: list[str] = field(default_factory=list)
    missing_hooks: list[str] = field(default_factory=list)

    @property
    def path(self) -> str | None:
        """The capture path to use: 'native' if complete, else 'hooks' if complete, else None."""
        if self.missing_common:
            return None
        if not self.missing_native:
            return "native"
        return None if self.missing_hooks else "hooks"


def parse_version(v: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string, dev and local suffixes ignored ('0.33.1.dev12+g..')."""
    parts = []
    for p in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit()) if not p.isdigit() else p
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _missing(api: dict[str, list[str]], importer: Callable[[str], Any]) -> list[str]:
    """Names in `api` that `importer` cannot resolve, as 'module:Class.attr' strings."""
    out = []
    for mod_name, names in api.items():
        try:
            mod = importer(mod_name)
        except Exception:  # noqa: BLE001 - any import failure means "missing"
            out.append(f"module {mod_name}")
            continue
        for name in names:
            obj = mod
            for part in name.split("."):
                if obj is None:
                    break
                # dataclass fields and pydantic config fields are not class attributes
                fields = getattr(obj, "__dataclass_fields__", None) or getattr(obj, "model_fields", None) or {}
                obj = fields[part] if isinstance(fields, dict) and part in fields else getattr(obj, part, None)
            if obj is None:
                out.append(f"{mod_name}:{name}")
    return out


def probe_vllm(importer: Callable[[str], Any] = importlib.import_module, path: str = "auto") -> VllmProbe:
    """Check the installed vLLM for every class/attribute this engine uses; raise EyasError if unusable.

    `importer(name)` returns a module (a test may pass one returning stand-in objects to check
    the probe's logic). `path` is 'auto', 'native' or 'hooks'.
    """
    try:
        vllm = importer("vllm")
    except Exception as e:  # noqa: BLE001
        raise EyasError(f"the vllm engine needs vLLM, which cannot be imported here ({type(e).__name__}: {e}). "
                        "Install it (on this CPU machine: bash scripts/setup_vllm_venv.sh) or use --engine hf.") from e
    version = str(getattr(vllm, "__version__", "") or "")
    parsed = parse_version(version)
    if not parsed or parsed < MIN_VLLM_VERSION:
        raise EyasError(f"vLLM {version or '(no __version__)'} is too old or unrecognised for the vllm engine: "
                        f"eyas needs vLLM >= {'.'.join(map(str, MIN_VLLM_VERSION))} (tested with "
                        f"{TESTED_VLLM_VERSION}). Upgrade vLLM or use --engine hf.")
    probe = VllmProbe(version, _missing(COMMON_API, importer), _missing(NATIVE_API, importer),
                      _missing(HOOKS_API, importer))
    if path not in ("auto", "native", "hooks"):
        raise EyasError(f"unknown vllm capture path '{path}'; use auto, native or hooks")
    wanted = probe.path if path == "auto" else path
    missing = probe.missing_common + (probe.missing_native if wanted == "native" else probe.missing_hooks)
    if wanted is None or missing:
        what = (f"the '{path}' capture path needs: {', '.join(missing)}" if path != "auto" else
                f"both capture paths are incomplete; missing for all: {probe.missing_common or 'nothing'}; "
                f"for the native extract_hidden_states path: {probe.missing_native or 'nothing'}; "
                f"for the hooks path: {probe.missing_hooks or 'nothing'}")
        raise EyasError(f"the installed vLLM {version} does not have the API the vllm engine relies on ({what}). "
                        f"eyas is tested with vLLM {TESTED_VLLM_VERSION}: install that version "
                        "(bash scripts/setup_vllm_venv.sh) or use --engine hf.")
    return probe


def supports_eagle3(cfg: dict) -> bool | None:
    """Whether vLLM's class for this architecture can output aux hidden states (None: unknown)."""
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_eagle3 as has_eagle3_interface

        for arch in cfg.get("architectures") or []:
            cls = ModelRegistry._try_load_model_cls(arch)
            if cls is not None:
                return bool(has_eagle3_interface(cls))
    except Exception:  # noqa: BLE001 - a registry change only loses the early choice
        return None
    return None
