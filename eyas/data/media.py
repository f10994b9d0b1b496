"""Images in chat data: read them, run the target's own processor, keep what extraction needs.

A message holding image parts (eyas.data.readers keeps them as {"type": "image", "image": SOURCE},
SOURCE a path, a file:// URL or a base64 data URL) is rendered by the chat template like any other;
the template writes one placeholder per image. The text is tokenized with its loss mask as usual,
then handed with the images to the target's processor (`AutoProcessor`), which expands each
placeholder into the image's tokens (Kimi-K2.5: one `<|media_pad|>` per 2x2 patches) and returns the
vision tower's inputs. The mask moves to the expanded tokens by aligning the two token sequences:
tokens the expansion left alone keep their mask, tokens it added are context. Image placeholder
tokens are never trained (a draft cannot predict what an image embeds to).

`SampleMedia` is what the prepared dataset keeps per image sample (data contract 1): the
processor's outputs, so extraction runs the vision tower on exactly what prepare saw, and the image
files, for engines that run their own processor (vLLM).
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.data.chat import ChatEncoder, Encoded, loop_tails
from eyas.data.readers import BadRow
from eyas.utils.io import EyasError

FILES, FILE_SIZES = "image_files", "image_file_sizes"  # the image files, bytes concatenated, and each one's size
SKIPPED_OUTPUTS = ("input_ids", "attention_mask")  # in the token shard / not needed for a batch of one


@dataclass
class SampleMedia:
    """One sample's images.

    inputs:     the processor's outputs besides input_ids / attention_mask: rows per image or patch
                (pixel_values, image_grid_thw, ...) and, for `token_keys`, one value per token [T]
                (Gemma3's token_type_ids, Qwen2.5-VL's mm_token_type_ids)
    token_keys: which inputs are per token (they get a batch dim like input_ids, and are cut with it)
    files:      the images' original file bytes
    """

    inputs: dict[str, torch.Tensor]
    token_keys: tuple[str, ...] = ()
    files: list[bytes] = field(default_factory=list)

    def rows(self) -> dict[str, np.ndarray]:
        """Every array this sample adds to its media shard (rows along dim 0)."""
        files = np.frombuffer(b"".join(self.files), dtype=np.uint8)
        sizes = np.array([len(f) for f in self.files], dtype=np.int64)
        return {**{k: v.numpy() for k, v in self.inputs.items()}, FILES: files, FILE_SIZES: sizes}

    @classmethod
    def from_rows(cls, rows: dict[str, torch.Tensor], token_keys: tuple[str, ...]) -> SampleMedia:
        blob, sizes = rows.pop(FILES).numpy().tobytes(), rows.pop(FILE_SIZES).tolist()
        ends = np.cumsum([0, *sizes]).tolist()
        return cls(rows, token_keys, [blob[a:b] for a, b in zip(ends[:-1], ends[1:], strict=True)])

    def model_inputs(self, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """Keyword arguments of the target's forward for this one sample (batch of 1)."""
        out = {}
        for k, v in self.inputs.items():
            t = v[None] if k in self.token_keys else v
            out[k] = t.to(device, dtype if t.is_floating_point() else t.dtype)
        return out

    def images(self) -> list[Any]:
        """The images as PIL images (RGB)."""
        from PIL import Image

        return [Image.open(io.BytesIO(f)).convert("RGB") for f in self.files]


@dataclass
class EncodedImages(Encoded):
    """A prepared sample (expanded tokens, loss mask) with its images."""

    media: SampleMedia | None = None


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) for m in messages)


def image_sources(messages: list[dict]) -> list[str]:
    return [p["image"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p["type"] == "image"]


def image_token_ids(config: Any) -> tuple[int, ...]:
    """The ids a target's processor expands images (and videos) into; () for a text-only target."""
    if config is None or getattr(config, "vision_config", None) is None:
        return ()
    keys = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    return tuple(sorted({i for k in keys if isinstance(i := getattr(config, k, None), int)}))


def target_image_token_ids(model: str) -> tuple[int, ...]:
    """image_token_ids of a model folder or cached hub id; () when it has no config (a tokenizer alone)."""
    try:
        from transformers import AutoConfig

        return image_token_ids(AutoConfig.from_pretrained(model))
    except (OSError, ValueError):
        return ()


@functools.lru_cache(maxsize=2)
def load_processor(model: str) -> Any:
    """The target's own processor (tokenizer + image processor), loaded once per process."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model)
    except (ImportError, ValueError) as e:  # transformers says a missing torchvision with a ValueError
        if isinstance(e, ImportError) or "torchvision" in str(e):
            need = "torchvision" if "torchvision" in str(e) else str(e).strip().splitlines()[0][:200]
            raise EyasError(f"the image processor of '{model}' needs {need}, which is not installed here. Images go "
                            "through the target's own processor: install it (torchvision: the build that matches "
                            "your torch), or drop the image rows.") from e
        raise EyasError(f"'{model}' has no processor transformers can load (ValueError: {str(e)[:300]}); images "
                        "need the target's processor files (preprocessor_config.json) next to it") from e
    except (OSError, TypeError) as e:
        raise EyasError(f"'{model}' has no processor transformers can load ({type(e).__name__}: {str(e)[:300]}); "
                        "images need the target's processor files (preprocessor_config.json) next to it") from e


def read_image(source: str, base: Path | None) -> bytes:
    """The file bytes of an image given as a path (relative to the chat file's folder), file:// or data URL."""
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise BadRow("image_unreadable", f"a data URL that is not base64 ({header[:40]})")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadRow("image_unreadable", f"a base64 data URL that does not decode ({e})") from None
    if source.startswith(("http://", "https://")):
        raise BadRow("image_unreadable", f"{source[:80]}: eyas does not download images; save them and give paths")
    path = Path(source.removeprefix("file://")).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    try:
        return path.read_bytes()
    except OSError as e:
        raise BadRow("image_unreadable", f"{path}: {e.strerror or e}") from None


def _open(data: bytes, source: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        return img
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise BadRow("image_unreadable", f"{source[:80]}: not an image PIL can read ({e})") from None


def carry_mask(ids: np.ndarray, mask: np.ndarray, expanded: np.ndarray) -> np.ndarray:
    """`mask` (over `ids`) carried over to `expanded`, the same text with its image placeholders
    expanded: tokens the expansion left in place keep their value, tokens it added get 0."""
    from difflib import SequenceMatcher

    out = np.zeros(len(expanded), dtype=np.uint8)
    matcher = SequenceMatcher(None, ids.tolist(), expanded.tolist(), autojunk=False)
    for a, b, n in matcher.get_matching_blocks():
        out[b:b + n] = mask[a:a + n]
    lost = int(mask.sum()) - int(out.sum())
    if lost:
        raise BadRow("mask_not_found", f"the processor's image expansion changed {lost} trained token(s)")
    return out


class ImageEncoder:
    """Conversations with images -> samples with media, through the target's processor (loaded on the
    first image: a dataset without images never needs it)."""

    def __init__(self, chat: ChatEncoder, model: str, placeholder_ids: tuple[int, ...]) -> None:
        self.chat, self.model, self.placeholder_ids = chat, model, placeholder_ids

    def encode(self, messages: list[dict], where: str) -> EncodedImages:
        """One conversation; raises BadRow when it cannot be used."""
        sources = image_sources(messages)
        if not self.placeholder_ids:
            raise BadRow("image_for_text_target", f"{len(sources)} image(s), but '{self.model}' reads only text")
        base = Path(where.rsplit(":", 1)[0]).parent if ":" in where else None
        files = [read_image(s, base) for s in sources]
        images = [_open(f, s) for f, s in zip(files, sources, strict=True)]
        text, spans = self.chat.assistant_spans(messages)
        ids, mask = self.chat.token_mask(text, spans)
        try:
            out = load_processor(self.model)(text=[text], images=images, return_tensors="pt",
                                             add_special_tokens=False)
        except (ValueError, TypeError) as e:  # e.g. placeholders and images do not pair up
            raise BadRow("template_rejects", f"the processor refused the text and its {len(images)} image(s): "
                                             f"{str(e)[:200]}") from None
        expanded = out["input_ids"][0].numpy().astype(np.int32)
        mask = carry_mask(ids, mask, expanded)
        mask[np.isin(expanded, self.placeholder_ids)] = 0
        T = len(expanded)
        inputs = {k: torch.as_tensor(v) for k, v in out.items() if k not in SKIPPED_OUTPUTS}
        token_keys = tuple(k for k, v in inputs.items() if v.dim() >= 2 and tuple(v.shape[:2]) == (1, T))
        inputs.update({k: inputs[k][0] for k in token_keys})
        return self._finish(expanded, mask, SampleMedia(inputs, token_keys, files))

    def _finish(self, ids: np.ndarray, mask: np.ndarray, media: SampleMedia) -> EncodedImages:
        """What ChatEncoder does after tokenizing (loop tails, --max-length), on the per-token inputs too."""
        n, keep = len(ids), np.ones(len(ids), dtype=bool)  # keep: the tokens that stay
        if self.chat.trim_loops is not None:
            keep = ~loop_tails(ids, mask, self.chat.trim_loops)
        trimmed = n - int(keep.sum())
        limit = self.chat.max_length
        truncated = limit is not None and int(keep.sum()) > limit
        if truncated:
            if self.chat.overlong == "drop":
                raise BadRow("overlong", f"more than --max-length {limit:,} tokens")
            cut = np.flatnonzero(keep)[limit]
            if np.isin(ids[cut:], self.placeholder_ids).any():
                raise BadRow("image_cut", f"the first {limit:,} tokens end before an image's last placeholder "
                                          "token; raise --max-length")
            keep[cut:] = False
        ids, mask = ids[keep], mask[keep]
        for k in media.token_keys:
            media.inputs[k] = media.inputs[k][torch.from_numpy(keep)]
        if not mask.any():
            raise BadRow("no_loss_tokens", f"no assistant token within the first {len(ids):,} tokens")
        return EncodedImages(ids, mask, truncated, trimmed, media)
