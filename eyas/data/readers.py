"""Read chat data from files and datasets into one shape: a list of {"role", "content"} messages.

Inputs eyas understands:
- ShareGPT: a JSON array (or JSONL) of {"conversations": [{"from": "human"|"gpt"|"system", "value": str}]}.
  A JSON array is decoded record by record, so a file cut off mid-record (like the ShareGPT file we
  ship) still yields every complete record, and the loss is reported.
- OpenAI style: JSONL of {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}]}.
- anything `datasets` reads: .parquet/.arrow files, a folder written by `save_to_disk`, a hub name.
- the names `sharegpt` and `dummy` for the embedded default data (see eyas.assets).

One bad row never stops the job: it becomes a `Row` with a `skip` reason and a `where` of the form
`file:line` (for `datasets` inputs, `file:row`), which the caller counts in a `SkipLog`. A file that
cannot be read at all raises `EyasError` before any output is written.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.utils.io import EyasError, sha256_file, sha256_json

ROLES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
}  # fmt: skip
# Message fields kept besides role/content, so templates can render tool calls and reasoning.
EXTRA_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content")
NAMED_INPUTS = {"sharegpt": "sharegpt_path", "dummy": "dummy_conversations_path"}

# Why a row was skipped: the key goes into the manifest's "skipped", the text into the summary.
SKIP_REASONS = {
    "not_json": "not valid JSON",
    "not_utf8": "not valid UTF-8",
    "bad_shape": "no conversation in the expected shape (conversations/messages list of role+content)",
    "unknown_role": "a message has an unknown role",
    "empty": "empty conversation",
    "no_assistant": "no assistant reply after a user turn",
    "truncated_file": "the file is cut off inside this record",
    "truncated_line": "a JSONL line cut off inside its record (an interrupted write or copy)",
    "template_rejects": "the chat template rejected the conversation",
    "mask_not_found": "the assistant turns could not be located in the rendered text",
    "overlong": "longer than --max-length (with --overlong drop)",
    "no_loss_tokens": "no assistant token left within --max-length",
    "image_for_text_target": "the conversation holds an image and the target reads only text",
    "image_unreadable": "an image could not be read (path, file:// or base64 data URL)",
    "image_cut": "--max-length would cut through an image's placeholder tokens",
}


class BadRow(Exception):
    """A row that cannot be used; `reason` is a key of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass
class Row:
    """One record of an input: a clean conversation, or the reason it was skipped."""

    where: str  # "file:line" (or "file:row" for datasets inputs)
    messages: list[dict] | None = None
    skip: str | None = None
    detail: str = ""


@dataclass
class SkipLog:
    """Counts skipped rows by reason and keeps the first few examples of each as `file:line: detail`."""

    max_examples: int = 3
    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, where: str, detail: str = "") -> None:
        self.counts[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < self.max_examples:
            ex.append(f"{where}: {detail}" if detail else where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def lines(self) -> list[str]:
        out = []
        for reason, n in self.counts.most_common():
            out.append(f"{n:>8,} {reason}: {SKIP_REASONS.get(reason, reason)}")
            out.extend(f"{'':>10}e.g. {e}" for e in self.examples.get(reason, []))
        return out


# ---------------------------------------------------------------------------------------------
# One record -> clean messages
# ---------------------------------------------------------------------------------------------


def _image_part(p: dict) -> dict | None:
    """An OpenAI (`image_url`) or transformers (`image`) content part as {"type": "image", "image": SOURCE}
    (a path, a file:// URL or a base64 data URL; eyas.data.media reads it); None for other parts."""
    kind = p.get("type")
    if kind == "image_url":
        url = p.get("image_url")
        src = url.get("url") if isinstance(url, dict) else url
    elif kind == "image":
        src = next((p[k] for k in ("image", "url", "path") if isinstance(p.get(k), str)), None)
        if src is None and isinstance(p.get("base64"), str):
            src = "data:image;base64," + p["base64"]
    else:
        return None
    if not isinstance(src, str) or not src:
        raise BadRow("bad_shape", f"an image part without a path or URL (keys {sorted(p)})")
    return {"type": "image", "image": src}


def _text(content: Any, role: str) -> str | list[dict]:
    """Message content as one string (OpenAI text parts are joined, None is ''), or, when it holds
    images, its parts: [{"type": "text", "text"} | {"type": "image", "image"}] in order."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict] = []
        for p in content:
            if isinstance(p, str):
                parts.append({"type": "text", "text": p})
            elif isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
            elif isinstance(p, dict) and (image := _image_part(p)) is not None:
                parts.append(image)
            else:
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise BadRow("bad_shape", f"{role} message has content eyas cannot use ({kind})")
        if any(p["type"] == "image" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)
    raise BadRow("bad_shape", f"{role} message content is a {type(content).__name__}, not text")


def _blank(content: str | list[dict]) -> bool:
    if isinstance(content, str):
        return not content.strip()
    return not any(p["type"] == "image" or p["text"].strip() for p in content)


def _check_unicode(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRow("not_utf8", f"invalid UTF-8 / lone surrogate at character {e.start}") from None


def normalize_record(record: Any) -> list[dict]:
    """A ShareGPT or OpenAI record -> messages [{"role", "content", ...}] ready for a chat template.

    Clean-up, so that every kept conversation trains something:
    leading assistant turns (no prompt before them) are dropped; the conversation is cut at the first
    blank message (empty system prompts are just dropped); trailing non-assistant turns are dropped.
    """
    if isinstance(record, dict):
        key = next((k for k in ("messages", "conversations", "conversation") if k in record), None)
        if key is None:
            raise BadRow("bad_shape", f"no 'conversations' or 'messages' field (keys: {sorted(record)[:6]})")
        msgs = record[key]
        if msgs is None:
            raise BadRow("bad_shape", f"'{key}' is null, not a list of messages")
    else:
        msgs = record
    if not isinstance(msgs, list):
        raise BadRow("bad_shape", f"messages is a {type(msgs).__name__}, not a list")
    if not msgs:
        raise BadRow("empty", "no messages")

    out: list[dict] = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRow("bad_shape", f"message {j} is a {type(m).__name__}, not an object")
        raw_role = m.get("role", m.get("from"))
        role = ROLES.get(raw_role.lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise BadRow("unknown_role", f"message {j} has role {raw_role!r} (known: {', '.join(sorted(ROLES))})")
        content = _text(m["content"] if "content" in m else m.get("value"), role)
        for text in [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]:
            _check_unicode(text)
        msg = {"role": role, "content": content}
        for k in EXTRA_FIELDS:
            if m.get(k) is not None:
                msg[k] = m[k]
        out.append(msg)

    if not any(not _blank(m["content"]) or m.get("tool_calls") for m in out):
        raise BadRow("empty", "every message is blank")
    # Cut at the first blank message; blank system prompts are simply left out.
    kept = []
    for m in out:
        if _blank(m["content"]) and not m.get("tool_calls"):
            if m["role"] == "system":
                continue
            break
        kept.append(m)
    first_user = next((i for i, m in enumerate(kept) if m["role"] == "user"), len(kept))
    kept = [m for i, m in enumerate(kept) if i >= first_user or m["role"] == "system"]
    while kept and kept[-1]["role"] != "assistant":
        kept.pop()
    if not any(m["role"] == "assistant" for m in kept):
        raise BadRow("no_assistant", "no assistant reply after a user message")
    return kept


def _row(where: str, record: Any) -> Row:
    try:
        return Row(where, normalize_record(record))
    except BadRow as e:
        return Row(where, skip=e.reason, detail=e.detail)


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

_WS_COMMA = re.compile(r"[\s,]*")


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise EyasError(f"cannot read {path}: {e.strerror or e}. Check the path and its permissions.") from e
    # surrogateescape keeps going past bad bytes; rows holding them are skipped as not_utf8.
    return data.decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")


def _resync(text: str, pos: int, decoder: json.JSONDecoder) -> int | None:
    """After a broken record at `pos`, the start of the next record with the same indentation."""
    line_start = text.rfind("\n", 0, pos) + 1
    indent = text[line_start:pos]
    if indent.strip():
        return None  # records do not start on their own lines: cannot find the next one safely
    needle = "\n" + indent + "{"
    p = text.find(needle, pos)
    while p != -1:
        q = p + len(needle) - 1
        try:
            decoder.raw_decode(text, q)
            return q
        except json.JSONDecodeError:
            p = text.find(needle, p + 1)
    return None


def iter_json_array(path: Path, text: str | None = None) -> Iterator[Row]:
    """Records of a JSON array file, decoded one by one (complete records survive a truncated file)."""
    text = _read_text(path) if text is None else text
    decoder = json.JSONDecoder()
    pos = _WS_COMMA.match(text).end()
    if pos >= len(text) or text[pos] != "[":
        raise EyasError(f"{path}:1: expected a JSON array of conversations ('[' ...) or JSONL.")
    pos += 1
    line, last, n_ok = 1, 0, 0
    while True:
        pos = _WS_COMMA.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        line += text.count("\n", last, pos)
        last = pos
        where = f"{path}:{line}"
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            nxt = _resync(text, pos, decoder)
            if nxt is None:
                yield Row(where, skip="truncated_file",
                          detail=f"the file ends inside this record ({len(text) - pos:,} characters lost, "
                                 f"{n_ok:,} records before it read)")  # fmt: skip
                return
            yield Row(where, skip="not_json", detail=f"{e.msg} at line {e.lineno} column {e.colno}")
            pos = nxt
            continue
        n_ok += 1
        yield _row(where, record)
        pos = end


def iter_jsonl(path: Path) -> Iterator[Row]:
    """One record per line; a bad line is skipped with its line number."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, generator
    except OSError as e:
        raise EyasError(f"cannot read {path}: {e.strerror or e}. Check the path and its permissions.") from e
    with f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").removeprefix("\ufeff")
            except UnicodeDecodeError as e:
                yield Row(where, skip="not_utf8", detail=f"byte {e.start}: {e.reason}")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield _undecodable(where, e, line, last=not raw.endswith(b"\n"))
                continue
            yield _row(where, record)


def _undecodable(where: str, e: json.JSONDecodeError, line: str, last: bool) -> Row:
    """A JSONL line that is not JSON: cut off (the decoder ran out of line inside the record: a newline
    inside a string, or the end) or malformed; the detail says which and what to do."""
    text = line.rstrip()
    if e.pos < len(text) and not e.msg.startswith("Unterminated string"):
        return Row(where, skip="not_json", detail=f"{e.msg} at column {e.colno}")
    lineno = where.rsplit(":", 1)[1]
    return Row(where, skip="truncated_file" if last else "truncated_line",
               detail=f"truncated: the {'file' if last else 'line'} ends inside its JSON record after {len(text):,} "
                      f"characters (an interrupted write or copy?); complete or delete line {lineno}, or write the "
                      "file again")


def _first_char(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise EyasError(f"cannot read {path}: {e.strerror or e}. Check the path and its permissions.") from e
    s = head.decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")
    return s[:1]


# ---------------------------------------------------------------------------------------------
# datasets (imported lazily: a machine may not have it)
# ---------------------------------------------------------------------------------------------


def _datasets():
    try:
        import datasets
    except ImportError as e:
        raise EyasError("reading parquet/arrow files, saved datasets or hub names needs `datasets`: "
                        "pip install datasets (or convert the data to JSONL).") from e  # fmt: skip
    datasets.disable_progress_bars()
    return datasets


def _load_dataset(spec: str, kind: str):
    ds_mod = _datasets()
    try:
        if kind == "disk":
            ds = ds_mod.load_from_disk(spec)
        elif kind == "hub":
            name, _, split = spec.partition(":")
            ds = ds_mod.load_dataset(name, split=split or "train")
        else:
            ds = ds_mod.load_dataset(kind, data_files=spec, split="train")
    except Exception as e:  # datasets raises many types; all mean "cannot read this input"
        raise EyasError(f"cannot read {spec} with `datasets` ({type(e).__name__}: {e}). "
                        "Check the path/name; hub names need network access or a local cache.") from e  # fmt: skip
    if isinstance(ds, ds_mod.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    return ds


def iter_dataset(spec: str, kind: str) -> Iterator[Row]:
    for i, record in enumerate(_load_dataset(spec, kind)):
        yield _row(f"{spec}:{i + 1}", record)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One input, resolved: `kind` is json | jsonl | parquet | arrow | disk | hub."""

    name: str  # as the user gave it
    kind: str
    spec: str  # a path, or a hub name

    def rows(self) -> Iterator[Row]:
        if self.kind == "json":
            return iter_json_array(Path(self.spec))
        if self.kind == "jsonl":
            return iter_jsonl(Path(self.spec))
        return iter_dataset(self.spec, self.kind)

    def fingerprint(self) -> str:
        """Content hash: a second `prepare` of unchanged inputs reuses its output."""
        path = Path(self.spec)
        if self.kind == "hub":
            return sha256_json({"hub": self.spec})
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            return sha256_json([(str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files])
        return sha256_file(path)


def resolve_input(name: str) -> Source:
    """A file/folder path, `sharegpt`/`dummy`, or a `datasets` hub name (optionally `name:split`)."""
    if name.lower() in NAMED_INPUTS and not Path(name).exists():
        from eyas import assets

        path = getattr(assets, NAMED_INPUTS[name.lower()])()
        return Source(name, "json", str(path))
    path = Path(name).expanduser()
    if path.is_dir():
        if not any((path / f).exists() for f in ("state.json", "dataset_dict.json", "dataset_info.json")):
            raise EyasError(f"{path} is a folder but not a saved dataset (no state.json/dataset_dict.json). "
                            "Pass the chat files inside it instead.")  # fmt: skip
        return Source(name, "disk", str(path))
    if path.is_file():
        if not os.access(path, os.R_OK):
            raise EyasError(f"cannot read {path}: permission denied.")
        suffix = path.suffix.lower()
        if suffix in (".parquet", ".arrow"):
            return Source(name, suffix[1:], str(path))
        if suffix in (".json", ".jsonl", ".ndjson"):
            first = _first_char(path)
            if first == "[":
                return Source(name, "json", str(path))
            if first == "{" or not first:
                return Source(name, "jsonl", str(path))
            raise EyasError(f"{path}:1: neither a JSON array nor JSONL (starts with {first!r}). "
                            "Give ShareGPT/OpenAI chat data as .json, .jsonl or .parquet.")  # fmt: skip
        raise EyasError(f"{path}: unknown file type '{suffix}'. "
                        "Use .json, .jsonl, .parquet, .arrow or a saved dataset.")
    looks_like_file = path.suffix.lower() in (".json", ".jsonl", ".ndjson", ".parquet", ".arrow")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")) and not looks_like_file:
        return Source(name, "hub", name)
    raise EyasError(f"input '{name}' not found: not a file, not a folder, not one of {sorted(NAMED_INPUTS)}, "
                    "not a hub dataset name (owner/name).")  # fmt: skip


def read_conversations(
    inputs: str | os.PathLike | list[str | os.PathLike], log: SkipLog | None = None
) -> list[list[dict]]:
    """All clean conversations of one input or several; skipped rows go to `log` when given."""
    log = SkipLog() if log is None else log
    convs = []
    for name in [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs:
        for row in resolve_input(str(name)).rows():
            if row.skip:
                log.add(row.skip, row.where, row.detail)
            else:
                convs.append(row.messages)
    return convs
