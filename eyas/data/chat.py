"""Render conversations with the target's own chat template and mark the tokens the model must produce.

The loss mask is found by rendering prefixes of the conversation and comparing them with the full
rendering, never by per-template patterns, so any template works as it is written:

    full    = render(messages)                                      # the training text, rendered once
    prompt  = render(messages[:i], add_generation_prompt=True)      # what the model sees before turn i
    closed  = render(messages[:i+1])                                # the text once turn i is written

Assistant turn i starts where `prompt` stops matching `full` (default system prompts injected by the
template and generation headers are thus context), and ends where `closed` ends, cut right after the
end-of-turn special token (the model must emit `<|im_end|>`, not the newline glue after it). Templates
that render a turn differently once later turns follow (e.g. they strip `<think>` blocks from history)
make `closed` diverge from `full`; the turn then ends at the end-of-turn marker that `closed` ends with,
found in `full`. Templates that add `<think>` to the last turn put it inside the span: the model must
produce it.

Each conversation costs 2k renders of strings for k assistant turns (cheap) and one tokenization,
batched over many conversations with the fast tokenizer; character spans become token spans with the
tokenizer's offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from eyas.data.readers import BadRow

PREFIX_CHARS = 6  # characters per token budgeted when tokenizing only the head of an overlong text
PREFIX_MARGIN = 512  # kept tokens must end this many characters before the cut
LOOP_NGRAM = 16  # a reply "repeats itself" at a run of this many tokens the assistant already wrote


@dataclass
class Encoded:
    """One prepared sample."""

    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 on assistant tokens + end of turn
    truncated: bool = False
    trimmed: int = 0  # loop-tail tokens removed (ChatEncoder trim_loops)


def trim_loops(ids: np.ndarray, mask: np.ndarray, keep: int, n: int = LOOP_NGRAM) -> tuple[np.ndarray, np.ndarray]:
    """Cut each assistant turn `keep` tokens after it starts repeating itself, keeping its last token.

    A turn repeats itself at the first token that completes an n-token run the assistant already wrote
    in this conversation (earlier in the turn or in an earlier turn). Greedy decoding of small targets
    loops (SmolLM2 rewrites: 46% of reply tokens); the tails are trivial to predict, dominate the loss
    and cost compute. The kept `keep` tokens still teach the draft to follow a loop, which a target that
    loops at serving time too needs.
    The turn's last token (its end-of-turn marker) stays, so the sample remains a well-formed
    conversation; its training targets come from the target on this text.
    ids [T], mask [T] (1 on assistant tokens) -> the same, shorter.
    """
    drop = loop_tails(ids, mask, keep, n)
    if not drop.any():
        return ids, mask
    return ids[~drop], mask[~drop]


def loop_tails(ids: np.ndarray, mask: np.ndarray, keep: int, n: int = LOOP_NGRAM) -> np.ndarray:
    """bool [T]: the tokens `trim_loops` cuts (image samples cut their per-token arrays the same way)."""
    m = mask.astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate(([False], m, [False])).astype(np.int8)))
    seen: set[bytes] = set()
    drop = np.zeros(len(ids), dtype=bool)
    for a, b in zip(edges[0::2], edges[1::2], strict=True):  # one assistant turn: tokens [a, b)
        onset = None
        for i in range(a + n - 1, b):
            gram = ids[i - n + 1 : i + 1].tobytes()
            if onset is None and gram in seen:
                onset = i
            seen.add(gram)
        if onset is not None and onset + 1 + keep < b - 1:
            drop[onset + 1 + keep : b - 1] = True
    return drop


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection on slice equality (C speed on long strings)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """Every special token's text (eos, <|im_end|>, <|eot_id|>, ...): candidates for 'end of turn'."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok))
    return tuple(sorted((s for s in specials if s), key=len, reverse=True))


class ChatEncoder:
    """Conversation -> (input_ids, loss_mask) with one tokenizer and its chat template."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        max_length: int | None = None,
        overlong: str = "truncate",
        trim_loops: int | None = None,
    ) -> None:
        if overlong not in ("truncate", "drop"):
            raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template or tokenizer.get_chat_template()
        self.template_kwargs = dict(template_kwargs or {})
        self.max_length = max_length
        self.overlong = overlong
        self.trim_loops = trim_loops  # None: keep replies whole; else see trim_loops()
        self.specials = special_token_strings(tokenizer)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizer: batch + offsets

    # -- rendering ------------------------------------------------------------------------------

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **self.template_kwargs,
        )  # fmt: skip

    def _render_or_reject(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.render(messages, add_generation_prompt)
        except Exception as e:  # TemplateError from raise_exception, or the template tripping on the data
            raise BadRow("template_rejects", f"{type(e).__name__}: {str(e)[:200]}") from None

    def _end_of_turn(self, text: str, start: int, end: int) -> int:
        """Cut the span after its end-of-turn special token: the newline glue after it is not produced."""
        stripped = text[start:end].rstrip()
        return start + len(stripped) if stripped.endswith(self.specials) else end

    def _history_turn_end(self, full: str, start: int, closed_turn: str) -> int:
        """End of a turn that `full` renders differently from when it was the last turn.

        `closed_turn` is the turn as rendered last, e.g. '<think>..</think>\\n\\nanswer<|im_end|>\\n'. The
        history rendering ends with the same end-of-turn marker: find the first one after `start`.
        """
        stripped = closed_turn.rstrip()
        marker = next((s for s in self.specials if stripped.endswith(s)), None)
        if marker is not None:
            hit = full.find(marker, start)
            if hit != -1:
                return hit + len(marker)
            raise BadRow("mask_not_found", f"end-of-turn {marker!r} of an assistant turn not found")
        # No special end marker: the history rendering is the longest tail of the closed turn.
        p = closed_turn.find(full[start : start + 1])
        for _ in range(1000):
            if p == -1:
                break
            if full.startswith(closed_turn[p:], start):
                return start + len(closed_turn) - p
            p = closed_turn.find(full[start : start + 1], p + 1)
        raise BadRow("mask_not_found", "an assistant turn is rendered differently in history; cannot locate it")

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans [start, end) the model must produce."""
        full = self._render_or_reject(messages)
        spans: list[tuple[int, int]] = []
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            if i == 0:
                raise BadRow("no_assistant", "the conversation starts with an assistant turn")
            prompt = self._render_or_reject(messages[:i], add_generation_prompt=True)
            start = len(prompt) if full.startswith(prompt) else _common_prefix_len(prompt, full)
            closed = full if i == len(messages) - 1 else self._render_or_reject(messages[: i + 1])
            if full.startswith(closed):
                end = len(closed)
            else:
                c0 = len(prompt) if closed.startswith(prompt) else _common_prefix_len(prompt, closed)
                end = self._history_turn_end(full, start, closed[c0:])
            end = self._end_of_turn(full, start, end)
            if end <= start or (spans and start < spans[-1][1]):
                raise BadRow("mask_not_found", f"assistant turn {i} has an empty or overlapping span")
            spans.append((start, end))
        if not spans:
            raise BadRow("no_assistant", "no assistant turn")
        return full, spans

    # -- tokenization ---------------------------------------------------------------------------

    def _tokenize(self, texts: list[str]) -> list[tuple[list[int], Any]]:
        """Token ids + an encoding that maps characters to tokens, batched (fast tokenizer) when possible.

        With --max-length T, a long text is first tokenized only up to T * PREFIX_CHARS characters: the
        first T tokens are the same as the full text's when they end well before the cut (tokenizers
        split text into words locally). Texts where that does not hold are tokenized in full.
        """
        if self._backend is None:
            out = []
            for t in texts:
                enc = self.tokenizer(t, add_special_tokens=False, return_offsets_mapping=True)
                out.append((enc["input_ids"], enc["offset_mapping"]))
            return out
        T = self.max_length
        cut = None if T is None else T * PREFIX_CHARS
        encs = self._backend.encode_batch([t[:cut] for t in texts] if cut else texts, add_special_tokens=False)
        out = [(e.ids, e) for e in encs]
        if cut:
            redo = [k for k, (t, (ids, e)) in enumerate(zip(texts, out, strict=True))
                    if len(t) > cut and (len(ids) <= T or e.token_to_chars(T)[1] > cut - PREFIX_MARGIN)]
            for k, e in zip(redo, self._backend.encode_batch([texts[k] for k in redo], add_special_tokens=False),
                            strict=True):
                out[k] = (e.ids, e)
        return out

    @staticmethod
    def _char_to_token(enc: Any, pos: int, lo: int, hi: int, step: int) -> int | None:
        """Token holding character `pos`, moving by `step` within [lo, hi) over characters no token covers."""
        while lo <= pos < hi:
            if isinstance(enc, list):  # offset_mapping from a slow tokenizer
                t = next((k for k, (s, e) in enumerate(enc) if s <= pos < e), None)
            else:
                t = enc.char_to_token(pos)
            if t is not None:
                return t
            pos += step
        return None

    def _mask(self, n_tokens: int, enc: Any, spans: list[tuple[int, int]]) -> np.ndarray:
        mask = np.zeros(n_tokens, dtype=np.uint8)
        covered = enc.token_to_chars(n_tokens - 1)[1] if n_tokens and not isinstance(enc, list) else None
        for a, b in spans:
            if covered is not None and a >= covered:
                break  # beyond the tokenized head of an overlong text
            b = b if covered is None else min(b, covered)
            t0 = self._char_to_token(enc, a, a, b, +1)
            t1 = self._char_to_token(enc, b - 1, a, b, -1)
            if t0 is None or t1 is None:
                raise BadRow("mask_not_found", f"no token covers characters {a}..{b}")
            mask[t0 : t1 + 1] = 1
        return mask

    def token_mask(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32 [T], loss_mask uint8 [T]) of the whole `text`, never cut at --max-length
        (image samples are cut only after the processor has expanded their placeholders)."""
        if self._backend is None:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = enc["input_ids"], enc["offset_mapping"]
        else:
            offsets = self._backend.encode(text, add_special_tokens=False)
            ids = offsets.ids
        return np.asarray(ids, dtype=np.int32), self._mask(len(ids), offsets, spans)

    def encode_batch(self, conversations: list[list[dict]]) -> list[Encoded | BadRow]:
        """Encode many conversations at once; a row that fails becomes its BadRow, in place."""
        results: list[Encoded | BadRow | None] = [None] * len(conversations)
        texts, spans, idx = [], [], []
        for k, msgs in enumerate(conversations):
            try:
                text, sp = self.assistant_spans(msgs)
            except BadRow as e:
                results[k] = e
                continue
            texts.append(text)
            spans.append(sp)
            idx.append(k)
        for k, (ids, enc), sp in zip(idx, self._tokenize(texts), spans, strict=True):
            try:
                results[k] = self._finish(ids, enc, sp)
            except BadRow as e:
                results[k] = e
        return results  # type: ignore[return-value]

    def encode(self, messages: list[dict]) -> Encoded:
        """One conversation; raises BadRow if it cannot be used."""
        out = self.encode_batch([messages])[0]
        if isinstance(out, BadRow):
            raise out
        return out

    def _finish(self, ids: list[int], enc: Any, spans: list[tuple[int, int]]) -> Encoded:
        n = len(ids)
        mask = self._mask(n, enc, spans)
        input_ids = np.asarray(ids, dtype=np.int32)
        trimmed = 0
        if self.trim_loops is not None:
            input_ids, mask = trim_loops(input_ids, mask, self.trim_loops)
            trimmed = n - len(input_ids)
            n = len(input_ids)
        truncated = False
        if self.max_length is not None and n > self.max_length:
            if self.overlong == "drop":
                raise BadRow("overlong", f"more than --max-length {self.max_length:,} tokens")
            input_ids, mask, truncated = input_ids[: self.max_length], mask[: self.max_length], True
        if not mask.any():
            raise BadRow("no_loss_tokens", f"no assistant token within the first {len(input_ids):,} tokens")
        return Encoded(input_ids, mask, truncated, trimmed)
