"""The hidden-state store: what `extract` writes and `train` reads (docs/architecture.md, contract 2)."""

from __future__ import annotations

from eyas.store.format import FORMAT, dequantize_fp8, quantize_fp8
from eyas.store.reader import HiddenStore, verify_store
from eyas.store.writer import (
    ShardBuffer,
    ShardSpec,
    StoreMeta,
    StoreWriter,
    check_disk_for,
    finish_partial,
    finished_partial,
    load_shard_specs,
    partial_dir,
    prepare_partial,
    split_shards,
    write_safetensors,
)

__all__ = ["FORMAT", "HiddenStore", "ShardBuffer", "ShardSpec", "StoreMeta", "StoreWriter", "check_disk_for",
           "dequantize_fp8", "finish_partial", "finished_partial", "load_shard_specs", "partial_dir", "split_shards",
           "prepare_partial", "quantize_fp8", "verify_store", "write_safetensors"]
