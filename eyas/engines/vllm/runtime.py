"""Running vLLM in this process: what hidden-state capture, generation and eval share.

`import_vllm` fails with an error that names the option needing vLLM; `run_llm` starts one engine,
runs the work and tears it down before the next starts; the rest cleans up after vLLM-CPU.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from eyas.utils.io import EyasError


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
    vllm = import_vllm("vllm.LLM", "install it (bash scripts/setup_vllm_venv.sh)")
    try:
        llm = vllm.LLM(**kwargs)
    except Exception as e:
        plain = explain_start_error(e, str(kwargs.get("model", "the target")))
        if plain is None:
            raise
        raise plain from e
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


def explain_start_error(e: BaseException, model: str) -> EyasError | None:
    """What a known vLLM start-up failure means and what to do, as one error; None for any other."""
    text = f"{type(e).__name__}: {e}"
    if "preprocessor_config.json" in text:
        return EyasError(f"vLLM cannot start '{model}': it has no preprocessor_config.json, which vLLM reads for a "
                         "target with a vision tower (even for text). Copy the processor files (preprocessor_config"
                         ".json, processor_config.json) from the original model folder next to its config.json")
    if "torchvision" in text:
        return EyasError(f"vLLM cannot start '{model}': its image processor needs torchvision, which is not installed "
                         "in vLLM's Python environment. Install the torchvision build that matches its torch")
    if "media_placeholder_token_id" in text:
        return EyasError(f"vLLM cannot serve a draft beside '{model}': its config.json has no "
                         "media_placeholder_token_id, which vLLM reads for a Kimi target's image placeholder. Add "
                         '"media_placeholder_token_id": <the id of <|media_pad|> in its tokenizer> to it')
    if "kv cache" in text.lower() and ("memory" in text.lower() or "VLLM_CPU_KVCACHE_SPACE" in text):
        return EyasError(f"vLLM cannot allocate its KV cache for '{model}' ({str(e).strip().splitlines()[0][:200]}). "
                         "Give it less: --kv-cache-gib N on `eyas extract`, or set VLLM_CPU_KVCACHE_SPACE (GiB) on a "
                         "CPU; or free memory")
    return None


def cpu_shm_idents() -> set[str]:
    """Instance ids of vLLM-CPU's tensor-parallel shared-memory segments now in /dev/shm.

    vLLM-CPU does not unlink them at shutdown: take the ids before and after starting an engine,
    and `unlink_cpu_shm` the new ones when it closes.
    """
    shm = Path("/dev/shm")
    return {f.name.split("-")[0] for f in shm.glob("vllm_dist_*-cpushm*")} if shm.is_dir() else set()


def unlink_cpu_shm(idents: Iterable[str]) -> None:
    """Remove the shared-memory segments of these vLLM-CPU instances (best effort)."""
    for ident in idents:
        for f in Path("/dev/shm").glob(f"{ident}-*-cpushm*"):
            with contextlib.suppress(OSError):
                f.unlink()


def default_tmp_root() -> str | None:
    """Where to put files vLLM workers hand over: /dev/shm (memory) when writable, else the system temp."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
