"""Writing a draft in the layouts vLLM, SGLang and speculators serve. Reading any layout back is
`eyas.model.checkpoints.import_draft` (train and eval read drafts without this package)."""

from __future__ import annotations

from eyas.export.families import export_draft
from eyas.export.writers import (
    ServeOptions,
    export_tensors,
    serve_readme,
    sglang_config,
    speculators_config,
    vllm_config,
)
from eyas.model.layouts import FORMATS

__all__ = ["FORMATS", "ServeOptions", "export_draft", "export_tensors", "serve_readme", "sglang_config",
           "speculators_config", "vllm_config"]
