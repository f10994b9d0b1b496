"""Resumable outputs, one way for every stage.

Two pieces:
- `up_to_date(manifest, options_sha256, *outputs)`: a stage's output is reused when its manifest
  records the same options fingerprint (a hash of the inputs' content and the options) and every
  output file it names exists. A run cut short writes no fingerprint, so it is never "up to date".
- `PartialLog`: the work a long stage has finished so far, one JSON record per line after a header
  line holding the options fingerprint. A kill can tear the last line; opening the log keeps the
  records before it and rewrites the file without the fragment, so what is appended next starts on
  a line of its own. Every record is flushed and fsynced before the stage goes on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from eyas.utils.io import atomic_path, read_json, remove_leftovers


def up_to_date(manifest: str | os.PathLike, options_sha256: str, *outputs: str | os.PathLike,
               entry: str | None = None) -> bool:
    """True when `manifest` exists, records `options_sha256` (under `entry` when the file keeps one record
    per stage), and each of `outputs` exists. First removes what a writer killed mid-way left next to
    them (a kill after the output was complete leaves it, and a reused output is not written again)."""
    manifest = Path(manifest)
    for folder in {manifest.parent, manifest.parent.parent, *(Path(p).parent for p in outputs)}:
        remove_leftovers(folder)
    if not manifest.is_file() or not all(Path(p).exists() for p in outputs):
        return False
    try:
        record = read_json(manifest)
        record = record.get(entry) if entry is not None else record
        return record.get("options_sha256") == options_sha256
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object
        return False


class PartialLog:
    """Append-only JSONL of finished work for one options fingerprint.

        log = PartialLog(path, options_sha)
        done = log.records            # what an earlier run with the same fingerprint finished
        with log:                     # opened for appending (a fresh file when nothing was kept)
            log.append({...})         # written, flushed and fsynced at once
        log.remove()                  # once the stage's real output is written
    """

    def __init__(self, path: str | os.PathLike, options_sha256: str) -> None:
        self.path, self.sha = Path(path), options_sha256
        self.records: list[dict[str, Any]] = []
        self.stale = False  # the file held work of other inputs or options (now discarded)
        self.torn = False  # its last line was cut by a kill (now dropped)
        self._file: IO[str] | None = None
        self._load()

    def _load(self) -> None:
        if not self.path.is_file():
            return
        lines = self.path.read_bytes().split(b"\n")
        try:
            header = json.loads(lines[0])
        except ValueError:  # not JSON or not UTF-8: not ours to keep
            header = {}
        if not isinstance(header, dict) or header.get("options_sha256") != self.sha:
            self.stale = any(line.strip() for line in lines[1:])
            return
        for line in lines[1:]:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                self.torn = True
                break  # a line cut by a kill: it and anything after it is redone
            if not isinstance(rec, dict):
                self.torn = True
                break
            self.records.append(rec)

    def __enter__(self) -> PartialLog:
        # rewrite with only the kept records, so an append never follows a torn line
        with atomic_path(self.path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"options_sha256": self.sha}) + "\n")
            for rec in self.records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._file = open(self.path, "a", encoding="utf-8")
        return self

    def append(self, rec: dict[str, Any]) -> None:
        assert self._file is not None, "open the log with `with log:` first"
        self._file.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records.append(rec)

    def __exit__(self, *exc: Any) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
