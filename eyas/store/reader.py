"""Reading a finished hidden-state store (data contract 2 in docs/architecture.md): random access by
sample, a cheap check of every file's header and size on opening, and a check of every file against
the manifest's sha256 when asked (it reads the whole store)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.engines.head import TargetHead
from eyas.engines.preflight import check_head
from eyas.store.format import FORMAT, dequantize_fp8
from eyas.utils.io import EyasError, read_json, sha256_file
from eyas.utils.tensorfile import Expected, check_tensor_file


class HiddenStore:
    """Random access by sample into a finished store; shards are memory-mapped and opened lazily.

    store[i] -> {"input_ids": LongTensor[T], "loss_mask": BoolTensor[T],
                 "aux_hidden": bf16 [T, k*H], "final_hidden": bf16 [T, H]}   (fp8 is dequantized)

    `aux_layer_ids` reads only some of the stored layers (k of them, in layer order): a store
    extracted once with extra layers trains drafts on different choices. Every file's header and size
    are checked on opening (a damaged or truncated file is one clear error); `verify` also checks
    every file's sha256 (flipped bytes), which reads the whole store.
    """

    def __init__(self, path: str | os.PathLike, aux_layer_ids: list[int] | None = None,
                 verify: bool = False) -> None:
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
            from eyas.model.aux_layers import check_aux_layer_ids

            # a store holds captured layers only (inputs 0..N-1; the last layer's output is its final state), so
            # any id the hint below names is one `eyas extract --aux-layers` takes
            check_aux_layer_ids(self.aux_layer_ids, int(m["num_layers"]), f"--aux-layers for the store {self.path}",
                                captured=True)
            missing = [i for i in self.aux_layer_ids if i not in stored]
            if missing:
                raise EyasError(f"the store {self.path} holds aux layers {stored}, not {missing}: pick among those, "
                                f"or extract again with --aux-layers {','.join(map(str, self.aux_layer_ids))}")
            self._aux_pick = torch.tensor([stored.index(i) for i in self.aux_layer_ids])
        self.hidden_size: int = int(m["hidden_size"])
        self.dtype: str = m["dtype"]
        self.shards: list[dict] = m["shards"]
        self._handles: dict[int, Any] = {}
        if verify:
            verify_store(self.path)
        fix = damaged_store_fix(self.path)
        check_tensor_file(self.path / "target_head.safetensors", head_tensors(m), fix)
        lengths = []
        for j, s in enumerate(self.shards):
            check_tensor_file(self.path / s["file"], shard_tensors(m, s), fix)
            off = self._open(j).get_tensor("offsets").numpy()
            if len(off) != s["num_samples"] + 1 or int(off[-1]) != s["num_tokens"]:
                raise EyasError(f"{self.path / s['file']}: offsets disagree with manifest.json. {fix}")
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

    def check_values(self, head: TargetHead, samples: int = 4) -> None:
        """The target head and a few samples' states spread over the store are finite (the head also not all
        zeros). A store extracted with --no-preflight from a damaged target holds NaN, and training on it
        fails at its first step as if the draft or the learning rate were at fault."""
        problems = [f"target_head.safetensors: {f.message}" for f in check_head(head)]
        bad = int((~torch.isfinite(head.embed_tokens.float())).sum())
        if bad:
            problems.append(f"target_head.safetensors: the embedding holds {bad} NaN/inf value(s)")
        n = len(self)
        for i in sorted({int(x) for x in np.linspace(0, n - 1, min(samples, n))}) if n else []:
            s = self[i]
            bad = {k: int((~torch.isfinite(s[k].float())).sum()) for k in ("aux_hidden", "final_hidden")}
            if any(bad.values()):
                j = int(np.searchsorted(self._first, i, side="right") - 1)
                problems.append(f"{self.shards[j]['file']}: sample {i} holds NaN/inf states ("
                                + ", ".join(f"{k}: {v}" for k, v in bad.items() if v) + ")")
        if problems:
            raise EyasError(f"the store {self.path} holds non-finite values, so every loss would be NaN: "
                            + "; ".join(problems) + ". Its target is damaged (extraction with --no-preflight kept "
                            "it); fix the target's weights and rerun `eyas extract` with its preflight on")

    def verify(self) -> int:
        """Recompute every shard's sha256 against the manifest; raise EyasError naming each bad shard.
        Returns the number of files checked."""
        return verify_store(self.path)


def shard_tensors(manifest: dict[str, Any], shard: dict[str, Any]) -> Expected:
    """The tensors a shard of this store holds, with their dtypes and shapes (data contract 2)."""
    n, k, h = int(shard["num_tokens"]), len(manifest["aux_layer_ids"]), int(manifest["hidden_size"])
    state = "F8_E4M3" if manifest["dtype"] == "float8_e4m3fn" else "BF16"
    out: Expected = {"input_ids": ("I32", (n,)), "loss_mask": ("U8", (n,)),
                     "offsets": ("I64", (int(shard["num_samples"]) + 1,)),
                     "aux_hidden": (state, (n, k * h)), "final_hidden": (state, (n, h))}
    if state == "F8_E4M3":
        out |= {"aux_scale": ("F32", (n, k)), "final_scale": ("F32", (n, 1))}
    return out


def head_tensors(manifest: dict[str, Any]) -> Expected:
    """target_head.safetensors: the target's embedding, final norm and lm_head, in bf16."""
    v, h = int(manifest["vocab_size"]), int(manifest["hidden_size"])
    return {"embed_tokens.weight": ("BF16", (v, h)), "norm.weight": ("BF16", (h,)), "lm_head.weight": ("BF16", (v, h))}


def damaged_store_fix(path: Path) -> str:
    return (f"`eyas extract --out {path} --verify` lists every damaged file of the store; to repair it, delete "
            f"{path} and rerun the `eyas extract` command that made it.")


def verify_store(path: str | os.PathLike) -> int:
    """Check every file's sha256 against the manifest (files hashed in parallel: hashlib runs without
    the GIL); raise EyasError naming each bad file. Returns the number of files checked."""
    path = Path(path)
    m = read_json(path / "manifest.json")
    files = [(s["file"], s["sha256"]) for s in m["shards"]]
    if m.get("target_head_sha256"):
        files.append(("target_head.safetensors", m["target_head_sha256"]))

    def problem(name: str, sha: str) -> str | None:
        f = path / name
        if not f.is_file():
            return f"{name}: missing"
        return None if sha256_file(f) == sha else f"{name}: sha256 differs from manifest.json (corrupted or modified)"

    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        bad = [p for p in pool.map(lambda f: problem(*f), files) if p]
    if bad:
        raise EyasError(f"store {path} failed verification ({len(bad)} bad file(s)):\n  " + "\n  ".join(bad)
                        + f"\nRe-extract: delete {path} and rerun the `eyas extract` command that made it (finished "
                          "shards of an interrupted run are kept in OUT.partial, a finished store is rebuilt).")
    return len(m["shards"]) + 1
