"""The prepared data must be the target's: the same tokenizer and vocabulary, checked before any work by
every stage that reads prepared data with a target (extract, online train, eval). Data prepared for one
target and run through another trains a draft on ids that mean other words, or dies on an id past the
target's vocabulary; a tokenizer that lost its merges (a GGUF reloaded character by character) prepares
spelled-out text. Each is one error here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas.utils.io import EyasError, sha256_json

PLAIN_ENGLISH = "The quick brown fox jumps over the lazy dog, then walks home before the evening rain starts."
MAX_TOKENS_PER_WORD = 2.5  # real subword tokenizers spend 1-1.5 on such words; one per character spends ~5
MERGING_VOCAB = 1024  # a vocabulary this big is meant to hold words: bytes-only tokenizers (tests) are smaller


def tokenizer_sha256(tokenizer: Any) -> str:
    """What the tokenizer maps text to: its backend's full description, else its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return sha256_json(backend.to_str())
    return sha256_json(sorted(tokenizer.get_vocab().items()))


def vocab_size_of(tokenizer: Any, model: str) -> int:
    """The target's vocabulary (config.vocab_size may pad beyond the tokenizer's size)."""
    n = len(tokenizer) if tokenizer is not None else 0
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model)
        n = max(n, int(getattr(cfg.get_text_config(), "vocab_size", 0) or 0))
    except Exception:  # a tokenizer-only folder: the tokenizer's size is all we know
        pass
    return n


def check_tokenizer_merges(tokenizer: Any, name: str) -> None:
    """A large vocabulary that spells plain English out character by character has lost its merges."""
    if len(tokenizer) < MERGING_VOCAB:
        return
    ids = tokenizer.encode(PLAIN_ENGLISH, add_special_tokens=False)
    words = len(PLAIN_ENGLISH.split())
    if len(ids) > MAX_TOKENS_PER_WORD * words:
        pieces = " ".join(tokenizer.convert_ids_to_tokens(ids[:12]))
        raise EyasError(f"the tokenizer of '{name}' splits plain English into {len(ids)} tokens for {words} words "
                        f"({pieces} ...) although its vocabulary holds {len(tokenizer):,}: it has lost its merges "
                        "(a GGUF tokenizer reloaded by transformers can), and every stage would work on spelled-out "
                        "text. Give the original model's folder (its tokenizer.json) as --model")


def target_tokenizer(target: str, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer, or None when its folder has none (a weights-only target)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - no tokenizer to compare: the vocabulary check still runs
        return None


def check_prepared_matches_target(manifest: dict, prepared: str | Path, target: str,
                                  trust_remote_code: bool = False) -> None:
    """Refuse prepared data whose tokenizer or vocabulary is not the target's, naming both."""
    tokenizer = target_tokenizer(target, trust_remote_code)
    want, have = vocab_size_of(tokenizer, target), int(manifest.get("vocab_size") or 0)
    made_for = manifest.get("tokenizer", "?")
    fix = f"prepare it again with --model {target}, or pass the target it was prepared for"
    if want and have and want != have:
        raise EyasError(f"{prepared} was prepared with the tokenizer of '{made_for}' (vocabulary {have:,}), but the "
                        f"target '{target}' has a vocabulary of {want:,}: its token ids would mean other words. {fix}")
    data_sha = manifest.get("tokenizer_sha256")
    if tokenizer is not None and data_sha and tokenizer_sha256(tokenizer) != data_sha:
        raise EyasError(f"{prepared} was prepared with the tokenizer of '{made_for}', which maps text to other ids "
                        f"than the target '{target}''s tokenizer (same vocabulary size, other tokens). {fix}")
