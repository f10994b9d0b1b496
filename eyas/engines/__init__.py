"""Target engines: run the target model and capture the hidden states EAGLE-3 learns from."""

from __future__ import annotations

from typing import Any

from eyas.engines.base import Capture, FlatCapture, TargetEngine, group_batches
from eyas.engines.head import TargetHead
from eyas.utils.io import EyasError

ENGINES = ("hf", "vllm")


def load_engine(
    kind: str,
    model: Any,
    aux_layer_ids: list[int] | None = None,
    dtype: str = "auto",
    device: str | None = "auto",
    tp: int = 1,
    **kwargs: Any,
) -> TargetEngine:
    """Build a target engine. `hf` (default) runs transformers in this process; `vllm` is imported
    only when asked for, so eyas works without vLLM installed. Extra kwargs go to the engine
    (hf: device_map, attn_implementation, trust_remote_code)."""
    if kind == "hf":
        from eyas.engines.hf import HFEngine

        if tp != 1:
            raise EyasError("the hf engine does not do tensor parallelism: use --engine vllm --tp N, or the hf "
                            "engine with device_map='auto' to spread a large target over this node's GPUs")
        return HFEngine(model, aux_layer_ids=aux_layer_ids, dtype=dtype, device=device, **kwargs)
    if kind == "vllm":
        try:
            from eyas.engines.vllm import VllmEngine
        except ImportError as e:
            raise EyasError(f"the vllm engine needs vLLM, which cannot be imported here ({e}). Install vLLM, or "
                            "use --engine hf.") from e
        return VllmEngine(model, aux_layer_ids=aux_layer_ids, dtype=dtype, tp=tp, **kwargs)
    raise EyasError(f"unknown engine '{kind}'; choose one of {', '.join(ENGINES)}")


__all__ = ["Capture", "FlatCapture", "TargetEngine", "TargetHead", "load_engine",
           "group_batches", "ENGINES"]
