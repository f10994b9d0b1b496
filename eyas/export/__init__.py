"""Serving layouts (vLLM, SGLang, speculators) and readers for foreign EAGLE-3 checkpoints."""

from __future__ import annotations

from eyas.export.formats import (
    FORMATS,
    LAYOUTS,
    ExportOptions,
    check_draft_target,
    check_vocab_maps,
    detect_layout,
    export_draft,
    export_tensors,
    import_draft,
    read_config,
    read_tensors,
    serve_readme,
    sglang_config,
    speculators_config,
    target_embedding,
    vllm_config,
)

__all__ = ["FORMATS", "LAYOUTS", "ExportOptions", "check_draft_target", "check_vocab_maps", "detect_layout",
           "export_draft", "export_tensors", "import_draft", "read_config", "read_tensors", "serve_readme",
           "sglang_config", "speculators_config", "target_embedding", "vllm_config"]
