"""The native path's KV connector: hands the hidden states vLLM wrote into KV blocks back to eyas.

vLLM builds it from `kv_connector_module_path` (this module) and `kv_connector` (CONNECTOR_NAME)
with `getattr(import_module(path), name)`. The class subclasses vLLM's example connector, so it is
built on that first lookup (module `__getattr__`): this module imports without vLLM.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from eyas.engines.vllm.probe import EXAMPLE_CONNECTOR_MODULE, TESTED_VLLM_VERSION

CONNECTOR_NAME = "EyasHiddenStatesConnector"
CONNECTOR_MODULE = __name__
# file name -> tensors, for a connector running in the engine's own process (tp=1): no file I/O.
# The engine pops each request's entry as it collects it.
HANDOFF: dict[str, dict[str, torch.Tensor]] = {}
_CONNECTOR_CLS: type | None = None


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

    ehs = importlib.import_module(EXAMPLE_CONNECTOR_MODULE)

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
                HANDOFF[pending.filename] = tensors
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
    # vLLM loads the connector with getattr(import_module(CONNECTOR_MODULE), CONNECTOR_NAME)
    if name == CONNECTOR_NAME:
        return _connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
