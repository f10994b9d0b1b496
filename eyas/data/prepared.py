"""The prepared dataset (data contract 1 in docs/architecture.md): tokens + loss mask, sharded safetensors.

Written once by `eyas prepare` through `PreparedWriter`, read by extract/train/eval through
`PreparedDataset`, which opens shards lazily and reads samples as slices of memory-mapped files, so a
dataset far larger than RAM costs only its offsets in memory.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from eyas.data.media import FILE_SIZES, SampleMedia
from eyas.utils.io import EyasError, atomic_write_json, read_json
from eyas.utils.tensorfile import check_tensor_file

FORMAT = "eyas.prepared/1"
SHARD_TOKENS = 1 << 26  # 64M tokens = 320 MB per shard (int32 ids + uint8 mask)


class PreparedWriter:
    """Appends samples into `shard-NNNNN.safetensors` files inside `folder` (a fresh, empty folder).

    Call `add` per sample (or `add_many` per batch), then `finish(**manifest_fields)` once; write into
    the temporary folder of `eyas.utils.io.atomic_path` so a crash leaves no partial dataset. Samples
    with images (`media`) add a `media-NNNNN.safetensors` next to their shard; `image_token_ids`
    (the target's placeholder ids) then go into the manifest's "media" entry.
    """

    def __init__(self, folder: str | os.PathLike, vocab_size: int, shard_tokens: int = SHARD_TOKENS,
                 image_token_ids: tuple[int, ...] = ()) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.vocab_size = vocab_size
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.counts = np.zeros(vocab_size, dtype=np.int64)  # [V] frequency of loss-masked token ids
        self.num_samples = self.num_tokens = self.num_loss_tokens = 0
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._media: list[SampleMedia | None] = []
        self._pending = 0
        self.image_token_ids = [int(i) for i in image_token_ids]
        self.media_samples = self.media_images = 0
        self.token_keys: set[str] = set()

    def add(self, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
        self.add_many(input_ids, loss_mask, np.array([len(input_ids)], dtype=np.int64))

    def add_many(self, input_ids: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray,
                 media: list[SampleMedia | None] | None = None) -> None:
        """Samples given concatenated: input_ids int32 [N_tok], loss_mask uint8 [N_tok], lengths [n];
        media: each sample's images (None for a text-only sample)."""
        input_ids = np.asarray(input_ids, dtype=np.int32)
        loss_mask = np.asarray(loss_mask, dtype=np.uint8)
        lengths = np.asarray(lengths, dtype=np.int64)
        if input_ids.shape != loss_mask.shape or int(lengths.sum()) != len(input_ids):
            raise ValueError("input_ids, loss_mask and lengths do not agree")
        if len(input_ids) and (int(input_ids.max()) >= self.vocab_size or int(input_ids.min()) < 0):
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        self.counts += np.bincount(input_ids[loss_mask.astype(bool)], minlength=self.vocab_size)
        self.num_loss_tokens += int(loss_mask.sum())
        self.num_samples += len(lengths)
        self.num_tokens += len(input_ids)
        # Split at sample boundaries so no sample straddles two shards.
        start = 0
        for j, n in enumerate(lengths.tolist()):
            self._ids.append(input_ids[start : start + n])
            self._mask.append(loss_mask[start : start + n])
            self._add_media(media[j] if media is not None else None)
            start += n
            self._pending += n
            if self._pending >= self.shard_tokens:
                self._flush()

    def _flush(self) -> None:
        if not self._ids:
            return
        lengths = np.array([len(x) for x in self._ids], dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        name = f"shard-{len(self.shards):05d}.safetensors"
        save_file(
            {"input_ids": np.concatenate(self._ids), "loss_mask": np.concatenate(self._mask), "offsets": offsets},
            str(self.folder / name), metadata={"format": FORMAT},
        )  # fmt: skip
        self.shards.append({"file": name, "num_samples": len(lengths), "num_tokens": int(offsets[-1])})
        if any(m is not None for m in self._media):
            self.shards[-1]["media"] = self._write_media(len(self.shards) - 1)
        self._ids, self._mask, self._media, self._pending = [], [], [], 0

    def _add_media(self, media: SampleMedia | None) -> None:
        self._media.append(media)
        if media is not None:
            self.media_samples += 1
            self.media_images += len(media.files)
            self.token_keys.update(media.token_keys)

    def _write_media(self, shard: int) -> str:
        """The shard's images: every array K concatenated over its samples, with `K.offsets` [n+1] giving
        sample i's rows [offsets[i], offsets[i+1]) (empty for a text-only sample)."""
        rows = [m.rows() if m is not None else {} for m in self._media]
        tensors = {}
        for key in sorted({k for r in rows for k in r}):
            tensors[key] = np.concatenate([r[key] for r in rows if key in r])
            sizes = [len(r[key]) if key in r else 0 for r in rows]
            tensors[key + ".offsets"] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        name = f"media-{shard:05d}.safetensors"
        save_file(tensors, str(self.folder / name), metadata={"format": FORMAT})
        return name

    def finish(self, **manifest_fields: Any) -> dict[str, Any]:
        """Write the last shard, token_counts.safetensors and manifest.json; returns the manifest."""
        self._flush()
        save_file({"counts": self.counts}, str(self.folder / "token_counts.safetensors"))
        manifest = {
            "format": FORMAT,
            **manifest_fields,
            "vocab_size": self.vocab_size,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "num_loss_tokens": self.num_loss_tokens,
            "shards": self.shards,
        }
        if self.media_samples:  # only datasets with images: a text-only manifest stays as it was
            manifest["media"] = {"num_samples": self.media_samples, "num_images": self.media_images,
                                 "token_keys": sorted(self.token_keys), "image_token_ids": self.image_token_ids}
        atomic_write_json(self.folder / "manifest.json", manifest)
        return manifest


class PreparedDataset:
    """`ds[i] -> {"input_ids": LongTensor[T], "loss_mask": BoolTensor[T]}`, read lazily from mmapped shards."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.is_file():
            raise EyasError(f"{self.path} is not a prepared dataset (no manifest.json). Run `eyas prepare` first.")
        self.manifest: dict[str, Any] = read_json(manifest_path)
        if self.manifest.get("format") != FORMAT:
            raise EyasError(f"{manifest_path}: format {self.manifest.get('format')!r}, expected {FORMAT!r}. "
                            "Re-run `eyas prepare` with this version of eyas.")  # fmt: skip
        self._offsets: list[np.ndarray] = []  # per shard, int64 [n_s + 1]
        fix = f"The prepared dataset is damaged: delete {self.path} and rerun the `eyas prepare` command that made it."
        for shard in self.manifest["shards"]:
            n = int(shard["num_tokens"])
            check_tensor_file(self.path / shard["file"], {"input_ids": ("I32", (n,)), "loss_mask": ("U8", (n,)),
                                                          "offsets": ("I64", (int(shard["num_samples"]) + 1,))}, fix)
            with safe_open(self.path / shard["file"], framework="np") as f:
                self._offsets.append(f.get_tensor("offsets"))
        counts = [len(o) - 1 for o in self._offsets]
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64).tolist()  # first sample per shard
        self.lengths: np.ndarray = (
            np.concatenate([np.diff(o) for o in self._offsets]) if self._offsets else np.zeros(0, np.int64)
        )  # int64 [n]
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return self._first[-1]

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    def _handle(self, s: int) -> Any:
        if s not in self._handles:
            self._handles[s] = safe_open(self.path / self.manifest["shards"][s]["file"], framework="pt")
        return self._handles[s]

    def locate(self, i: int) -> tuple[int, int, int]:
        """(shard index, first token, end token) of sample i."""
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        s = bisect.bisect_right(self._first, i) - 1
        off = self._offsets[s]
        j = i - self._first[s]
        return s, int(off[j]), int(off[j + 1])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s, a, b = self.locate(i)
        h = self._handle(s)
        return {
            "input_ids": h.get_slice("input_ids")[a:b].long(),  # [T]
            "loss_mask": h.get_slice("loss_mask")[a:b].bool(),  # [T]
        }

    @property
    def has_media(self) -> bool:
        """True when some samples hold images (their vision inputs are in media shards)."""
        return "media" in self.manifest

    def media(self, i: int) -> SampleMedia | None:
        """Sample i's images and the vision tower's inputs, or None for a text-only sample."""
        s, _, _ = self.locate(i)
        file = self.manifest["shards"][s].get("media")
        if file is None:
            return None
        key = ("media", s)
        if key not in self._handles:
            h = safe_open(self.path / file, framework="pt")
            self._handles[key] = (h, {k[:-len(".offsets")]: h.get_tensor(k).tolist() for k in h.keys()  # noqa: SIM118
                                      if k.endswith(".offsets")})
        h, offsets = self._handles[key]
        j = i - self._first[s]
        if offsets[FILE_SIZES][j] == offsets[FILE_SIZES][j + 1]:
            return None
        rows = {k: h.get_slice(k)[o[j]:o[j + 1]] for k, o in offsets.items()}
        return SampleMedia.from_rows(rows, tuple(self.manifest["media"]["token_keys"]))

    def token_counts(self) -> torch.Tensor:
        """LongTensor [vocab_size]: how often each token id is trained (under the loss mask)."""
        with safe_open(self.path / "token_counts.safetensors", framework="pt") as f:
            return f.get_tensor("counts").long()

    def __getstate__(self) -> dict[str, Any]:  # picklable for DataLoader workers: reopen shards there
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state
