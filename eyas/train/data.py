"""Training batches: samples packed side by side into rows of a fixed token budget.

Offline, every sample comes from the hidden-state store (tokens, loss mask, aux and final states);
online, from a prepared dataset, and the trainer fills in the states by running the target
(`fill_states`). Both build the very same packs, so they give the same loss on the same batch.

Packing instead of padding: a batch is ONE row of up to `token_budget` tokens holding several
samples (positions restart at 0 for each, attention is kept inside each by document ids), so
almost no compute goes to padding, and on GPU every batch has the same shape (padded to the budget)
so compiled kernels are built once. Samples are packed best-fit-decreasing inside windows of a
seeded shuffle: long and short samples share rows, the order stays random, nothing is sorted
globally.

The plan of an epoch depends only on (lengths, budget, seed, epoch), and a batch is addressed by
its index in that plan: a resumed run, or any number of ranks, read exactly the batches an
uninterrupted single-process run would have read. Samples are read lazily (memory-mapped shards)
in DataLoader worker processes that prefetch ahead of the GPU; nothing is ever loaded whole.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from eyas.utils.io import EyasError


def pack_window(lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Best-fit decreasing: indices into `lengths` grouped in bins of at most `budget` tokens."""
    order = np.argsort(-lengths, kind="stable")
    free: list[tuple[int, int]] = []  # (remaining capacity, bin id), sorted
    bins: list[list[int]] = []
    for i in order.tolist():
        n = int(min(lengths[i], budget))
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            cap, b = free.pop(k)
        else:
            cap, b = budget, len(bins)
            bins.append([])
        bins[b].append(i)
        if cap - n > 0:
            bisect.insort(free, (cap - n, b))
    return bins


def pack_epoch(lengths: np.ndarray, budget: int, seed: int, epoch: int, shuffle: bool = True,
               window: int = 2048) -> list[np.ndarray]:
    """The packs (arrays of sample indices) of one epoch, in training order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    packs: list[np.ndarray] = []
    for a in range(0, len(order), window):
        idx = order[a:a + window]
        packs += [idx[np.asarray(b)] for b in pack_window(lengths[idx], budget)]
    if shuffle:
        packs = [packs[i] for i in rng.permutation(len(packs))]
    return packs


@dataclass
class PackSchedule:
    """Which packs each rank reads at each optimizer step: step s of an epoch uses packs
    [s*G, (s+1)*G), G = world * grad_accum; rank r takes [s*G + r*accum, s*G + (r+1)*accum)."""

    lengths: np.ndarray
    budget: int
    seed: int
    world: int
    grad_accum: int
    shuffle: bool = True
    samples: np.ndarray | None = None  # the dataset ids of `lengths`' entries; None = 0..n-1 (all samples)

    @classmethod
    def over(cls, lengths: np.ndarray, samples: np.ndarray, **kw: Any) -> PackSchedule:
        """A plan over some of the dataset's samples (those not held out for validation)."""
        return cls(np.asarray(lengths)[samples], samples=samples, **kw)

    def packs(self, epoch: int) -> list[np.ndarray]:
        packs = pack_epoch(self.lengths, self.budget, self.seed, epoch, self.shuffle)
        return packs if self.samples is None else [self.samples[p] for p in packs]

    def steps_per_epoch(self) -> int:
        return len(self.packs(0)) // (self.world * self.grad_accum)

    def rank_packs(self, epoch: int, rank: int) -> list[np.ndarray]:
        """This rank's micro-batches of the epoch, grad_accum per optimizer step, in order."""
        packs = self.packs(epoch)
        G, A = self.world * self.grad_accum, self.grad_accum
        steps = len(packs) // G
        return [packs[s * G + rank * A + m] for s in range(steps) for m in range(A)]


def hold_out(num_samples: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, validation ids): `n` samples drawn at random (seeded), the rest in order."""
    if not 0 <= n < num_samples:
        raise EyasError(f"--val-samples {n}: the data has {num_samples} samples; hold out fewer than that")
    val = np.sort(np.random.default_rng([seed, 7919]).choice(num_samples, n, replace=False)) if n else \
        np.zeros(0, dtype=np.int64)
    keep = np.ones(num_samples, dtype=bool)
    keep[val] = False
    return np.flatnonzero(keep), val


class SampleSource:
    """Opens a HiddenStore (states=True; `aux_layer_ids`: some of its layers) or any token dataset
    lazily, once per process."""

    def __init__(self, path: str | Path, kind: str, aux_layer_ids: list[int] | None = None) -> None:
        self.path, self.kind, self.aux_layer_ids = str(path), kind, aux_layer_ids  # kind: "store" | "prepared"
        self._ds: Any = None

    @property
    def ds(self) -> Any:
        if self._ds is None:
            if self.kind == "store":
                from eyas.store import HiddenStore

                self._ds = HiddenStore(self.path, self.aux_layer_ids)
            else:
                from eyas.data.prepared import PreparedDataset

                self._ds = PreparedDataset(self.path)
        return self._ds

    def __getstate__(self) -> dict[str, Any]:  # workers reopen the files themselves
        return {**self.__dict__, "_ds": None}


class PackDataset(Dataset):
    """Item k = the packed row of `packs[k]`: a dict of tensors (see `collate_pack`)."""

    def __init__(self, source: SampleSource | Any, packs: list[np.ndarray], budget: int, pad_to: int | None,
                 states: bool, embed_table: torch.Tensor | None = None) -> None:
        self.source, self.packs, self.budget, self.pad_to, self.states = source, packs, budget, pad_to, states
        self.embed_table = embed_table  # shared with forked workers, never copied

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, k: int) -> dict[str, Any]:
        ds = self.source.ds if isinstance(self.source, SampleSource) else self.source
        samples = [ds[int(i)] for i in self.packs[k]]
        out = collate_pack(samples, self.budget, self.pad_to, self.states, [int(i) for i in self.packs[k]])
        if self.embed_table is not None:
            out["input_embeds"] = self.embed_table.index_select(0, out["input_ids"])  # [N, H]
        return out


def collate_pack(samples: list[dict[str, torch.Tensor]], budget: int, pad_to: int | None, states: bool,
                 ids: list[int] | None = None) -> dict[str, Any]:
    """Samples side by side in one row (each cut to `budget` tokens), padded to `pad_to` if given.

    input_ids, position_ids, document_ids int64 [N]; loss_mask bool [N]; with states, aux_hidden
    [N, k*H] and final_hidden [N, H] in the store's dtype; `lengths` (host ints) of the samples;
    `multi_doc` True when the row holds more than one sample (padding is never attended forward,
    so one sample + padding needs no document mask)."""
    lengths = [min(int(s["input_ids"].shape[0]), budget) for s in samples]
    used = sum(lengths)
    if used > budget:
        raise ValueError(f"pack of {used} tokens exceeds the budget {budget}")
    N = max(used, pad_to or 0)
    out: dict[str, Any] = {
        "input_ids": torch.zeros(N, dtype=torch.long),
        "loss_mask": torch.zeros(N, dtype=torch.bool),
        "position_ids": torch.zeros(N, dtype=torch.long),
        "document_ids": torch.full((N,), len(samples), dtype=torch.long),
    }
    if states:
        a0, f0 = samples[0]["aux_hidden"], samples[0]["final_hidden"]
        out["aux_hidden"] = torch.zeros(N, a0.shape[1], dtype=a0.dtype)
        out["final_hidden"] = torch.zeros(N, f0.shape[1], dtype=f0.dtype)
    a = 0
    for d, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        out["input_ids"][a:a + n] = s["input_ids"][:n]
        out["loss_mask"][a:a + n] = s["loss_mask"][:n]
        out["position_ids"][a:a + n] = torch.arange(n)
        out["document_ids"][a:a + n] = d
        if states:
            out["aux_hidden"][a:a + n] = s["aux_hidden"][:n]
            out["final_hidden"][a:a + n] = s["final_hidden"][:n]
        a += n
    out["position_ids"][a:] = torch.arange(N - a)
    out["lengths"] = lengths
    out["multi_doc"] = len(samples) > 1
    out["num_tokens"] = used
    out["samples"] = ids or []
    out["truncated"] = sum(int(s["input_ids"].shape[0]) > budget for s in samples)
    return out


def fill_states(batch: dict[str, Any], engine: Any) -> dict[str, Any]:
    """Online mode: run the target on the pack's samples (host token ids in, no device->host
    copy) and put their states in the row, on the engine's device."""
    ids = batch["input_ids"].cpu()
    seqs, a = [], 0
    for n in batch["lengths"]:
        seqs.append(ids[a:a + n])
        a += n
    cap = engine.capture_flat(seqs)  # aux [sum n, k*H], final [sum n, H], on the engine's device
    N, used, dev = ids.shape[0], a, cap.aux.device
    aux = torch.zeros(N, cap.aux.shape[1], dtype=cap.aux.dtype, device=dev)
    final = torch.zeros(N, cap.final.shape[1], dtype=cap.final.dtype, device=dev)
    aux[:used] = cap.aux
    final[:used] = cap.final
    return {**batch, "aux_hidden": aux, "final_hidden": final}


def iterate_batches(source: SampleSource | Any, plan: PackSchedule, rank: int, start_epoch: int, start_step: int,
                    num_workers: int = 2, pin: bool = False, pad_to: int | None = None, states: bool = True,
                    epochs: int | None = None, embed_table: torch.Tensor | None = None
                    ) -> Iterator[tuple[int, int, list[dict[str, Any]]]]:
    """Yield (epoch, step in epoch, micro-batches of one optimizer step) from (start_epoch,
    start_step) on, forever or for `epochs` epochs; workers prefetch a few packs ahead."""
    A = plan.grad_accum
    epoch, step = start_epoch, start_step
    while epochs is None or epoch < epochs:
        packs = plan.rank_packs(epoch, rank)
        if not packs:
            raise EyasError(f"an epoch has {len(plan.packs(epoch))} packs of {plan.budget} tokens, fewer than one "
                            f"optimizer step needs ({plan.world} rank(s) x {A} accumulation): lower "
                            "--token-budget or --grad-accum, or use more data")
        ds = PackDataset(source, packs[step * A:], plan.budget, pad_to, states, embed_table)
        loader = DataLoader(ds, batch_size=None, shuffle=False, num_workers=num_workers, pin_memory=pin,
                            prefetch_factor=4 if num_workers else None)
        micro: list[dict[str, Any]] = []
        for batch in loader:
            micro.append(batch)
            if len(micro) == A:
                yield epoch, step, micro
                micro, step = [], step + 1
        epoch, step = epoch + 1, 0


def token_counts(path: str | Path, kind: str, vocab_size: int) -> torch.Tensor:
    """[V] frequency of each token id under the loss mask: prepare's token_counts.safetensors when it
    can be found (a prepared dataset, or the one a store was extracted from), else counted from the
    store's shards (token ids and masks only, never the states)."""
    from safetensors import safe_open

    from eyas.utils.io import read_json

    path = Path(path)
    prepared = path if kind == "prepared" else None
    if kind == "store":
        p = read_json(path / "manifest.json").get("prepared") or ""
        prepared = Path(p) if p and (Path(p) / "token_counts.safetensors").is_file() else None
    if prepared is not None and (prepared / "token_counts.safetensors").is_file():
        with safe_open(str(prepared / "token_counts.safetensors"), framework="pt") as f:
            counts = f.get_tensor("counts").long()
        if counts.numel() != vocab_size:
            raise EyasError(f"{prepared}/token_counts.safetensors has {counts.numel()} entries, the target's "
                            f"vocabulary {vocab_size}: the dataset was prepared with another tokenizer")
        return counts
    if kind != "store":
        raise EyasError(f"{path}/token_counts.safetensors not found: rerun `eyas prepare`")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for shard in read_json(path / "manifest.json")["shards"]:
        with safe_open(str(path / shard["file"]), framework="pt") as f:
            ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts
