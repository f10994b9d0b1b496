"""A cheap check of a safetensors file before it is opened: its header parses, names the tensors we
expect with their dtypes and shapes, and the file is exactly as long as the header says.

Reading a few kilobytes per file finds a damaged header or a truncated file (a disk that filled, a
copy cut short) as one clear error, instead of a `SafetensorError` deep inside a training step.
Flipped bytes inside the data need a checksum (`eyas extract --out STORE --verify`).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from eyas.utils.io import EyasError

MAX_HEADER = 100 << 20  # safetensors' own limit

# what a file must hold: name -> (dtype as safetensors spells it, or None: any; shape, or None: any)
Expected = dict[str, tuple[str | None, tuple[int, ...] | None]]


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """(the header's tensors, the file size the header implies); ValueError says what is wrong."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"the file is {size} bytes long, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"the header claims {n:,} bytes but the file holds {size:,} (damaged or truncated)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    end = 0
    for name, t in header.items():
        try:
            a, b = (int(x) for x in t["data_offsets"])
            t["shape"] = tuple(int(x) for x in t["shape"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"the header's entry for {name!r} is malformed") from None
        end = max(end, b)
    return header, 8 + n + end


def check_tensor_file(path: str | os.PathLike, expected: Expected, fix: str) -> None:
    """Raise EyasError naming `path`, what is wrong and `fix` (what to do) unless the file is whole and
    holds the `expected` tensors."""
    path = Path(path)
    if not path.is_file():
        raise EyasError(f"{path} is missing. {fix}")
    try:
        header, implied = read_header(path)
        size = path.stat().st_size
        if size != implied:
            raise ValueError(f"the file is {size:,} bytes but its header describes {implied:,} "
                             f"({'truncated' if size < implied else 'trailing bytes'})")
        for name, (dtype, shape) in expected.items():
            t = header.get(name)
            if t is None:
                raise ValueError(f"it has no tensor {name!r}")
            if (dtype is not None and t["dtype"] != dtype) or (shape is not None and t["shape"] != tuple(shape)):
                raise ValueError(f"tensor {name!r} is {t['dtype']} {list(t['shape'])}, expected "
                                 f"{dtype or t['dtype']} {list(shape) if shape is not None else list(t['shape'])}")
    except ValueError as e:
        raise EyasError(f"{path} is damaged: {e}. {fix}") from None
    except OSError as e:
        raise EyasError(f"cannot read {path}: {e.strerror or e}. {fix}") from None
