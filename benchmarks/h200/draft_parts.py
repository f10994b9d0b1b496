"""Move a draft between machines in files of under 15 MiB (a device call returns at most 8 files of
16 MiB): bf16 weights without the embedding, which is the target's and is put back on arrival.

    python3 draft_parts.py pack RUN/train OUTDIR      # the newest of RUN/train/draft and its checkpoints
    python3 draft_parts.py unpack OUTDIR DRAFT_DIR    # here: a full eyas draft folder, embedding from smollm2
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

LIMIT = 15 * 2**20


def newest_draft(train: Path) -> tuple[Path, Path]:
    """(weights file, config.json) of the finished draft, else of the latest checkpoint."""
    if (train / "draft" / "model.safetensors").is_file():
        return train / "draft" / "model.safetensors", train / "draft" / "config.json"
    ckpts = sorted(p for p in (train / "train_state").glob("step-*") if (p / "config.json").is_file())
    if not ckpts:
        raise SystemExit(f"no draft or checkpoint in {train}")
    return ckpts[-1] / "draft.safetensors", ckpts[-1] / "config.json"


def pack(train: Path, out: Path) -> None:
    """Tensors cut into row slices that fill each part to LIMIT, so a draft of N MiB takes
    ceil(N / 15) files; the config rides in the first part's metadata (no file of its own)."""
    weights, config = newest_draft(train)
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
             for k, v in load_file(str(weights)).items() if k != "embed_tokens.weight"}
    if any(v.dim() == 0 for v in state.values()):
        raise SystemExit(f"{weights}: a 0-d tensor; parts hold row slices only")
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in state.items():
        row_bytes = v[0].numel() * v.element_size()
        i = 0
        while i < len(v):
            fit = (LIMIT - size) // row_bytes
            if fit == 0 and parts[-1]:  # this part is full: start the next
                parts.append({})
                size = 0
                continue
            piece = v[i:i + max(1, fit)]
            parts[-1][f"{k}@{i}"] = piece.clone()
            size += piece.numel() * piece.element_size()
            i += len(piece)
    for i, p in enumerate(parts):
        meta = {"config": config.read_text()} if i == 0 else None
        save_file(p, str(out / f"draft.part{i}.safetensors"), metadata=meta)
    print(f"packed {weights} into {len(parts)} parts")


def unpack(src: Path, out: Path) -> None:
    """The parts joined into OUT (model.safetensors + config.json), then read back through eyas' own
    importer, which checks the draft against the target and fills in the target's embedding."""
    from eyas.assets import smollm2_dir
    from eyas.model.checkpoints import import_draft

    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for f in src.glob("draft.part*.safetensors"):
        for k, v in load_file(str(f)).items():
            name, _, row = k.partition("@")
            pieces.setdefault(name, []).append((int(row), v))
    with safe_open(str(src / "draft.part0.safetensors"), "pt") as f:
        config = f.metadata()["config"]
    state = {k: torch.cat([v for _, v in sorted(vs, key=lambda t: t[0])]) for k, vs in pieces.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(config)
    import_draft(out, target=smollm2_dir()).save_pretrained(out)  # fp32, with the embedding
    print(f"draft at {out}")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "unpack"):
        raise SystemExit(__doc__)
    (pack if sys.argv[1] == "pack" else unpack)(Path(sys.argv[2]), Path(sys.argv[3]))
