"""Where a model keeps its text decoder: the one finder every hook on a target's layers goes through.

Extraction, online training, eval and vLLM's hooks path all hook "decoder layer k". If each looked
for the layers its own way, a multimodal wrapper could give one of them a vision tower's layers and
the draft would be trained on other states than it is evaluated or served with.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from eyas.utils.io import EyasError

# where wrappers keep their text decoder, tried in this order before the generic search
DECODER_PATHS = ("model.language_model", "language_model", "model.text_model", "text_model", "model", "transformer")
FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_norm", "norm_f", "ln_f")
# module and tensor names that belong to a vision / audio tower or its projector, never the text decoder
NON_TEXT_PARTS = ("vision", "visual", "audio", "image", "mm_", "multi_modal")


def is_non_text(name: str) -> bool:
    """True for a module or tensor name inside a vision/audio tower or a multimodal projector."""
    return any(part in name.lower() for part in NON_TEXT_PARTS)


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _is_decoder(m: Any) -> bool:
    layers = getattr(m, "layers", None)
    return isinstance(m, nn.Module) and isinstance(layers, nn.ModuleList) and len(layers) > 0 and (
        getattr(m, "embed_tokens", None) is not None or hasattr(m, "get_input_embeddings"))


def find_text_decoder(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module | None]:
    """(text model, its decoder layers, its final norm or None) for a causal LM or a multimodal wrapper.

    Known paths first (model.model, model.model.language_model, ...), then the shallowest module
    outside any vision/audio tower that has `layers` and token embeddings.
    """
    found = None
    for path in DECODER_PATHS:
        m = _get(model, path)
        if _is_decoder(m):
            found = m
            break
    if found is None:
        cands = [(name.count("."), name, m) for name, m in model.named_modules()
                 if _is_decoder(m) and not is_non_text(name)]
        if not cands:
            raise EyasError(
                f"cannot find the text decoder in {type(model).__name__}: no submodule has `layers` and token "
                "embeddings. eyas supports transformers causal LMs and their multimodal wrappers."
            )
        found = min(cands, key=lambda c: (c[0], c[1]))[2]
    norm = next((getattr(found, n) for n in FINAL_NORM_NAMES if isinstance(getattr(found, n, None), nn.Module)), None)
    return found, found.layers, norm
