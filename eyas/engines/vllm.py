"""The `vllm` engine: hidden states from vLLM, for targets that need tensor parallelism (`--tp N`).

Two capture paths, chosen by probing the installed vLLM at start (`probe_vllm`):

- `native` (preferred): vLLM's own `extract_hidden_states` speculative method. The target model
  (under TP, on every rank) hands the hidden states at the requested layer ids to a cache-only
  "draft" layer, which writes them into a KV-cache block per token; when a request finishes, the
  KV connector reads its blocks. `EyasHiddenStatesConnector` (below) is vLLM's example connector
  with a synchronous, CPU-safe hand-over: TP rank 0 passes the states in memory (tp=1, same
  process) or as one safetensors file per request in a private temp folder (tp>1). Layer id N
  (= num_layers) is the last decoder layer's output before the final norm: that is our `final`.
- `hooks` (fallback): forward hooks on the decoder layers of every worker, installed through
  `LLM.collective_rpc`. vLLM's decoder layers carry the residual stream separately, so a layer's
  input is `hidden + residual`. Used where the native path is missing, and for architectures
  whose vLLM class has no EAGLE-3 aux outputs (Gemma, Phi-3, ...).

Why it is exact: prefix caching is off (a cached prefix is not recomputed, so it would have no
states) and chunked prefill is off (each sequence is one forward pass; `max_num_batched_tokens >=
max_model_len`), generation is one token (prefill only). Every captured sequence is checked:
row count = token count, token ids = the request's, values finite.

vLLM's conventions match eyas': layer id k = input of decoder layer k = transformers'
`hidden_states[k]`. vLLM collects the ids sorted and deduplicated; we ask for the sorted set and
put the columns back in the user's order.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import json
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.engines.base import Capture, TargetEngine, default_aux_layer_ids, validate_aux_layer_ids
from eyas.engines.head import TargetHead
from eyas.utils.io import EyasError

MIN_VLLM_VERSION = (0, 10, 0)  # V1 engine + LLM.collective_rpc with callables (the hooks path)
TESTED_VLLM_VERSION = "0.32.0"
CONNECTOR_NAME = "EyasHiddenStatesConnector"
_EHS = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"

# What each path relies on: {module: [attribute or Class.attribute, ...]}. Checked before any model
# loads, so an incompatible vLLM fails with a list of what is missing instead of wrong states.
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
    _EHS: [
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


# ---------------------------------------------------------------------------------------------
# Probe: which of the APIs we rely on does the installed vLLM have?
# ---------------------------------------------------------------------------------------------


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


def _parse_version(v: str) -> tuple[int, ...]:
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
    parsed = _parse_version(version)
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


# ---------------------------------------------------------------------------------------------
# Native path: the KV connector (built lazily: this module must import without vLLM)
# ---------------------------------------------------------------------------------------------

_CONNECTOR_CLS: type | None = None
# file name -> tensors, for a connector running in the engine's own process (tp=1): no file I/O
_HANDOFF: dict[str, dict[str, torch.Tensor]] = {}


def _connector_class() -> type:
    """EyasHiddenStatesConnector: vLLM's example hidden-states connector, written synchronously.

    The example copies GPU->pinned memory on a CUDA stream and writes from a thread pool; that
    needs CUDA. Here TP rank 0 gathers the request's rows from the hidden-state KV blocks and hands
    `hidden_states [T, n, H]` + `token_ids [T]` over before the step returns: in memory when it
    runs in the engine's process (tp=1), else as a safetensors file (temp name + rename). Then it
    reports the request as sent so vLLM frees its blocks. The scheduler side (file names, which
    blocks, when) is vLLM's own.
    """
    global _CONNECTOR_CLS
    if _CONNECTOR_CLS is not None:
        return _CONNECTOR_CLS
    from safetensors.torch import save_file

    ehs = importlib.import_module(_EHS)

    class EyasHiddenStatesConnector(ehs.ExampleHiddenStatesConnector):
        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            super().register_kv_caches(kv_caches)
            # instance state of vLLM's example connector that _write/get_finished use
            need = ("_kv_cache", "_block_size", "_is_tp_rank_zero", "_accumulated_finished_req_ids",
                    "_kv_transfer_config")
            missing = [a for a in need if not hasattr(self, a)]
            if missing:
                raise RuntimeError(f"eyas: vLLM's ExampleHiddenStatesConnector lacks {missing}; the native "
                                   f"capture path needs vLLM {TESTED_VLLM_VERSION}-like internals. Use "
                                   "capture_path='hooks' or --engine hf.")

        def wait_for_save(self) -> None:
            pass  # no lock files: eyas reads only after the step that wrote them returned

        def _write(self, pending: Any) -> None:
            if not self._is_tp_rank_zero:
                return
            block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()  # [blocks*bs]
            slots = slots.to(self._kv_cache.device)
            n = int(pending.token_ids.shape[0])
            hidden = ehs.extract_from_kv_cache(self._kv_cache, slots, n)  # [T, n_layers, H]
            tensors = {"hidden_states": hidden.cpu().contiguous(),
                       "token_ids": pending.token_ids.to(torch.int64).contiguous()}
            if self._kv_transfer_config.get_from_extra_config("eyas_pid", None) == os.getpid():
                _HANDOFF[pending.filename] = tensors
                return
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            tmp = pending.filename + ".tmp"
            save_file(tensors, tmp)
            os.replace(tmp, pending.filename)

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            if not self._is_tp_rank_zero:
                return None, None  # one report per request (get_finished_count() == 1): rank 0's
            if not hasattr(self, "_eyas_written"):
                self._eyas_written: set[str] = set()
            if self.has_connector_metadata():
                meta = self._get_connector_metadata()
                for pending in getattr(meta, "pending_saves", []):
                    self._write(pending)
                    self._eyas_written.add(pending.req_id)
            self._accumulated_finished_req_ids.update(finished_req_ids)
            done = self._eyas_written & self._accumulated_finished_req_ids
            self._eyas_written -= done
            self._accumulated_finished_req_ids -= done
            return done or None, None

    EyasHiddenStatesConnector.__name__ = EyasHiddenStatesConnector.__qualname__ = CONNECTOR_NAME
    EyasHiddenStatesConnector.__module__ = __name__
    _CONNECTOR_CLS = EyasHiddenStatesConnector
    return _CONNECTOR_CLS


def __getattr__(name: str) -> Any:
    # vLLM loads the connector with getattr(import_module("eyas.engines.vllm"), CONNECTOR_NAME)
    if name == CONNECTOR_NAME:
        return _connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# Hooks path: functions that run inside each vLLM worker (sent by collective_rpc)
# ---------------------------------------------------------------------------------------------


def _worker_decoder(worker: Any, num_layers: int) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    model = worker.model_runner.get_model() if hasattr(worker.model_runner, "get_model") else worker.model_runner.model
    for _, mod in model.named_modules():
        layers = getattr(mod, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers:
            return mod, layers
    raise RuntimeError(f"eyas: no module with {num_layers} decoder layers in {type(model).__name__}")


def _rpc_install_hooks(worker: Any, layer_ids: list[int], num_layers: int) -> bool:
    """Hook the decoder: embedding pre-hook (token ids), layer k pre-hook (its input; layer 0 also
    opens the forward's record with the positions), last layer hook (its output = id num_layers)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    for h in getattr(worker, "_eyas_hooks", []):
        h.remove()
    worker._eyas_records = []
    worker._eyas_hooks = []
    if get_tensor_model_parallel_rank() != 0:
        return True  # every rank holds the full (all-reduced) hidden states; rank 0 reports them
    inner, layers = _worker_decoder(worker, num_layers)
    # the layer API the hooks read: forward(positions, hidden_states, residual, ...) -> (hidden, residual)
    params = list(inspect.signature(layers[0].forward).parameters)
    if params[:2] != ["positions", "hidden_states"] or "residual" not in params:
        raise RuntimeError(f"eyas: {type(layers[0]).__name__}.forward{tuple(params)} is not the "
                           "(positions, hidden_states, residual) decoder-layer API the hooks path reads")

    def total(hidden: torch.Tensor, residual: Any) -> torch.Tensor:
        # vLLM layers pass (hidden, residual) separately; the residual stream is their sum
        return (hidden + residual if isinstance(residual, torch.Tensor) else hidden).detach().to("cpu", copy=True)

    # vLLM's compiled-model decorator calls the decoder's forward directly (module hooks on it never
    # fire), so the token ids come from the embedding and a record opens at layer 0.
    embed = getattr(inner, "embed_tokens", None)
    if not isinstance(embed, torch.nn.Module):
        raise RuntimeError(f"eyas: {type(inner).__name__} has no embed_tokens module to read token ids from")

    def on_embed(_m: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        worker._eyas_ids = ids.detach().to("cpu", copy=True)

    def pre(k: int) -> Callable:
        def hook(_m: Any, args: tuple, kwargs: dict) -> None:
            if k == 0:
                pos = kwargs.get("positions", args[0] if args else None)
                worker._eyas_records.append({"input_ids": worker._eyas_ids, "positions": pos.detach().to("cpu", copy=True)})
            hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
            residual = kwargs.get("residual", args[2] if len(args) > 2 else None)
            if k in wanted:
                worker._eyas_records[-1][k] = total(hidden, residual)
        return hook

    def post(_m: Any, _args: tuple, _kwargs: dict, out: Any) -> None:
        hidden, residual = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
        worker._eyas_records[-1][num_layers] = total(hidden, residual)

    wanted = set(layer_ids)
    worker._eyas_hooks.append(embed.register_forward_pre_hook(on_embed, with_kwargs=True))
    for k in sorted(wanted | {0}):
        if k < num_layers:
            worker._eyas_hooks.append(layers[k].register_forward_pre_hook(pre(k), with_kwargs=True))
    worker._eyas_hooks.append(layers[num_layers - 1].register_forward_hook(post, with_kwargs=True))
    return True


def _rpc_take_records(worker: Any) -> list[dict] | None:
    records = getattr(worker, "_eyas_records", None)
    worker._eyas_records = []
    return records if getattr(worker, "_eyas_hooks", None) else None


def _rpc_remove_hooks(worker: Any) -> bool:
    for h in getattr(worker, "_eyas_hooks", []):
        h.remove()
    worker._eyas_hooks = []
    worker._eyas_records = []
    return True


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


_DTYPE_ALIASES = {"auto": "bfloat16", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
_HF_ONLY_OPTIONS = {"device", "device_map", "attn_implementation"}  # accepted and ignored
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _supports_eagle3(cfg: dict) -> bool | None:
    """Whether vLLM's class for this architecture can output aux hidden states (None: unknown)."""
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_eagle3

        for arch in cfg.get("architectures") or []:
            cls = ModelRegistry._try_load_model_cls(arch)
            if cls is not None:
                return bool(supports_eagle3(cls))
    except Exception:  # noqa: BLE001 - a registry change only loses the early choice
        return None
    return None


def _cpu_shm_idents() -> set[str]:
    """Instance ids of vLLM-CPU's tensor-parallel shared-memory segments now in /dev/shm."""
    shm = Path("/dev/shm")
    return {f.name.split("-")[0] for f in shm.glob("vllm_dist_*-cpushm*")} if shm.is_dir() else set()


def _default_tmp_root() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def import_vllm(what: str, instead: str) -> Any:
    """The vllm module, or a clear error naming the option that needs it and the alternative."""
    try:
        import vllm
    except ImportError as e:
        raise EyasError(f"{what} needs vLLM in this Python environment ({e}). Install vllm, or {instead}.") from e
    return vllm


def llm_kwargs(model: str, seed: int, max_model_len: int, **extra: Any) -> dict[str, Any]:
    """`vllm.LLM` arguments for generating with a target: most of a GPU's memory, or on a CPU
    (vllm-cpu) eager float32 with a small KV cache."""
    import torch

    kwargs: dict[str, Any] = {"model": model, "seed": seed, "max_model_len": max_model_len}
    kwargs.update({"gpu_memory_utilization": 0.6} if torch.cuda.is_available() else
                  {"enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": 64 << 20})
    return {**kwargs, **extra}


def run_llm(kwargs: dict[str, Any], work: Callable[[Any], None]) -> None:
    """Start an in-process vLLM engine, run `work(llm)`, and tear it down before the next one starts.

    No caller may keep a reference to the engine: an old engine collected after a new one started
    would tear down the new one's process groups.
    """
    llm = import_vllm("vllm.LLM", "use the hf engine").LLM(**kwargs)
    try:
        work(llm)
    finally:
        del llm
        gc.collect()
        try:
            from vllm.distributed import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except ImportError:
            pass


class VllmEngine(TargetEngine):
    """Prefill-only hidden-state capture with vLLM (tensor parallel with `tp > 1`).

    Extra options: `max_model_len` (longest sequence + 1; default min(4096, the model's)), `max_num_batched_tokens`
    (tokens per forward step; >= max_model_len), `max_num_seqs`, `kv_cache_memory_bytes` or
    `gpu_memory_utilization`, `capture_path` ('auto' | 'native' | 'hooks'), `llm_kwargs` (any
    other `vllm.LLM` argument).
    """

    name = "vllm"

    def __init__(
        self,
        model: str,
        aux_layer_ids: list[int] | None = None,
        dtype: str = "auto",
        tp: int = 1,
        *,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        capture_path: str = "auto",
        seed: int = 0,
        trust_remote_code: bool = False,
        llm_kwargs: dict[str, Any] | None = None,
        **hf_only: Any,
    ) -> None:
        unknown = sorted(set(hf_only) - _HF_ONLY_OPTIONS)
        if unknown:
            raise EyasError(f"unknown vllm engine option(s) {unknown}; pass other vllm.LLM arguments in llm_kwargs")
        self.probe = probe_vllm(path=capture_path)
        self.path = self.probe.path if capture_path == "auto" else capture_path
        self.model_dir = self._local_dir(model)
        cfg = self._read_config(self.model_dir)
        if capture_path == "auto" and self.path == "native" and _supports_eagle3(cfg) is False:
            # vLLM hands aux states only to models with its EAGLE-3 interface (not Gemma, Phi-3, ...)
            self.path = "hooks" if not self.probe.missing_hooks else self.path
        text = cfg.get("text_config") or cfg
        self.num_layers = int(text["num_hidden_layers"])
        self.hidden_size = int(text["hidden_size"])
        self.vocab_size = int(text["vocab_size"])
        ids = default_aux_layer_ids(self.num_layers) if aux_layer_ids is None else list(aux_layer_ids)
        self.aux_layer_ids = validate_aux_layer_ids(ids, self.num_layers)
        # what vLLM captures: the sorted, unique ids, plus num_layers (the last layer's output = final)
        self._layer_ids = sorted(set(self.aux_layer_ids) | {self.num_layers})
        self._aux_cols = [self._layer_ids.index(k) for k in self.aux_layer_ids]
        self._final_col = self._layer_ids.index(self.num_layers)
        self.max_model_len = int(max_model_len or min(4096, int(text.get("max_position_embeddings") or 4096)))
        self.dtype = _DTYPE_ALIASES.get(str(dtype), str(dtype))

        # The extra step that flushes finished requests' states (see _drain) needs the engine core
        # in this process; TP workers still run in their own processes.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self._tmp = tempfile.mkdtemp(prefix="eyas-vllm-", dir=_default_tmp_root())
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._tmp, True)
        kwargs: dict[str, Any] = dict(
            model=str(model), dtype=self.dtype, tensor_parallel_size=int(tp), enforce_eager=True,
            enable_prefix_caching=False, enable_chunked_prefill=False, max_model_len=self.max_model_len,
            max_num_batched_tokens=max(int(max_num_batched_tokens or 0), self.max_model_len),
            max_num_seqs=int(max_num_seqs), seed=seed, trust_remote_code=trust_remote_code,
            # token ids in, states out: the tokenizer is only loaded when the folder has one
            skip_tokenizer_init=not any((self.model_dir / f).is_file() for f in _TOKENIZER_FILES),
        )
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        if self.path == "native":
            kwargs["speculative_config"] = {
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self._layer_ids}},
            }
            kwargs["kv_transfer_config"] = {
                "kv_connector": CONNECTOR_NAME, "kv_connector_module_path": __name__, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self._tmp, "eyas_pid": os.getpid()},
            }
        kwargs.update(llm_kwargs or {})
        from vllm import LLM, SamplingParams

        shm_before = _cpu_shm_idents()
        self.llm = LLM(**kwargs)
        # vLLM-CPU's TP shared-memory segments are not unlinked at shutdown: remember ours
        self._shm_idents = _cpu_shm_idents() - shm_before
        self._sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        try:
            self._check_model_config(self.llm.llm_engine.model_config)
            self._check_effective_config(self.llm.llm_engine.vllm_config)
            if self.path == "hooks":
                self.llm.collective_rpc(_rpc_install_hooks, args=(self._layer_ids, self.num_layers))
        except BaseException as e:
            self.close()
            if "eyas:" in str(e):
                raise EyasError(f"vllm engine, hooks path: {e}. Use --engine hf for this target.") from e
            raise

    # -- setup helpers -------------------------------------------------------------------------

    @staticmethod
    def _local_dir(model: str) -> Path:
        p = Path(model)
        if p.is_dir():
            return p
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors"]))
        except Exception as e:  # noqa: BLE001
            raise EyasError(f"target '{model}' is not a folder and could not be fetched from the hub ({e}); "
                            "pass a local folder with config.json and *.safetensors") from e

    @staticmethod
    def _read_config(d: Path) -> dict:
        f = d / "config.json"
        if not f.is_file():
            raise EyasError(f"{f}: not found; the vllm engine needs a transformers model folder (config.json + "
                            "*.safetensors)")
        return json.loads(f.read_text())

    def _check_model_config(self, mc: Any) -> None:
        """vLLM's view of the model must match the config we planned the layer ids with."""
        got = (mc.get_total_num_hidden_layers(), mc.get_hidden_size(), mc.get_vocab_size())
        want = (self.num_layers, self.hidden_size, self.vocab_size)
        if tuple(got) != want:
            raise EyasError(f"vLLM sees (layers, hidden, vocab) = {got} for {self.model_dir} but its config.json "
                            f"says {want}; eyas cannot map layer ids. Use --engine hf for this target.")

    def _check_effective_config(self, vc: Any) -> None:
        """What vLLM actually runs with (platforms and llm_kwargs may change our settings)."""
        bad = []
        if getattr(vc.cache_config, "enable_prefix_caching", False):
            bad.append("prefix caching is on (a cached prefix is not recomputed, so it has no fresh states)")
        sc = vc.scheduler_config
        if getattr(sc, "enable_chunked_prefill", False) or sc.max_num_batched_tokens < vc.model_config.max_model_len:
            bad.append("chunked prefill is on (a sequence may be split over several forward passes)")
        if bad:
            raise EyasError(f"vllm engine: {'; '.join(bad)}. eyas turns both off; remove the llm_kwargs that "
                            "enable them, or use --engine hf.")

    # -- capture -------------------------------------------------------------------------------

    def capture(self, seqs: list[torch.Tensor]) -> list[Capture]:
        if not seqs:
            return []
        token_lists = [torch.as_tensor(s).flatten().tolist() for s in seqs]
        for i, toks in enumerate(token_lists):
            if not toks:
                raise EyasError(f"sequence {i} of the batch is empty; drop empty samples before extraction")
            if len(toks) >= self.max_model_len:
                raise EyasError(f"sequence {i} has {len(toks)} tokens but the vllm engine was started with "
                                f"max_model_len={self.max_model_len} (longest sequence + 1); raise it")
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=t) for t in token_lists]
        outs = self.llm.generate(prompts, self._sampling, use_tqdm=False)
        if len(outs) != len(seqs):
            raise EyasError(f"vLLM returned {len(outs)} results for {len(seqs)} sequences")
        if self.path == "native":
            states = self._collect_native(outs)
        else:
            states = self._collect_hooks(token_lists)
        caps = []
        for i, (toks, (got_ids, hs)) in enumerate(zip(token_lists, states, strict=True)):
            self._check(i, toks, got_ids, hs)
            aux = hs[:, self._aux_cols].reshape(len(toks), -1)  # [T, k*H] in aux_layer_ids order
            caps.append(Capture(aux=aux, final=hs[:, self._final_col].contiguous()))
        return caps

    def _check(self, i: int, toks: list[int], got_ids: torch.Tensor, hs: torch.Tensor) -> None:
        """Every sequence: as many rows as tokens, the same token ids, finite values; else stop."""
        n, want = len(toks), (len(toks), len(self._layer_ids), self.hidden_size)
        problem = None
        if tuple(hs.shape) != want:
            problem = f"states of shape {tuple(hs.shape)}, expected {want}"
        elif got_ids.numel() != n or not torch.equal(got_ids.flatten().long(), torch.tensor(toks, dtype=torch.long)):
            problem = "token ids that differ from the request"
        elif not torch.isfinite(hs).all():
            problem = "non-finite values (inf/nan)"
        if problem:
            raise EyasError(f"vllm engine ({self.path} path, vLLM {self.probe.version}): sequence {i} ({n} tokens) "
                            f"came back with {problem}. The states would be wrong, so extraction stops; try "
                            f"capture_path='hooks'/'native', vLLM {TESTED_VLLM_VERSION}, or --engine hf.")

    def _drain(self, paths: list[str]) -> None:
        """Step the engine until every finished request's file is written.

        A request's states are handed to the connector on the scheduler step *after* it finished,
        which `generate` does not run (it stops when all outputs are in).
        """
        for _ in range(16):
            if all(p in _HANDOFF or os.path.exists(p) for p in paths):
                return
            self.llm.llm_engine.step()
        missing = [p for p in paths if p not in _HANDOFF and not os.path.exists(p)]
        raise EyasError(f"vLLM did not write the hidden states of {len(missing)} request(s) (e.g. {missing[0]}); "
                        f"its KV-connector flow differs from the tested vLLM {TESTED_VLLM_VERSION}. Use "
                        "capture_path='hooks' or --engine hf.")

    def _collect_native(self, outs: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from safetensors.torch import load_file

        paths = []
        for o in outs:
            params = getattr(o, "kv_transfer_params", None) or {}
            paths.append(params.get("hidden_states_path") or os.path.join(self._tmp, f"{o.request_id}.safetensors"))
        self._drain(paths)
        result = []
        for p in paths:
            data = _HANDOFF.pop(p, None)
            if data is None:
                data = load_file(p)
                os.remove(p)
            result.append((data["token_ids"], data["hidden_states"]))  # [T], [T, n, H]
        return result

    def _collect_hooks(self, token_lists: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        records = next((r for r in self.llm.collective_rpc(_rpc_take_records) if r is not None), None)
        if records is None:
            raise EyasError("vllm engine (hooks path): no worker reported captured states; the hooks are gone")
        # Each forward step holds whole sequences (no chunked prefill) laid end to end; a sequence
        # starts where positions restart at 0. Match them to requests by their token ids.
        segments: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for rec in records:
            pos, ids = rec["positions"].flatten(), rec["input_ids"].flatten()
            if any(k not in rec for k in self._layer_ids):
                continue
            stacked = torch.stack([rec[k] for k in self._layer_ids], dim=1)  # [n_tok, n, H]
            starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                if torch.equal(pos[a:b], torch.arange(b - a, dtype=pos.dtype)):
                    segments.setdefault(tuple(ids[a:b].tolist()), []).append(stacked[a:b])
        result = []
        for toks in token_lists:
            found = segments.get(tuple(toks))
            if not found:
                raise EyasError(f"vllm engine (hooks path, vLLM {self.probe.version}): no forward pass held a "
                                f"{len(toks)}-token sequence whole; chunked prefill or prefix caching may be on "
                                "(eyas turns both off; check llm_kwargs)")
            result.append((torch.tensor(toks), found.pop(0)))
        return result

    # -- head and cleanup ----------------------------------------------------------------------

    def target_head(self) -> TargetHead:
        return read_target_head(self.model_dir)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            if self.path == "hooks":
                with contextlib.suppress(Exception):  # best effort at shutdown
                    llm.collective_rpc(_rpc_remove_hooks)
            self.llm = None
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if hasattr(core, "shutdown"):  # stops TP workers, tears down torch.distributed
                with contextlib.suppress(Exception):
                    core.shutdown()
            del llm
        for ident in getattr(self, "_shm_idents", ()):
            for f in Path("/dev/shm").glob(f"{ident}-*-cpushm*"):
                with contextlib.suppress(OSError):
                    f.unlink()
        self._shm_idents = set()
        for key in [k for k in _HANDOFF if k.startswith(self._tmp)]:  # left by a failed capture
            del _HANDOFF[key]
        self._finalizer()


VLLMEngine = VllmEngine  # the name eyas.engines.load_engine imports


# ---------------------------------------------------------------------------------------------
# The target's head, read straight from its safetensors files (no model build, no vLLM)
# ---------------------------------------------------------------------------------------------


def _pick(keys: list[str], suffix: str) -> str | None:
    """The shortest key ending in `suffix` outside vision/audio towers (text decoder of a wrapper)."""
    cands = [k for k in keys if k.endswith(suffix) and not any(t in k for t in ("vision", "visual", "audio", "mm_"))]
    return min(cands, key=len) if cands else None


def read_target_head(model_dir: str | os.PathLike) -> TargetHead:
    """embed_tokens, final norm (+ eps) and lm_head from `model_dir`'s safetensors (tied embeddings:
    lm_head = embed_tokens). Gemma-style norms (1 + w) and embedding scaling are recorded."""
    from safetensors import safe_open

    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    index = d / "model.safetensors.index.json"
    if index.is_file():
        where = {k: d / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        where = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as sf:
                where.update({k: f for k in sf.keys()})  # noqa: SIM118 - safe_open has no __iter__
    if not where:
        raise EyasError(f"{d}: no *.safetensors weights found; the target head is read from them")
    keys = sorted(where)
    # final norm: '<decoder>.norm.weight', never a layer's norm
    norm_keys = [k for k in keys if k.endswith("norm.weight") and ".layers." not in k and not k.startswith("lm_head")]
    embed_k, head_k = _pick(keys, "embed_tokens.weight"), _pick(keys, "lm_head.weight")
    norm_k = _pick([k for k in norm_keys if k.split(".")[-2] in ("norm", "final_layernorm", "norm_f", "ln_f")],
                   "norm.weight") or _pick(norm_keys, "norm.weight")
    if embed_k is None or norm_k is None:
        raise EyasError(f"{d}: cannot find the token embedding / final norm among the safetensors keys "
                        f"(e.g. {keys[:5]}); use --engine hf for this target")

    def load(k: str) -> torch.Tensor:
        with safe_open(str(where[k]), "pt") as sf:
            return sf.get_tensor(k)

    embed = load(embed_k)
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    if head_k is None and not tied:
        raise EyasError(f"{d}: no lm_head.weight and tie_word_embeddings is false; cannot build the target head")
    lm_head = embed if head_k is None else load(head_k)
    eps = text.get("rms_norm_eps", text.get("layer_norm_eps", text.get("layer_norm_epsilon", 1e-6)))
    gemma = str(text.get("model_type", cfg.get("model_type", ""))).startswith("gemma")
    return TargetHead(embed_tokens=embed, norm_weight=load(norm_k), lm_head=lm_head, norm_eps=float(eps),
                      norm_offset=1.0 if gemma else 0.0,
                      embed_scale=math.sqrt(int(text["hidden_size"])) if gemma else 1.0)
