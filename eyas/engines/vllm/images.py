"""Samples with images for vLLM: it runs its own processor on the image files and expands each image's
one placeholder token itself, so a request carries the prompt with every run of placeholders cut to
one and the images in the field the model registers them under. Its captured rows are then those of
the expanded sequence, which the engine checks against the prepared (expanded) token ids.
"""

from __future__ import annotations

from typing import Any

from eyas.utils.io import EyasError

# where a model takes its images in `multi_modal_data`, when it is not "image"
IMAGE_FIELDS: dict[str, str] = {"KimiK25ForConditionalGeneration": "vision_chunk"}  # Kimi: image or video chunks


def image_token_id(config: dict) -> int | None:
    return next((config[k] for k in ("image_token_id", "image_token_index", "media_placeholder_token_id")
                 if isinstance(config.get(k), int)), None)


def check_config_for_a_draft(config: dict, model: str) -> None:
    """vLLM reads a Kimi target's `media_placeholder_token_id` when it serves a draft beside it (the draft
    learns where images sit): a config without it fails deep in vLLM's start-up, so it is named here first."""
    kimi = {"KimiK25ForConditionalGeneration", "KimiK3ForConditionalGeneration"}
    if set(config.get("architectures") or []) & kimi and not isinstance(config.get("media_placeholder_token_id"),
                                                                       int):
        guess = image_token_id(config)
        value = str(guess) if guess is not None else "<the id of <|media_pad|> in its tokenizer>"
        raise EyasError(f"{model}/config.json has no media_placeholder_token_id, which vLLM reads to serve a draft "
                        f'beside a Kimi target: add "media_placeholder_token_id": {value} to it')


def collapse_placeholders(ids: list[int], placeholder: int) -> tuple[list[int], int]:
    """(ids with each run of `placeholder` cut to one token, the number of runs)."""
    out: list[int] = []
    runs = 0
    for t in ids:
        if t == placeholder and out and out[-1] == placeholder:
            continue
        runs += t == placeholder
        out.append(t)
    return out, runs


def image_prompt(ids: list[int], images: list[Any], config: dict) -> dict[str, Any]:
    """A vLLM TokensPrompt (as a dict) for one sample with images (PIL)."""
    placeholder = image_token_id(config)
    if placeholder is None:
        raise EyasError("the samples hold images but the target's config names no image token id; "
                        "use --engine hf for this target")
    prompt, runs = collapse_placeholders(ids, placeholder)
    if runs != len(images):
        raise EyasError(f"a sample holds {len(images)} image(s) but {runs} run(s) of image token {placeholder}: "
                        "prepare the data again with this target")
    arch = (config.get("architectures") or [""])[0]
    field = IMAGE_FIELDS.get(arch, "image")
    items = [{"type": "image", "image": im} for im in images] if field == "vision_chunk" else images
    return {"prompt_token_ids": prompt, "multi_modal_data": {field: items}}
