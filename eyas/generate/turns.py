"""The turn logic every generator shares: which reply to write next, its prompt, and the reply put back.

A conversation keeps its structure (system prompt, user turns, number and order of turns); each
assistant turn is replaced by the target's own reply to the conversation so far (earlier turns already
rewritten). Generators only turn prompt ids into reply ids; everything else happens here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from eyas.utils.io import EyasError
from eyas.utils.schema import option


@dataclass(kw_only=True)
class Sampling:
    """Generation options; temperature 0 means greedy."""

    help_panel: ClassVar[str] = "Sampling"

    temperature: float = option(0.8, help="Sampling temperature; 0 = greedy.")
    top_p: float = option(1.0, help="Nucleus sampling mass.")
    top_k: int = option(0, help="Sample among the k likeliest tokens; 0 = off.")
    max_new_tokens: int = option(1024, help="Longest reply.")
    seed: int = option(0, help="Sampling seed (per batch, so resumed runs match).")

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_new_tokens < 1:
            raise EyasError("sampling options out of range: need --temperature >= 0, 0 < --top-p <= 1, "
                            "--top-k >= 0, --max-new-tokens >= 1")

    def generate_kwargs(self) -> dict[str, Any]:
        if self.temperature == 0:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k or None, "max_new_tokens": self.max_new_tokens}


@dataclass
class Stats:
    """A run's totals: the sum of its chunks' `turn_counts`, plus the conversations kept."""

    conversations: int = 0
    turns: int = 0
    tokens: int = 0
    unfinished: int = 0  # replies cut by --max-new-tokens
    truncated: int = 0  # conversations cut before a turn whose prompt exceeded --max-length
    dropped: int = 0  # conversations with no turn left within --max-length

    def add(self, other: dict) -> None:
        for k, v in other.items():
            setattr(self, k, getattr(self, k) + v)


def turn_counts() -> dict[str, int]:
    """One chunk's counts (saved with it in the partial file, so a resumed run adds them up again)."""
    return {"turns": 0, "tokens": 0, "unfinished": 0, "truncated": 0, "dropped": 0}


def _regenerable(m: dict) -> bool:
    """Assistant text turns are rewritten; tool-call turns keep their calls (their results follow)."""
    return m["role"] == "assistant" and not m.get("tool_calls")


class Conversation:
    """One conversation being rewritten turn by turn."""

    def __init__(self, messages: list[dict]) -> None:
        self.messages = [dict(m) for m in messages]
        self.next = 0  # first message not rewritten or skipped yet

    def next_turn(self) -> int | None:
        return next((j for j in range(self.next, len(self.messages)) if _regenerable(self.messages[j])), None)

    def result(self) -> list[dict] | None:
        """The rewritten conversation ending on an assistant turn, or None when none is left."""
        c = self.messages
        while c and c[-1]["role"] != "assistant":
            c.pop()
        return c if any(m["role"] == "assistant" for m in c) else None


def stop_ids(eos: int | list[int] | None, tokenizer: Any) -> list[int]:
    """End-of-reply ids: the generation config's, plus the tokenizer's eos."""
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise EyasError("the target defines no end-of-sequence token (generation_config / tokenizer): "
                        "replies would never stop")
    return ids


class Turns:
    """Opens a conversation's next turn (its prompt ids) and closes it with the reply ids a generator wrote."""

    def __init__(self, tokenizer: Any, sampling: Sampling, max_length: int, eos: list[int]) -> None:
        self.tok, self.sampling, self.max_length, self.eos = tokenizer, sampling, max_length, eos

    @classmethod
    def of_model(cls, model: Any, tokenizer: Any, sampling: Sampling, max_length: int) -> Turns:
        """The turns of a loaded transformers model: its stop ids, and a tokenizer that left-pads
        (decoder-only generation: prompts end where replies start) with a pad token."""
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return cls(tokenizer, sampling, max_length, stop_ids(model.generation_config.eos_token_id, tokenizer))

    def open(self, conv: Conversation, stats: dict) -> tuple[int, list[int]] | None:
        """(turn index, prompt ids) of the next reply to write; None when the conversation is done, or
        cut because that reply would not fit in --max-length."""
        j = conv.next_turn()
        if j is None:
            return None
        text = self.tok.apply_chat_template(conv.messages[:j], tokenize=False, add_generation_prompt=True)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) + self.sampling.max_new_tokens > self.max_length:
            conv.messages = conv.messages[:j]
            stats["truncated"] += 1
            return None
        return j, ids

    def close(self, conv: Conversation, j: int, toks: list[int], stats: dict) -> None:
        """Put reply `toks` (cut at its first stop id) in as turn j's text."""
        end = next((t for t, x in enumerate(toks) if x in self.eos), None)
        if end is None:
            stats["unfinished"] += 1
            end = len(toks)
        conv.messages[j]["content"] = self.tok.decode(toks[:end], skip_special_tokens=True).strip()
        conv.messages[j].pop("reasoning_content", None)  # the old reasoning belonged to the old reply
        conv.next = j + 1
        stats["turns"] += 1
        stats["tokens"] += end + (end < len(toks))

    @staticmethod
    def finish(conv: Conversation, stats: dict) -> list[dict] | None:
        out = conv.result()
        stats["dropped"] += out is None
        return out
