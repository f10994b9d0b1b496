"""The target's output head: turns stored final hidden states into the target's next-token logits.

`read_target_head` reads it straight from a checkpoint's safetensors, for engines (vLLM) that
never build the model in this process."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.engines.decoder import is_non_text
from eyas.utils.io import EyasError


@dataclass
class TargetHead:
    """embed_tokens [V, H], norm_weight [H], lm_head [V, H]; RMSNorm with `norm_eps`.

    Gemma-style targets store the norm as (1 + w) and scale embeddings: `norm_offset` and
    `embed_scale` carry that so the head reproduces the target exactly.
    """

    embed_tokens: torch.Tensor
    norm_weight: torch.Tensor
    lm_head: torch.Tensor
    norm_eps: float
    norm_offset: float = 0.0
    embed_scale: float = 1.0

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.lm_head.shape[1]

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> TargetHead:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype or t.dtype)

        return TargetHead(
            move(self.embed_tokens), move(self.norm_weight), move(self.lm_head),
            self.norm_eps, self.norm_offset, self.embed_scale,
        )

    def norm(self, final_hidden: torch.Tensor) -> torch.Tensor:
        x = final_hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return (x * (self.norm_weight.float() + self.norm_offset)).to(final_hidden.dtype)

    def logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]. Use `logits_chunks` when [..., V] would not fit at once."""
        return self.norm(final_hidden) @ self.lm_head.to(final_hidden.dtype).T

    def logits_chunks(self, final_hidden: torch.Tensor, chunk: int = 2048) -> Iterator[tuple[slice, torch.Tensor]]:
        """Yield (row slice, logits [rows, V]) over the flattened rows of `final_hidden` [N, H]."""
        for start in range(0, final_hidden.shape[0], chunk):
            rows = slice(start, min(start + chunk, final_hidden.shape[0]))
            yield rows, self.logits(final_hidden[rows])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "embed_tokens.weight": self.embed_tokens,
            "norm.weight": self.norm_weight,
            "lm_head.weight": self.lm_head,
        }


# -- the head read straight from the target's safetensors (no model build, no vLLM) ----------------


def _pick(keys: list[str], suffix: str) -> str | None:
    """The shortest key ending in `suffix` outside vision/audio towers (text decoder of a wrapper)."""
    cands = [k for k in keys if k.endswith(suffix) and not is_non_text(k)]
    return min(cands, key=len) if cands else None


def read_target_head(model_dir: str | os.PathLike) -> TargetHead:
    """embed_tokens, final norm (+ eps) and lm_head from `model_dir`'s safetensors (tied embeddings:
    lm_head = embed_tokens). Gemma-style norms (1 + w) and embedding scaling are recorded."""
    from safetensors import safe_open

    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    index = d / "model.safetensors.index.json"
    if index.is_file():
        where = {k: d / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        where = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as sf:
                where.update({k: f for k in sf.keys()})  # noqa: SIM118 - safe_open has no __iter__
    if not where:
        raise EyasError(f"{d}: no *.safetensors weights found; the target head is read from them")
    keys = sorted(where)
    # final norm: '<decoder>.norm.weight', never a layer's norm
    norm_keys = [k for k in keys if k.endswith("norm.weight") and ".layers." not in k and not k.startswith("lm_head")]
    embed_k, head_k = _pick(keys, "embed_tokens.weight"), _pick(keys, "lm_head.weight")
    norm_k = _pick([k for k in norm_keys if k.split(".")[-2] in ("norm", "final_layernorm", "norm_f", "ln_f")],
                   "norm.weight") or _pick(norm_keys, "norm.weight")
    if embed_k is None or norm_k is None:
        raise EyasError(f"{d}: cannot find the token embedding / final norm among the safetensors keys "
                        f"(e.g. {keys[:5]}); use --engine hf for this target")

    def load(k: str) -> torch.Tensor:
        with safe_open(str(where[k]), "pt") as sf:
            return sf.get_tensor(k)

    embed = load(embed_k)
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    if head_k is None and not tied:
        raise EyasError(f"{d}: no lm_head.weight and tie_word_embeddings is false; cannot build the target head")
    lm_head = embed if head_k is None else load(head_k)
    eps = text.get("rms_norm_eps", text.get("layer_norm_eps", text.get("layer_norm_epsilon", 1e-6)))
    gemma = str(text.get("model_type", cfg.get("model_type", ""))).startswith("gemma")
    return TargetHead(embed_tokens=embed, norm_weight=load(norm_k), lm_head=lm_head, norm_eps=float(eps),
                      norm_offset=1.0 if gemma else 0.0,
                      embed_scale=math.sqrt(int(text["hidden_size"])) if gemma else 1.0)
