"""Export a draft for serving with vLLM, SGLang or vLLM's speculators format; or import a foreign EAGLE-3 draft.

Each export folder holds config.json, model.safetensors and a README.md with the exact serve
command. `--format all` writes one sub-folder per engine. With `--import`, DRAFT may be any EAGLE-3
checkpoint (EAGLE, SpecForge/SGLang, vLLM, speculators) and is written to --out in eyas' own layout,
to evaluate it or continue training. A second run with the same inputs and options does nothing.
"""

from __future__ import annotations

from pathlib import Path

import typer

import eyas
from eyas.engines.base import parse_layer_ids
from eyas.export.formats import FORMATS, ExportOptions, export_draft, import_draft
from eyas.utils.io import EyasError, fingerprint_path, read_json, sha256_json


def _up_to_date(out: Path, options_sha256: str) -> bool:
    manifest = out / "manifest.json"
    if not (manifest.is_file() and (out / "config.json").is_file() and (out / "model.safetensors").is_file()):
        return False
    try:
        return read_json(manifest).get("options_sha256") == options_sha256
    except (OSError, ValueError):
        return False


def run_export(draft: str | Path, fmt: str, out: str | Path, verifier: str | None = None,
               target: str | Path | None = None, dtype: str = "bfloat16", num_speculative_tokens: int = 3,
               include_embedding: bool = True, layout: str = "auto",
               aux_layer_ids: list[int] | None = None, log=print) -> list[Path]:
    """Export the draft at `draft` in `fmt` (or "all") under `out`; returns the folders written or reused."""
    draft, out = Path(draft), Path(out)
    formats = list(FORMATS) if fmt == "all" else [fmt]
    if fmt != "all" and fmt not in FORMATS:
        raise EyasError(f"unknown --format {fmt!r}: choose one of {', '.join(FORMATS)} or all")
    model = import_draft(draft, target=target, aux_layer_ids=aux_layer_ids, layout=layout)
    options = ExportOptions(verifier=verifier, dtype=dtype, num_speculative_tokens=num_speculative_tokens,
                            include_embedding=include_embedding)
    fingerprint = fingerprint_path(draft)
    written = []
    for f in formats:
        dest = out / f if fmt == "all" else out
        opts = {"draft": fingerprint, "format": f, "verifier": verifier, "target": str(target) if target else None,
                "dtype": dtype, "num_speculative_tokens": num_speculative_tokens,
                "include_embedding": include_embedding, "layout": layout, "aux_layer_ids": aux_layer_ids,
                "eyas_version": eyas.__version__}
        options_sha256 = sha256_json(opts)
        if _up_to_date(dest, options_sha256):
            log(f"{f}: {dest} is up to date")
            written.append(dest)
            continue
        manifest = {"format": "eyas.export/1", "engine": f, "draft": str(draft.absolute()),
                    "draft_sha256": fingerprint, "options": opts, "options_sha256": options_sha256}
        try:
            export_draft(model, dest, f, options, manifest=manifest)
        except EyasError as e:
            if fmt != "all":
                raise
            log(f"{f}: skipped: {e}")
            continue
        log(f"{f}: wrote {dest} (serve command in {dest / 'README.md'})")
        written.append(dest)
    if not written:
        raise EyasError(f"no format could be exported from {draft}")
    return written


def run_import(src: str | Path, out: str | Path, target: str | Path | None = None, layout: str = "auto",
               aux_layer_ids: list[int] | None = None, log=print) -> Path:
    """Read a foreign EAGLE-3 checkpoint and write it to `out` in eyas' own layout (contract 3)."""
    model = import_draft(src, target=target, aux_layer_ids=aux_layer_ids, layout=layout)
    model.save_pretrained(out)
    cfg = model.config
    log(f"imported {src} -> {out}: hidden {cfg.hidden_size}, draft vocab {cfg.draft_vocab_size}/{cfg.vocab_size}, "
        f"aux layers {cfg.aux_layer_ids} (input of decoder layer k)")
    return Path(out)


def cli(
    draft: Path = typer.Argument(..., help="Draft checkpoint folder: eyas' layout (OUT/draft, or a training "
                              "checkpoint OUT/train_state/step-N), or any EAGLE-3 layout eyas reads."),
    format: str = typer.Option("vllm", "--format", "-f", help="vllm, sglang, speculators or all. Default: vllm."),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder (with --format all, one sub-folder per format)."),
    verifier: str = typer.Option(None, "--verifier", help="The target's HF id or path as the engine should load it. "
                                 "Default: the target recorded at training."),
    target: Path = typer.Option(None, "--target", help="Target model folder: the draft is checked against it; it "
                                "supplies an embedding or layer count a foreign checkpoint lacks. Default: none."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16, float16 or float32 for the weights. "
                              "Default: bfloat16."),
    num_speculative_tokens: int = typer.Option(3, "--num-speculative-tokens", "-k",
                                               help="Draft tokens per step written in configs and README. Default: 3."),
    no_embedding: bool = typer.Option(False, "--no-embedding", help="Leave the embedding out (the engine uses the "
                                      "target's). Default: included."),
    import_: bool = typer.Option(False, "--import", help="Import DRAFT (EAGLE, SpecForge, SGLang, vLLM, speculators) "
                                 "into eyas' own layout at --out instead of exporting."),
    layout: str = typer.Option("auto", "--layout", help="Layout of DRAFT: auto, eyas, vllm, speculators, sglang, "
                               "eagle. Default: auto."),
    aux_layer_ids: str = typer.Option(None, "--aux-layer-ids", help="Override the aux layers, e.g. 2,15,27 (input of "
                                      "decoder layer k). Default: from the checkpoint."),
) -> None:
    ids = parse_layer_ids(aux_layer_ids, "--aux-layer-ids")
    if import_:
        run_import(draft, out, target=target, layout=layout, aux_layer_ids=ids, log=typer.echo)
        return
    run_export(draft, format, out, verifier=verifier, target=target, dtype=dtype,
               num_speculative_tokens=num_speculative_tokens, include_embedding=not no_embedding, layout=layout,
               aux_layer_ids=ids, log=typer.echo)
