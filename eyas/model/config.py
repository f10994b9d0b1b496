"""The draft's configuration: data, derived from the target's config so that rope and shapes match."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from eyas.utils.io import EyasError, atomic_write_json, sha256_json
from eyas.utils.schema import option


def text_config(target_config: Any) -> Any:
    """Multimodal wrappers keep the language model's settings in a sub-config."""
    get = getattr(target_config, "get_text_config", None)
    return get() if callable(get) else target_config


def target_rope(text_config: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a transformers 4.x (`rope_theta`/`rope_scaling`) or 5.x
    (`rope_parameters`) config. rope_scaling is None for plain rope."""
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type rope (Gemma3)
        params = params["full_attention"]
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", getattr(text_config, "rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return theta, scaling
    theta = float(getattr(text_config, "rope_theta", 10000.0))
    scaling = getattr(text_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, dict(scaling) if scaling else None


def target_config_sha256(target_config: Any) -> str:
    """Fingerprint of the target's shape-defining settings: a draft for another target is refused."""
    c = text_config(target_config)
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
            "intermediate_size", "max_position_embeddings")
    return sha256_json({k: getattr(c, k, None) for k in keys})


@dataclass(kw_only=True)
class DraftOptions:
    """What draft to build for a target: the options of `eyas train` that shape it (the rest of its
    config mirrors the target)."""

    help_panel: ClassVar[str] = "Draft"

    draft_vocab_size: int = option(32000, help="Draft vocabulary: the most frequent trained tokens (capped at the "
                                   "target's vocabulary).")
    draft_intermediate_size: int = option(0, help="Width of the draft layer's MLP; 0 = the target's. The engines "
                                          "read it from the exported config.")
    draft_layers: int = option(1, help="Decoder layers in the draft: EAGLE-3 has one; later ones are plain Llama "
                               "layers over the hidden state (vLLM and speculators serve them, SGLang does not).")
    fc_norm: bool = option(False, help="EAGLE-3.1: an RMSNorm on each aux layer's state before fc, so a late "
                           "layer's large values do not drown an early one's (vLLM and speculators serve it).")
    norm_output: bool = option(False, help="EAGLE-3.1: each training-time-test step reads the previous step's "
                               "final-normed hidden state, not the raw one (vLLM and speculators serve it).")

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1:
            raise EyasError(f"--draft-vocab-size must be >= 1, got {self.draft_vocab_size}")
        if self.draft_intermediate_size < 0:
            raise EyasError(f"--draft-intermediate-size must be >= 0 (0 = the target's), got "
                            f"{self.draft_intermediate_size}")
        if self.draft_layers < 1:
            raise EyasError(f"--draft-layers must be >= 1, got {self.draft_layers}")


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    num_hidden_layers: int = 1  # decoder layers: the first reads [embedding ; hidden], later ones hidden
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per aux layer's state before fc
    norm_output: bool = False  # EAGLE-3.1: the next step reads the final-normed hidden state
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    target: str = ""
    target_num_layers: int = 0
    target_config_sha256: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids)

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        aux_layer_ids: list[int],
        draft_vocab_size: int = 32000,
        target: str = "",
        max_position_embeddings: int | None = None,
        *,
        options: DraftOptions | None = None,
        vocab_size: int | None = None,
    ) -> DraftConfig:
        """Mirror the target's width, heads and rope; never fewer positions than the target has.
        `options` (the user's draft options) override `draft_vocab_size` and shape the rest;
        `vocab_size` is the target head's row count where it differs from the config's."""
        c = text_config(target_config)
        opts = options or DraftOptions(draft_vocab_size=draft_vocab_size)
        hidden = int(c.hidden_size)
        heads = int(c.num_attention_heads)
        kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
        if heads % kv_heads:
            kv_heads = heads
        theta, scaling = target_rope(c)
        target_positions = int(getattr(c, "max_position_embeddings", 4096) or 4096)
        vocab = int(vocab_size or c.vocab_size)
        return cls(
            hidden_size=hidden,
            intermediate_size=opts.draft_intermediate_size or int(getattr(c, "intermediate_size", 4 * hidden)),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            draft_vocab_size=min(opts.draft_vocab_size, vocab),
            num_hidden_layers=opts.draft_layers,
            fc_norm=opts.fc_norm,
            norm_output=opts.norm_output,
            target_hidden_size=hidden,
            aux_layer_ids=[int(i) for i in aux_layer_ids],
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max(target_positions, max_position_embeddings or 0),
            hidden_act=str(getattr(c, "hidden_act", "silu")),
            target=target,
            target_num_layers=int(c.num_hidden_layers),
            target_config_sha256=target_config_sha256(target_config),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def sha256(self) -> str:
        return sha256_json(self.to_dict())

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> DraftConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EyasError(f"cannot read draft config {path}: {e}") from e
        known = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING and f.name not in data]
        if missing:
            raise EyasError(f"{path} is not an eyas draft config: missing {missing}")
        return cls(**{k: v for k, v in data.items() if k in known})

    def rotary_config(self) -> Any:
        """A LlamaConfig carrying only the rope settings, so transformers computes every rope type."""
        from transformers import LlamaConfig

        kwargs: dict[str, Any] = dict(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
        )
        if self.rope_scaling:
            kwargs["rope_scaling"] = dict(self.rope_scaling)
        return LlamaConfig(**kwargs)
