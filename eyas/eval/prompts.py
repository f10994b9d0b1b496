"""Prompt sets for evaluation: MT-Bench, HumanEval, a held-out slice of a prepared dataset, chat files.

A prompt item is either a conversation of user turns, asked one after the other with the
model's own answers in between and rendered with the target's chat template (MT-Bench's two
turns work this way), or ready token ids (a prepared dataset's samples cut before their first
assistant reply).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.utils.io import EyasError

BUILTIN_SETS = ("mtbench", "humaneval", "sharegpt", "dummy")


@dataclass
class PromptItem:
    id: str
    turns: list[str] = field(default_factory=list)  # user turns, in order
    system: str | None = None
    token_ids: list[int] | None = None  # a ready prompt: used as is, single turn


@dataclass
class PromptSet:
    name: str
    items: list[PromptItem]

    @property
    def num_turns(self) -> int:
        return sum(1 if it.token_ids is not None else len(it.turns) for it in self.items)

    @classmethod
    def from_texts(cls, name: str, texts: list[str]) -> PromptSet:
        return cls(name, [PromptItem(str(i), [t]) for i, t in enumerate(texts)])


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Messages -> token ids with the target's chat template and its generation prompt.

    Tokenizers without a chat template (base models) get the turns joined by blank lines.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer(text)["input_ids"])


# -- the sets ------------------------------------------------------------------------------------


def mtbench_set(max_prompts: int | None = None, max_turns: int = 2) -> PromptSet:
    from eyas.assets import mtbench_questions

    items = [PromptItem(str(q["question_id"]), list(q["turns"])[:max_turns]) for q in mtbench_questions()]
    return PromptSet("mtbench", items[:max_prompts])


def humaneval_set(max_prompts: int | None = None) -> PromptSet:
    """Each problem's prompt (signature + docstring) as the user message, the way EAGLE evaluates chat models."""
    from eyas.assets import humaneval_prompts

    items = [PromptItem(p["task_id"], [p["prompt"]]) for p in humaneval_prompts()]
    return PromptSet("humaneval", items[:max_prompts])


def prepared_set(path: Path, max_prompts: int | None = None) -> PromptSet:
    """The LAST samples of a prepared dataset (docs/architecture.md, contract 1), each cut before its
    first trained token: a held-out slice when training used the samples before it."""
    manifest = json.loads((path / "manifest.json").read_text())
    if manifest.get("format") != "eyas.prepared/1":
        raise EyasError(f"{path / 'manifest.json'}: format {manifest.get('format')!r} is not eyas.prepared/1")
    from safetensors.torch import load_file

    n = max_prompts or 80
    items: list[PromptItem] = []
    first_index = sum(s["num_samples"] for s in manifest["shards"])
    for shard in reversed(manifest["shards"]):
        data = load_file(str(path / shard["file"]))
        ids, mask, offsets = data["input_ids"], data["loss_mask"], data["offsets"].tolist()
        first_index -= shard["num_samples"]
        for i in reversed(range(len(offsets) - 1)):
            a, b = offsets[i], offsets[i + 1]
            trained = mask[a:b].nonzero()
            if trained.numel() == 0 or int(trained[0]) == 0:
                continue
            items.append(PromptItem(f"sample-{first_index + i}", token_ids=ids[a:a + int(trained[0])].tolist()))
            if len(items) >= n:
                return PromptSet(path.name, items[::-1])
    return PromptSet(path.name, items[::-1])


def _conversation_turns(record: Any) -> tuple[list[str], str | None]:
    """User turns and system prompt of one chat record (OpenAI `messages` or ShareGPT `conversations`)."""
    if not isinstance(record, dict):
        return [], None
    if isinstance(record.get("turns"), list):  # MT-Bench's question.jsonl: {"question_id", "turns": [str, ...]}
        return [t for t in record["turns"] if isinstance(t, str) and t.strip()], None
    msgs = record.get("messages") or record.get("conversations") or record.get("conversation") or []
    users, system = [], None
    for m in msgs if isinstance(msgs, list) else []:
        if not isinstance(m, dict):
            continue
        role = str(m.get("role", m.get("from", ""))).lower()
        content = m.get("content", m.get("value"))
        if not isinstance(content, str) or not content.strip():
            continue
        if role in ("user", "human"):
            users.append(content)
        elif role == "system":
            system = content
    if not users and isinstance(record.get("prompt"), str):
        users = [record["prompt"]]
    return users, system


def _read_records(path: Path) -> list[Any]:
    """JSONL, a JSON list, or a JSON list cut off mid-record (complete records kept)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        out = []
        for line in text.split("\n"):  # not splitlines(): a prompt may hold U+2028
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out
    try:
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        pass
    dec, pos, out = json.JSONDecoder(), text.find("[") + 1, []
    while pos > 0:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        out.append(obj)
    return out


def chat_file_set(path: Path, max_prompts: int | None = None, max_turns: int = 2, name: str | None = None) -> PromptSet:
    """The LAST conversations of a chat file that `prepare` reads (ShareGPT or OpenAI messages)."""
    records = _load_with_readers(path)
    if not records:  # no reader, or records it does not take (MT-Bench's question.jsonl)
        records = _read_records(path)
    items = []
    for i, rec in enumerate(records):
        users, system = _conversation_turns(rec)
        if users:
            rid = rec.get("question_id", rec.get("id", i)) if isinstance(rec, dict) else i
            items.append(PromptItem(str(rid), users[:max_turns], system))
    if not items:
        raise EyasError(f"{path}: no conversation with a user turn found (expected ShareGPT `conversations` or "
                        "OpenAI-style `messages` records, as `eyas prepare` reads)")
    n = max_prompts or 80
    return PromptSet(name or path.stem, items[-n:])


def _load_with_readers(path: Path) -> list[Any] | None:
    """Use `prepare`'s own reader when it is there, so eval reads exactly what prepare reads
    (parquet, saved datasets, cut-off JSON arrays); our small JSON reader is the fallback."""
    try:
        from eyas.data.readers import read_conversations
    except ImportError:
        return None
    try:
        return [{"messages": msgs} for msgs in read_conversations(str(path))]
    except EyasError:
        return None


def load_prompt_sets(spec: str, max_prompts: int | None = None, max_turns: int = 2) -> list[PromptSet]:
    """'mtbench,humaneval,path/to/file_or_prepared_dir,name=path' -> prompt sets.

    `name=path` names a file's set, e.g. `mtbench=question.jsonl` on a machine without the MT-Bench
    package (MT-Bench's own question.jsonl is read as it is: both turns of every question).
    """
    sets = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        name = None
        if "=" in part:
            name, part = (x.strip() for x in part.split("=", 1))
            path = Path(part).expanduser()
            if not path.exists():
                raise EyasError(f"--prompts {name}={part}: {part} does not exist")
            sets.append(prepared_set(path, max_prompts) if (path / "manifest.json").is_file()
                        else chat_file_set(path, max_prompts, max_turns, name=name))
            sets[-1].name = name
            continue
        key = part.lower()
        if key == "mtbench":
            sets.append(mtbench_set(max_prompts, max_turns))
        elif key == "humaneval":
            sets.append(humaneval_set(max_prompts))
        elif key == "sharegpt":
            from eyas.assets import sharegpt_path

            sets.append(chat_file_set(sharegpt_path(), max_prompts, max_turns, name="sharegpt"))
        elif key == "dummy":
            from eyas.assets import dummy_conversations_path

            sets.append(chat_file_set(dummy_conversations_path(), max_prompts, max_turns, name="dummy"))
        else:
            path = Path(part).expanduser()
            if path.is_dir() and (path / "manifest.json").is_file():
                sets.append(prepared_set(path, max_prompts))
            elif path.exists():
                sets.append(chat_file_set(path, max_prompts, max_turns))
            else:
                raise EyasError(f"--prompts {part!r} is neither a built-in set ({', '.join(BUILTIN_SETS)}), "
                                "a chat file (ShareGPT/OpenAI JSON or JSONL) nor a prepared dataset folder")
    if not sets:
        raise EyasError("--prompts is empty: give mtbench, humaneval, a chat file or a prepared dataset folder")
    return sets
