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

import hashlib
import json
import os
import queue
import shutil
import struct
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.engines.head import TargetHead
from eyas.utils.io import EyasError, atomic_write_json, check_free_disk, human_bytes, read_json, sha256_file

FORMAT = "eyas.hidden/1"
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8_e4m3fn

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


def plan_shards(lengths: np.ndarray, bytes_per_token: int, shard_bytes: int, min_shards: int = 1) -> list[ShardSpec]:
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
# fp8 with per-token scales
# ---------------------------------------------------------------------------------------------


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, g*H] -> (float8_e4m3fn [N, g*H], float32 scale [N, g]): one scale per token and layer,
    so a layer with large activations does not crush the others' precision."""
    n = x.shape[0]
    xv = x.reshape(n, groups, -1).float()  # [N, g, H]
    scale = xv.abs().amax(-1).clamp(min=1e-12) / FP8_MAX  # [N, g]
    q = (xv / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, -1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(float8 [T, g*H], scale [T, g]) -> dtype [T, g*H]."""
    t, g = scale.shape
    return (q.reshape(t, g, -1).float() * scale[..., None].float()).reshape(t, -1).to(dtype)


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
# the reader
# ---------------------------------------------------------------------------------------------


class HiddenStore:
    """Random access by sample into a finished store; shards are memory-mapped and opened lazily.

    store[i] -> {"input_ids": LongTensor[T], "loss_mask": BoolTensor[T],
                 "aux_hidden": bf16 [T, k*H], "final_hidden": bf16 [T, H]}   (fp8 is dequantized)

    `aux_layer_ids` reads only some of the stored layers (k of them, in layer order): a store
    extracted once with extra layers trains drafts on different choices.
    """

    def __init__(self, path: str | os.PathLike, aux_layer_ids: list[int] | None = None) -> None:
        self.path = Path(path)
        mpath = self.path / "manifest.json"
        if not mpath.is_file():
            hint = " (an unfinished extraction is in " + str(self.path) + ".partial: rerun `eyas extract`)" if \
                Path(str(self.path) + ".partial").exists() else ""
            raise EyasError(f"{mpath} not found: {self.path} is not a finished eyas hidden-state store{hint}")
        self.manifest = read_json(mpath)
        if self.manifest.get("format") != FORMAT:
            raise EyasError(f"{mpath}: format is {self.manifest.get('format')!r}, expected {FORMAT!r}")
        m = self.manifest
        stored = list(m["aux_layer_ids"])
        self.aux_layer_ids: list[int] = stored if aux_layer_ids is None else [int(i) for i in aux_layer_ids]
        self._aux_pick: torch.Tensor | None = None  # indices of the read layers among the stored ones
        if self.aux_layer_ids != stored:
            from eyas.engines.base import validate_aux_layer_ids

            validate_aux_layer_ids(self.aux_layer_ids, int(m["num_layers"]))
            missing = [i for i in self.aux_layer_ids if i not in stored]
            if missing:
                raise EyasError(f"the store {self.path} holds aux layers {stored}, not {missing}: pick among those, "
                                f"or extract again with --aux-layers {','.join(map(str, self.aux_layer_ids))}")
            self._aux_pick = torch.tensor([stored.index(i) for i in self.aux_layer_ids])
        self.hidden_size: int = int(m["hidden_size"])
        self.dtype: str = m["dtype"]
        self.shards: list[dict] = m["shards"]
        self._handles: dict[int, Any] = {}
        lengths = []
        for j, s in enumerate(self.shards):
            off = self._open(j).get_tensor("offsets").numpy()
            if len(off) != s["num_samples"] + 1 or int(off[-1]) != s["num_tokens"]:
                raise EyasError(f"{self.path / s['file']}: offsets disagree with manifest.json; run "
                                f"`eyas extract --out {self.path} --verify`")
            lengths.append(np.diff(off))
        self.lengths: np.ndarray = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self._first = np.array([s["first_sample"] for s in self.shards], dtype=np.int64)
        self._offsets = [None] * len(self.shards)

    def __getstate__(self) -> dict[str, Any]:  # picklable for DataLoader workers: they reopen the shards
        return {**self.__dict__, "_handles": {}}

    def _open(self, j: int) -> Any:
        from safetensors import safe_open

        h = self._handles.get(j)
        if h is None:
            h = self._handles[j] = safe_open(str(self.path / self.shards[j]["file"]), framework="pt")
        return h

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a store of {n} samples")
        i %= n
        j = int(np.searchsorted(self._first, i, side="right") - 1)
        f = self._open(j)
        if self._offsets[j] is None:
            self._offsets[j] = f.get_tensor("offsets").tolist()
        local = i - int(self._first[j])
        a, b = self._offsets[j][local], self._offsets[j][local + 1]
        aux, final = f.get_slice("aux_hidden")[a:b], f.get_slice("final_hidden")[a:b]
        if self.dtype == "float8_e4m3fn":
            aux = dequantize_fp8(aux, f.get_slice("aux_scale")[a:b])
            final = dequantize_fp8(final, f.get_slice("final_scale")[a:b])
        if self._aux_pick is not None:  # [T, k_stored*H] -> [T, k*H]
            aux = aux.view(b - a, -1, self.hidden_size).index_select(1, self._aux_pick).reshape(b - a, -1)
        return {
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
            "aux_hidden": aux,
            "final_hidden": final,
        }

    def target_head(self) -> TargetHead:
        from safetensors.torch import load_file

        t = load_file(str(self.path / "target_head.safetensors"))
        m = self.manifest
        return TargetHead(t["embed_tokens.weight"], t["norm.weight"], t["lm_head.weight"], float(m["norm_eps"]),
                          float(m.get("norm_offset", 0.0)), float(m.get("embed_scale", 1.0)))

    def verify(self) -> int:
        """Recompute every shard's sha256 against the manifest; raise EyasError naming each bad shard.
        Returns the number of files checked."""
        return verify_store(self.path)


def verify_store(path: str | os.PathLike) -> int:
    path = Path(path)
    m = read_json(path / "manifest.json")
    bad: list[str] = []
    for s in m["shards"]:
        f = path / s["file"]
        if not f.is_file():
            bad.append(f"{s['file']}: missing")
        elif sha256_file(f) != s["sha256"]:
            bad.append(f"{s['file']}: sha256 differs from manifest.json (corrupted or modified)")
    head = path / "target_head.safetensors"
    if m.get("target_head_sha256") and (not head.is_file() or sha256_file(head) != m["target_head_sha256"]):
        bad.append("target_head.safetensors: missing or sha256 differs from manifest.json")
    if bad:
        raise EyasError(f"store {path} failed verification ({len(bad)} bad file(s)):\n  " + "\n  ".join(bad)
                        + "\nRe-extract: delete the store folder and rerun `eyas extract` (finished shards of an "
                          "interrupted run are kept in OUT.partial, a finished store is rebuilt).")
    return len(m["shards"]) + 1


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
        todo = [s for s in self.plan if not self.done(s)]
        return sum(s.num_tokens for s in todo) * self.meta.bytes_per_token() + 4096 * len(todo)

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
        sha, nbytes = write_safetensors(tmp, buf.tensors(), {"format": FORMAT})
        os.replace(tmp, self.partial / s.file)
        rec = {"file": s.file, "sha256": sha, "first_sample": s.first_sample, "num_samples": s.num_samples,
               "num_tokens": s.num_tokens, "bytes": nbytes}
        atomic_write_json(self.partial / f"{s.file[:-12]}.json", rec)
        with self._lock:
            self.bytes_written += nbytes

    # -- the end --
    def finalize(self, head: TargetHead) -> Path:
        """Rank 0, after all ranks closed: manifest + target head, then OUT.partial -> OUT atomically."""
        missing = [s.file for s in self.plan if not self.done(s)]
        if missing:
            raise EyasError(f"{len(missing)} shard(s) were not written (e.g. {missing[0]}); rerun the same "
                            "`eyas extract` command to finish them")
        shards = [{k: v for k, v in read_json(self.partial / f"{s.file[:-12]}.json").items() if k != "bytes"}
                  for s in self.plan]
        head_sha, _ = write_safetensors(self.partial / "target_head.safetensors",
                                        {k: v.to(torch.bfloat16) for k, v in head.state_dict().items()})
        manifest = {"format": FORMAT, **asdict(self.meta),
                    "num_samples": int(sum(s.num_samples for s in self.plan)),
                    "num_tokens": int(sum(s.num_tokens for s in self.plan)),
                    "shards": shards, "target_head_sha256": head_sha}
        atomic_write_json(self.partial / "manifest.json", manifest)
        for f in self.partial.glob("shard-*.json"):
            f.unlink()
        (self.partial / "plan.json").unlink(missing_ok=True)
        if self.out.exists():
            old = self.out.with_name(f".old-{self.out.name}-{os.getpid()}")
            os.replace(self.out, old)
            os.replace(self.partial, self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.partial, self.out)
        return self.out


def partial_dir(out: str | os.PathLike) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".partial")


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


def load_plan(out: str | os.PathLike) -> list[ShardSpec]:
    return [ShardSpec(**s) for s in read_json(partial_dir(out) / "plan.json")["shards"]]


def check_disk_for(writer: StoreWriter, log: Callable[[str], None] = print) -> int:
    """Print the disk the remaining shards need; refuse (EyasError) when the free space is short."""
    need = writer.bytes_needed()
    free = shutil.disk_usage(writer.partial).free
    log(f"store {writer.out}: needs about {human_bytes(need)} of disk ({human_bytes(free)} free)")
    check_free_disk(writer.partial, need, f"extracting hidden states into {writer.out}")
    return need
