"""Export's family dispatch: the one function that writes a draft folder for serving, with the writer
the draft's family declares. It sits above every writer (eyas.export.writers holds EAGLE-3's and what
the writers share; the others' are in their own modules)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from eyas.export.writers import DTYPES, FamilyWriter, ServeOptions
from eyas.model.config import DraftConfig
from eyas.model.draft import DraftModel
from eyas.model.family_facts import family_part
from eyas.model.layouts import FORMATS
from eyas.utils.io import EyasError, atomic_path, atomic_write_json


def family_writer(cfg: DraftConfig) -> FamilyWriter:
    """The writer the draft's family declares (eyas.model.family_facts)."""
    return family_part(cfg.family, "writer")


def export_draft(draft: DraftModel, out: str | Path, fmt: str, options: ServeOptions | None = None,
                 manifest: dict[str, Any] | None = None) -> Path:
    """Write `draft` as a folder that `fmt` ("vllm", "sglang", "speculators") serves; returns it.

    The folder holds config.json, model.safetensors, a README.md with the exact serve command and,
    when given, `manifest` as manifest.json; it is written atomically (a crash leaves the old folder
    or none).
    """
    options = options or ServeOptions()
    cfg = draft.config
    writer = family_writer(cfg)
    if fmt not in FORMATS:
        raise EyasError(f"unknown export format {fmt!r}: choose one of {', '.join(FORMATS)} (or all)")
    if fmt not in writer.configs:
        raise EyasError(f"a {cfg.family} draft is served in the {', '.join(writer.configs)} layout(s), not {fmt}")
    if options.dtype not in DTYPES:
        raise EyasError(f"unknown dtype {options.dtype!r}: choose one of {', '.join(DTYPES)}")
    k = writer.default_k(cfg) if options.num_speculative_tokens is None else options.num_speculative_tokens
    if k < 1:
        raise EyasError(f"num_speculative_tokens must be >= 1, got {k}")
    writer.check(cfg, fmt, k)
    out = Path(out).absolute()
    verifier = options.verifier or cfg.target or None
    config = writer.configs[fmt](cfg, options.dtype, verifier=verifier, num_speculative_tokens=k)
    tensors = writer.tensors(draft, fmt, DTYPES[options.dtype], options.include_embedding)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        atomic_write_json(tmp / "config.json", config)
        # one metadata key (the format is in manifest.json): safetensors orders several in a different way in
        # every process, and the same export would not be the same bytes
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "README.md").write_text(writer.readme(fmt, out, cfg, verifier, k))
        if manifest is not None:
            atomic_write_json(tmp / "manifest.json", manifest)
    return out


def serve_command_in(readme: str) -> str | None:
    """The serve command of an export README (`vllm serve ...` or SGLang's launcher), joined across its `\\`
    continuation lines into one line."""
    lines = readme.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.strip().startswith(("vllm serve", "python -m sglang.launch_server"))), None)
    if start is None:
        return None
    parts = []
    for line in lines[start:]:
        parts.append(line.strip().rstrip("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(parts)
