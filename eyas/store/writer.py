"""The hidden-state store: sharded safetensors + a manifest (data contract 2 in docs/architecture.md).

Writing is built for a long extraction that may be killed at any point:
- the sample range of every shard is fixed up front (`plan.json`), so a resumed or multi-rank run
  writes exactly the shards an uninterrupted single run would;
- each shard is written to a temporary name and renamed, then a small record (sha256, counts) is
  written next to it: a shard without its record does not exist;
- everything lives in `OUT.partial/` until the last shard is done; then the manifest is written and
  the folder is renamed to OUT, so OUT is either the old store, or the complete new one.

Shards are written from (pinned) host buffers by a writer thread while the target computes the
next batches; the sha256 is computed while the bytes are written, not in a second pass.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import queue
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.engines.head import TargetHead
from eyas.store.format import FORMAT, STORE_DTYPES
from eyas.utils.io import (
    EyasError,
    atomic_write_json,
    check_free_disk,
    human_bytes,
    read_json,
    remove_leftovers,
    replace_path,
)

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
              torch.int64: "I64", torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}


# ---------------------------------------------------------------------------------------------
# metadata and plan
# ---------------------------------------------------------------------------------------------


@dataclass
class StoreMeta:
    """What the manifest says about the target and the options (everything but the shard list)."""

    target: str
    target_config_sha256: str
    num_layers: int
    aux_layer_ids: list[int]
    hidden_size: int
    vocab_size: int
    dtype: str  # "bfloat16" | "float8_e4m3fn"
    prepared: str
    prepared_sha256: str
    norm_eps: float
    options_sha256: str
    norm_offset: float = 0.0  # TargetHead extras (Gemma: 1 + w norm, scaled embeddings)
    embed_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype not in STORE_DTYPES:
            raise EyasError(f"store dtype '{self.dtype}' is not one of {sorted(STORE_DTYPES)}")

    @property
    def fp8(self) -> bool:
        return self.dtype == "float8_e4m3fn"

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def bytes_per_token(self) -> int:
        """Disk bytes per token: states (+ fp8 scales), input_ids int32, loss_mask uint8."""
        k, h = self.num_aux, self.hidden_size
        states = (k + 1) * h * (1 if self.fp8 else 2)
        return states + (4 * (k + 1) if self.fp8 else 0) + 4 + 1


@dataclass
class ShardSpec:
    index: int
    first_sample: int
    num_samples: int
    num_tokens: int

    @property
    def file(self) -> str:
        return f"shard-{self.index:05d}.safetensors"


SMALL_FILE = 4096  # a safetensors header, a shard's record, the plan, the manifest's entry: a few KiB at most


def store_file_bytes(meta: StoreMeta, shards: list[ShardSpec]) -> dict[str, int]:
    """Bytes of each file a finished store holds for `shards` (states, token ids, loss mask, offsets and
    header), its target head (embed_tokens and lm_head [V, H] + norm [H], bf16) and its manifest: the one
    formula extract's disk check and `eyas plan` both count with."""
    files = {s.file: s.num_tokens * meta.bytes_per_token() + 8 * (s.num_samples + 1) + SMALL_FILE for s in shards}
    v, h = meta.vocab_size, meta.hidden_size
    files["target_head.safetensors"] = 2 * (2 * v * h + h) + SMALL_FILE
    files["manifest.json"] = SMALL_FILE + 256 * len(shards)
    return files


def split_shards(lengths: np.ndarray, bytes_per_token: int, shard_bytes: int, min_shards: int = 1) -> list[ShardSpec]:
    """Cut samples [0, n) into contiguous shards of about `shard_bytes` (at least `min_shards`, so
    every rank gets work). A shard closes once it reaches the size, so e.g. 8 sequences of 2048
    tokens share one shard rather than 7 + a remainder. Depends only on these inputs."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    per_shard = max(1, shard_bytes // max(1, bytes_per_token))
    if min_shards > 1:  # best effort with uneven lengths
        per_shard = min(per_shard, max(1, total // min_shards))
    shards: list[ShardSpec] = []
    first, tokens = 0, 0
    for i, n in enumerate(lengths.tolist()):
        tokens += n
        if tokens >= per_shard:
            shards.append(ShardSpec(len(shards), first, i + 1 - first, tokens))
            first, tokens = i + 1, 0
    if first < len(lengths) or not shards:
        shards.append(ShardSpec(len(shards), first, len(lengths) - first, tokens))
    return shards


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


# ---------------------------------------------------------------------------------------------
# safetensors, written in one streaming pass with its sha256
# ---------------------------------------------------------------------------------------------


def _raw(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)).cast("B")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                      chunk: int = 64 << 20) -> tuple[str, int]:
    """Write a safetensors file (readable by `safetensors.safe_open`) and return (sha256, bytes).

    The hash runs in a second thread on the same chunks while this one writes them (hashlib and
    file writes release the GIL), so hashing costs no extra pass over the data.
    """
    header: dict[str, Any] = {}
    start = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [start, start + nbytes]}
        start += nbytes
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    head = struct.pack("<Q", len(hb)) + hb

    h = hashlib.sha256()
    chunks: queue.Queue = queue.Queue(maxsize=8)

    def hasher() -> None:
        while (c := chunks.get()) is not None:
            h.update(c)

    th = threading.Thread(target=hasher, daemon=True)
    th.start()
    try:
        with open(path, "wb") as f:
            chunks.put(head)
            f.write(head)
            for t in tensors.values():
                mv = _raw(t)
                for a in range(0, len(mv), chunk):
                    piece = mv[a:a + chunk]
                    chunks.put(piece)
                    f.write(piece)
    finally:
        chunks.put(None)
        th.join()
    return h.hexdigest(), len(head) + start


# ---------------------------------------------------------------------------------------------
# the writer
# ---------------------------------------------------------------------------------------------


class ShardBuffer:
    """Host memory for one shard, filled sample by sample (D2H copies land here directly)."""

    def __init__(self, meta: StoreMeta, capacity: int, pin: bool) -> None:
        k, h = meta.num_aux, meta.hidden_size
        sdt = STORE_DTYPES[meta.dtype]

        def empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, pin_memory=pin)

        self.aux = empty((capacity, k * h), sdt)  # [cap, k*H]
        self.final = empty((capacity, h), sdt)  # [cap, H]
        self.aux_scale = empty((capacity, k), torch.float32) if meta.fp8 else None
        self.final_scale = empty((capacity, 1), torch.float32) if meta.fp8 else None
        self.input_ids = torch.empty(capacity, dtype=torch.int32)
        self.loss_mask = torch.empty(capacity, dtype=torch.uint8)
        self.nonfinite = empty((1,), torch.int64)  # written by the device, checked by the writer
        self.capacity = capacity
        self.shard: ShardSpec | None = None
        self.offsets: np.ndarray | None = None  # [n+1] shard-local

    def tensors(self) -> dict[str, torch.Tensor]:
        n = self.shard.num_tokens
        out = {"input_ids": self.input_ids[:n], "loss_mask": self.loss_mask[:n],
               "offsets": torch.from_numpy(self.offsets), "aux_hidden": self.aux[:n], "final_hidden": self.final[:n]}
        if self.aux_scale is not None:
            out["aux_scale"] = self.aux_scale[:n]
            out["final_scale"] = self.final_scale[:n]
        return out


class StoreWriter:
    """Writes shards of OUT.partial/ from background threads; rank 0 turns the folder into OUT.

    Usage (per rank): `for shard in w.todo(): buf = w.acquire(shard); ...fill buf...; w.submit(buf, event)`,
    then `w.close()`, and on rank 0 after every rank closed, `w.finalize(head)`.
    """

    def __init__(self, out: str | os.PathLike, meta: StoreMeta, lengths: np.ndarray, plan: list[ShardSpec],
                 rank: int = 0, world: int = 1, pin: bool = False, num_writers: int = 2,
                 on_shard: Callable[[ShardSpec], None] | None = None) -> None:
        self.out = Path(out)
        self.partial = partial_dir(self.out)
        self.meta, self.plan, self.rank, self.world = meta, plan, rank, world
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.pin, self.on_shard = pin, on_shard
        self.capacity = max((s.num_tokens for s in plan), default=1) or 1
        self._free: queue.Queue = queue.Queue()
        # one buffer per writer thread + the one being filled: the device never waits for the disk
        # unless the disk is slower than the device for good
        self._num_buffers, self._made = num_writers + 1, 0
        if pin:  # pinning is slow (page locking): do it once, before the timed loop
            for _ in range(min(self._num_buffers, len(plan))):
                self._free.put(ShardBuffer(meta, self.capacity, pin))
                self._made += 1
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.bytes_written = 0
        # several writers: each hashes its own shard, so sha256 (~2 GB/s per core) is not the limit
        self._threads = [threading.Thread(target=self._work, name=f"eyas-store-writer-{i}", daemon=True)
                         for i in range(num_writers)]
        for t in self._threads:
            t.start()

    # -- state on disk --
    def done(self, shard: ShardSpec) -> bool:
        rec, f = self.partial / f"{shard.file[:-12]}.json", self.partial / shard.file
        return rec.is_file() and f.is_file() and f.stat().st_size == read_json(rec).get("bytes", -1)

    def todo(self) -> list[ShardSpec]:
        """This rank's shards (every world-th one) that no earlier run finished."""
        return [s for s in self.plan if s.index % self.world == self.rank and not self.done(s)]

    def bytes_needed(self) -> int:
        """Disk still needed: the unwritten shards and their records, the target head, plan and manifest."""
        todo = [s for s in self.plan if not self.done(s)]
        return sum(store_file_bytes(self.meta, todo).values()) + SMALL_FILE * (len(todo) + 1)  # records, plan

    # -- buffers --
    def acquire(self, shard: ShardSpec) -> ShardBuffer:
        """A free host buffer for `shard` (blocks while the writer still holds all of them)."""
        self._raise_if_failed()
        if self._free.empty() and self._made < self._num_buffers:
            self._free.put(ShardBuffer(self.meta, self.capacity, self.pin))
            self._made += 1
        while True:
            try:
                buf = self._free.get(timeout=1.0)
                break
            except queue.Empty:
                self._raise_if_failed()
        buf.shard = shard
        buf.offsets = _offsets(self.lengths[shard.first_sample:shard.first_sample + shard.num_samples])
        buf.nonfinite.zero_()
        return buf

    def submit(self, buf: ShardBuffer, ready: Any = None) -> None:
        """Hand a filled buffer to the writer; `ready` (a CUDA event) says when the D2H copies are done."""
        self._raise_if_failed()
        self._jobs.put((buf, ready))

    def close(self) -> None:
        """Wait until every submitted shard is on disk; re-raise a writer error."""
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()
        self._raise_if_failed()

    def abort(self) -> None:
        """Stop the writer threads after the shards they are writing (finished shards stay for a resume)."""
        self._error = self._error or EyasError("extraction aborted")
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._error is not None:
                continue  # drain: after a failure nothing more is written
            buf, ready = job
            try:
                if ready is not None:
                    ready.synchronize()
                self._write(buf)
                if self.on_shard is not None:
                    self.on_shard(buf.shard)
            except BaseException as e:  # surfaced in the main thread at the next acquire/submit/close
                self._error = e
            finally:
                self._free.put(buf)

    def _write(self, buf: ShardBuffer) -> None:
        s = buf.shard
        if int(buf.nonfinite[0]):
            raise EyasError(f"the target produced non-finite hidden states (inf/nan) in samples "
                            f"{s.first_sample}..{s.first_sample + s.num_samples - 1}; check the model's dtype "
                            "(float16 overflows: use bfloat16) and its weights")
        tmp = self.partial / f".tmp-{s.file}"
        with self._space_for(tmp):
            sha, nbytes = write_safetensors(tmp, buf.tensors(), {"format": FORMAT})
            os.replace(tmp, self.partial / s.file)
            rec = {"file": s.file, "sha256": sha, "first_sample": s.first_sample, "num_samples": s.num_samples,
                   "num_tokens": s.num_tokens, "bytes": nbytes}
            atomic_write_json(self.partial / f"{s.file[:-12]}.json", rec)
        with self._lock:
            self.bytes_written += nbytes

    @contextlib.contextmanager
    def _space_for(self, path: Path) -> Iterator[None]:
        """Writing `path`: a full disk (another writer took the space the up-front check saw free) becomes
        one error naming the file and the space still needed; the half-written file is removed, and the
        finished shards stay for the rerun."""
        try:
            yield
        except OSError as e:
            path.unlink(missing_ok=True)
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):  # named here: the writer's own error names no file
                raise OSError(e.errno, e.strerror, str(e.filename or path)) from e
            kept = sum(1 for s in self.plan if self.done(s))
            free = shutil.disk_usage(self.partial).free
            raise EyasError(f"no space left writing {path}: the store needs about {human_bytes(self.bytes_needed())} "
                            f"more and {human_bytes(free)} is free. Free some space and rerun the same command: the "
                            f"{kept} finished shard(s) in {self.partial} are kept and the run resumes.") from None

    # -- the end --
    def finalize(self, head: TargetHead) -> Path:
        """Rank 0, after all ranks closed: manifest + target head, then OUT.partial -> OUT atomically."""
        missing = [s.file for s in self.plan if not self.done(s)]
        if missing:
            raise EyasError(f"{len(missing)} shard(s) were not written (e.g. {missing[0]}); rerun the same "
                            "`eyas extract` command to finish them")
        shards = [{k: v for k, v in read_json(self.partial / f"{s.file[:-12]}.json").items() if k != "bytes"}
                  for s in self.plan]
        with self._space_for(self.partial / "target_head.safetensors"):
            head_sha, _ = write_safetensors(self.partial / "target_head.safetensors",
                                            {k: v.to(torch.bfloat16) for k, v in head.state_dict().items()})
            manifest = {"format": FORMAT, **asdict(self.meta),
                        "num_samples": int(sum(s.num_samples for s in self.plan)),
                        "num_tokens": int(sum(s.num_tokens for s in self.plan)),
                        "shards": shards, "target_head_sha256": head_sha}
            atomic_write_json(self.partial / "manifest.json", manifest)
        return finish_partial(self.out)


def partial_dir(out: str | os.PathLike) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".partial")


def finish_partial(out: str | os.PathLike) -> Path:
    """OUT.partial, whose manifest is written, becomes OUT: the records and plan go, then one rename.
    Also what a rerun does when a kill came between the manifest and the rename."""
    out = Path(out)
    part = partial_dir(out)
    for f in part.glob("shard-*.json"):
        f.unlink()
    (part / "plan.json").unlink(missing_ok=True)
    remove_leftovers(out.parent)
    replace_path(part, out)
    return out


def finished_partial(out: str | os.PathLike, options_sha256: str) -> bool:
    """Does OUT.partial hold a complete store of these options (a run killed just before its rename)?"""
    m = partial_dir(out) / "manifest.json"
    return m.is_file() and read_json(m).get("options_sha256") == options_sha256


def prepare_partial(out: str | os.PathLike, meta: StoreMeta, plan: list[ShardSpec]) -> list[ShardSpec]:
    """Rank 0: create OUT.partial/plan.json, or reuse it if it was made with the same options (resume).

    Returns the plan that will be used; a partial state from other options is discarded.
    """
    part = partial_dir(out)
    pfile = part / "plan.json"
    if pfile.is_file():
        saved = read_json(pfile)
        if saved.get("options_sha256") == meta.options_sha256:
            for tmp in part.glob(".tmp-*"):  # a shard that was being written when the run died
                shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            return [ShardSpec(**s) for s in saved["shards"]]
        shutil.rmtree(part)
    elif part.exists():
        shutil.rmtree(part)
    part.mkdir(parents=True)
    atomic_write_json(pfile, {"options_sha256": meta.options_sha256, "meta": asdict(meta),
                              "shards": [asdict(s) for s in plan]})
    return plan


def load_shard_specs(out: str | os.PathLike) -> list[ShardSpec]:
    return [ShardSpec(**s) for s in read_json(partial_dir(out) / "plan.json")["shards"]]


def check_disk_for(writer: StoreWriter, log: Callable[[str], None] = print) -> int:
    """Print the disk the remaining shards need; refuse (EyasError) when the free space is short."""
    need = writer.bytes_needed()
    free = shutil.disk_usage(writer.partial).free
    log(f"store {writer.out}: needs about {human_bytes(need)} of disk ({human_bytes(free)} free)")
    check_free_disk(writer.partial, need, f"extracting hidden states into {writer.out}")
    return need
