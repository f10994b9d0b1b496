"""Export a draft for serving with vLLM, SGLang or vLLM's speculators format; or import a foreign EAGLE-3 draft.
A DFlash draft is written for vLLM and SGLang only.

Each export folder holds config.json, model.safetensors and a README.md with the exact serve
command. `--format all` writes one sub-folder per layout. With `--import`, DRAFT may be any EAGLE-3
checkpoint (EAGLE, SpecForge/SGLang, vLLM, speculators) and is written to --out in eyas' own layout,
to evaluate it or continue training. A second run with the same inputs and options does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import typer

import eyas
from eyas.assets import TARGET_FORMS, resolve_model, serving_name
from eyas.export.families import export_draft, family_writer
from eyas.export.writers import EXPORT_FORMAT, ServeOptions
from eyas.model.checkpoints import import_draft
from eyas.model.layouts import FORMATS
from eyas.utils.io import EyasError, check_output, fingerprint_path, has_manifest, read_json, sha256_json
from eyas.utils.resume import up_to_date
from eyas.utils.schema import cli_command, option


@dataclass(kw_only=True)
class ExportOptions:
    """`eyas export`'s options: the command line and the `export:` section of an `eyas run` config."""

    draft: Path = option(help="Draft checkpoint folder: eyas' layout (OUT/draft, or a training checkpoint "
                         "OUT/train_state/step-N), or any EAGLE-3 layout eyas reads.")
    format: Literal["vllm", "sglang", "speculators", "all"] = option("vllm", short="-f", help="Serving layout; all "
                                                                      "writes one sub-folder per layout.")
    out: Path = option(short="-o", help="Output folder (with --format all, one sub-folder per format).")
    verifier: str | None = option(None, show_default="the target recorded at training",
                                  help="The target as the serving engine should load it: a hub id or folder is "
                                  "written as given, the alias smollm2 or a GGUF file as its converted folder.")
    model: str | None = option(None, show_default="none", help=f"Target: {TARGET_FORMS}. The draft is checked "
                               "against it; it supplies an embedding or layer count a foreign checkpoint lacks.")
    dtype: Literal["bfloat16", "float16", "float32"] = option("bfloat16", help="Floating-point weights' dtype.")
    num_speculative_tokens: int = option(0, short="-k", show_default="0: 3 for EAGLE-3, block size - 1 for DFlash",
                                         help="Draft tokens per step written in configs and README.")
    embedding: bool = option(True, help="Include the embedding (without it the engine uses the target's).")
    import_: bool = option(False, flag="--import", help="Import DRAFT (EAGLE, SpecForge, SGLang, vLLM, speculators) "
                           "into eyas' own layout at --out instead of exporting.")
    layout: Literal["auto", "eyas", "vllm", "speculators", "sglang", "eagle"] = option(
        "auto", help="Layout of DRAFT.")
    aux_layer_ids: list[int] | None = option(None, comma=True, flag="--aux-layers",
                                             show_default="from the checkpoint",
                                             help="The aux layers of a checkpoint that names none (EAGLE's own), "
                                                  "e.g. 2,15,27 (input of decoder layer k). Ids that disagree with "
                                                  "the checkpoint's are refused: they relabel the draft's layers.")
    force_aux_layers: bool = option(False, help="Let --aux-layers replace the checkpoint's own aux ids (when those "
                                    "are known to be wrong).")

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise EyasError(f"--num-speculative-tokens must be >= 1 (0: the draft family's default), got "
                            f"{self.num_speculative_tokens}")


def _read_draft(opts: ExportOptions, log: Any = print) -> Any:
    """DRAFT read (and checked against --model, resolved as every target is)."""
    target = resolve_model(opts.model) if opts.model else None
    return import_draft(opts.draft, target=target, aux_layer_ids=opts.aux_layer_ids, layout=opts.layout,
                        force_aux_layer_ids=opts.force_aux_layers, log=log)


def run_export(opts: ExportOptions, log: Any = print) -> list[Path]:
    """Export the draft in `opts.format` (or all) under `opts.out`; returns the folders written or reused."""
    draft, out = Path(opts.draft), Path(opts.out)
    formats = list(FORMATS) if opts.format == "all" else [opts.format]
    check_export_folders(out, formats if opts.format == "all" else None)
    model = _read_draft(opts, log)
    k = opts.num_speculative_tokens or family_writer(model.config).default_k(model.config)
    recorded = opts.verifier or getattr(model.config, "target", None)
    verifier = serving_name(str(recorded)) if recorded else None
    serve = ServeOptions(verifier=verifier, dtype=opts.dtype, num_speculative_tokens=k,
                         include_embedding=opts.embedding)
    fingerprint = fingerprint_path(draft)
    written = []
    for f in formats:
        dest = out / f if opts.format == "all" else out
        options = {"draft": fingerprint, "format": f, "verifier": verifier,
                   "target": str(opts.model) if opts.model else None, "dtype": opts.dtype,
                   "num_speculative_tokens": k, "include_embedding": opts.embedding,
                   "layout": opts.layout, "aux_layer_ids": opts.aux_layer_ids, "eyas_version": eyas.__version__}
        options_sha256 = sha256_json(options)
        if up_to_date(dest / "manifest.json", options_sha256, dest / "config.json", dest / "model.safetensors"):
            log(f"{f}: {dest} is up to date")
            written.append(dest)
            continue
        manifest = {"format": EXPORT_FORMAT, "engine": f, "draft": str(draft.absolute()),
                    "draft_sha256": fingerprint, "options": options, "options_sha256": options_sha256}
        try:
            export_draft(model, dest, f, serve, manifest=manifest)
        except EyasError as e:
            if opts.format != "all":
                raise
            log(f"{f}: skipped: {e}")
            continue
        log(f"{f}: wrote {dest} (serve command in {dest / 'README.md'})")
        written.append(dest)
    if not written:
        raise EyasError(f"no format could be exported from {draft}")
    return written


def check_export_folders(out: Path, formats: list[str] | None) -> None:
    """Refuse, before any work, an --out that export must not replace: each format's folder must be missing,
    empty or an earlier export; with --format all (`formats`), so must OUT, the folder holding them."""
    def export(p: Path) -> bool:
        return has_manifest(p / "manifest.json", EXPORT_FORMAT)

    check_output(out, "export", export if formats is None else lambda p: any(export(p / f) for f in formats))
    for f in formats or []:
        check_output(out / f, "export", export)


def _is_draft_folder(path: Path) -> bool:
    """An eyas draft checkpoint (what `--import` writes): its config and weights."""
    try:
        config = read_json(path / "config.json")
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "draft_vocab_size" in config and (path / "model.safetensors").is_file()


def run_import(opts: ExportOptions, log: Any = print) -> Path:
    """Read a foreign EAGLE-3 checkpoint and write it to `opts.out` in eyas' own layout (contract 3)."""
    check_output(opts.out, "export", _is_draft_folder)
    model = _read_draft(opts, log)
    model.save_pretrained(opts.out)
    cfg = model.config
    log(f"imported {opts.draft} -> {opts.out}: hidden {cfg.hidden_size}, draft vocab {cfg.draft_vocab_size}/"
        f"{cfg.vocab_size}, aux layers {cfg.aux_layer_ids} (input of decoder layer k)")
    return Path(opts.out)


def _command(opts: ExportOptions) -> None:
    (run_import if opts.import_ else run_export)(opts, log=typer.echo)


cli = cli_command(ExportOptions, _command)
