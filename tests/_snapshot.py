"""What a finished run left in its folder, less what wall-clock time decides: two runs of the same command, one
killed and resumed, must leave equal snapshots (tests/test_reliability.py)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

TIMING = {"seconds", "elapsed", "tok_s", "tok_per_s", "tokens_per_s", "speedup", "created", "in_words",  # wall-clock
          "speedup_range", "speedup_note", "recommendation"}  # what the timing says and what it chooses
SPEED_PLOT = "tau_vs_k.png"  # its second panel plots the measured speedup


def _scrub(x, out: str):
    """A JSON value without wall-clock fields, with the run's own folder spelled <OUT>."""
    if isinstance(x, dict):
        return {k: _scrub(v, out) for k, v in x.items() if k not in TIMING}
    if isinstance(x, list):
        return [_scrub(v, out) for v in x]
    return x.replace(out, "<OUT>") if isinstance(x, str) else x


def snapshot(out: Path) -> dict[str, object]:
    """Every file under `out`: its bytes' sha256, or for what holds wall-clock values, the rest of it."""
    snap: dict[str, object] = {}
    for p in sorted(out.rglob("*")):
        rel = str(p.relative_to(out))
        if not p.is_file() or p.name == "config.yaml":
            continue
        if p.name == "run_state.json":  # per-stage fingerprints hash this folder's path, and seconds
            snap[rel] = sorted(json.loads(p.read_text()))
        elif p.name == "progress.json":  # `start`: the step this process began at (a resume's is later)
            snap[rel] = {k: v for k, v in _scrub(json.loads(p.read_text()), str(out)).items() if k != "start"}
        elif p.suffix == ".json":
            snap[rel] = _scrub(json.loads(p.read_text()), str(out))
        elif p.suffix == ".jsonl":
            snap[rel] = [_scrub(json.loads(line), str(out)) for line in p.read_text().splitlines()]
        elif p.suffix == ".md":
            snap[rel] = _untimed_tables(p.read_text().replace(str(out), "<OUT>"))
        elif p.suffix == ".pt":  # torch.save's bytes hold a random serialization_id: compare what it holds
            snap[rel] = _checkpoint_state(p)
        elif p.name == SPEED_PLOT:
            snap[rel] = "plots speedup"
        else:
            snap[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return snap


def _checkpoint_state(path: Path) -> str:
    """A training state.pt's content less the global RNG states it records. Python's and NumPy's are never
    seeded, so two uninterrupted runs differ there too; torch's is one draw ahead after a resume (the
    resumed run's DataLoader draws its seed again). Nothing in training draws from them: the weights, the
    optimizer and the schedule, compared here, are identical."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    state.pop("rng")
    digest = hashlib.sha256()

    def walk(x) -> None:
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                digest.update(repr(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, torch.Tensor):
            digest.update(repr((x.dtype, tuple(x.shape))).encode())
            digest.update(x.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(x).encode())

    walk(state)
    return digest.hexdigest()


def _untimed_tables(md: str) -> str:
    """Markdown with the cells of its tok/s and speedup columns blanked, without the notes on noisy timing and the
    recommendation section, which the timing decides (eval's report.md)."""
    out, header, chosen = [], [], False
    for line in md.splitlines():
        chosen = line == "## Recommendation" or (chosen and not line.startswith(("## ", "Plots:")))
        if chosen or "the timing was too noisy to give a speedup" in line:
            continue
        cells = line.split("|")
        if line.startswith("|") and not header:
            header = [c.strip() for c in cells]
        elif line.startswith("|") and not set(line) <= set("|-: "):
            cells = [c if i >= len(header) or header[i] not in ("tok/s", "speedup", "speedup (rounds' range)")
                     else " - " for i, c in enumerate(cells)]
        elif not line.startswith("|"):
            header = []
        out.append("|".join(cells))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out))  # the blank line that followed a dropped note


def debris(out: Path) -> list[str]:
    """Temporary or partial files a finished run must not leave."""
    return [str(p.relative_to(out)) for p in out.rglob("*")
            if p.name.startswith((".tmp-", ".old-")) or ".partial" in p.name]
