"""The hidden-state store: what `extract` writes and `train` reads (docs/architecture.md, contract 2)."""

from __future__ import annotations

from eyas.store.store import (
    FORMAT,
    HiddenStore,
    ShardBuffer,
    ShardSpec,
    StoreMeta,
    StoreWriter,
    check_disk_for,
    dequantize_fp8,
    partial_dir,
    plan_shards,
    prepare_partial,
    quantize_fp8,
    verify_store,
    write_safetensors,
)

__all__ = ["FORMAT", "HiddenStore", "ShardBuffer", "ShardSpec", "StoreMeta", "StoreWriter", "check_disk_for",
           "dequantize_fp8", "partial_dir", "plan_shards", "prepare_partial", "quantize_fp8", "verify_store",
           "write_safetensors"]
