"""The draft's configuration: data, derived from the target's config so that rope and shapes match."""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from eyas.model.aux_layers import check_aux_layer_ids
from eyas.model.family_facts import FAMILIES, FAMILY_FIELDS, Family, family
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


# config fields that do not change a target's hidden states: names, paths, dtypes, token ids, runtime switches
_NOT_STATE_FIELDS = frozenset({
    "name_or_path", "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype",
    "tokenizer_class", "id2label", "label2id", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "use_cache", "return_dict", "output_hidden_states", "output_attentions",
    "quantization_config", "torchscript", "problem_type", "chunk_size_feed_forward", "tie_encoder_decoder",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "prefix",
    "task_specific_params", "finetuning_task", "pruned_heads", "tf_legacy_loss", "use_bfloat16",
})
_LEGACY_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                  "intermediate_size", "max_position_embeddings")


def _text_fields(target_config: Any) -> dict[str, Any]:
    """The text config of a transformers config as a dict, defaults filled in (a plain namespace, as `eyas
    plan` reads a config.json without transformers' classes, as its own fields)."""
    text = text_config(target_config)
    return text.to_dict() if hasattr(text, "to_dict") else dict(vars(text))


def target_config_sha256(target_config: Any) -> str:
    """Fingerprint of every text-config field that changes the target's hidden states (all but names, paths,
    dtypes, token ids and runtime switches): a draft or store made for another target is refused, down to
    an MLA rank or a rope dim."""
    fields = {k: v for k, v in _text_fields(target_config).items()
              if not k.startswith("_") and k not in _NOT_STATE_FIELDS}
    return sha256_json(fields)


def legacy_target_config_sha256(target_config: Any) -> str:
    """The fingerprint eyas recorded before `target_config_sha256` covered the whole config (7 fields)."""
    c = _text_fields(target_config)
    return sha256_json({k: c.get(k) for k in _LEGACY_FIELDS})


def target_fingerprint_differs(recorded: str, target_config: Any, where: str) -> bool:
    """Whether a recorded fingerprint names another target. An empty one is not checked; one in the older
    7-field form is compared in that form, with a warning that it cannot tell targets apart beyond them."""
    if not recorded or recorded == target_config_sha256(target_config):
        return False
    if recorded == legacy_target_config_sha256(target_config):
        warnings.warn(f"{where}: its target fingerprint is the older 7-field form (model type, sizes, layers), which "
                      "cannot tell apart targets that differ in other fields (MLA ranks, rope dims); re-export or "
                      "re-extract it with this eyas to record the full one", stacklevel=2)
        return False
    return True


def mla_dims(text_config: Any, opts: DraftOptions, rope_scaling: dict | None) -> dict[str, Any]:
    """An MLA draft layer's DraftConfig fields (empty for Llama-style attention): each dim the user's,
    else the target's; refused when neither gives it, and for rope the engines' MLA layer would
    compute otherwise (they read any rope scaling as DeepSeek's yarn)."""
    if opts.draft_attention != "mla":
        return {}
    target_is_mla = getattr(text_config, "kv_lora_rank", None) is not None
    dims: dict[str, Any] = {"attention": "mla"}
    missing = []
    for name in MLA_DIMS:
        value = getattr(opts, "mla_" + name)
        if value is None:
            value = getattr(text_config, name, None)
            if value is None and name == "q_lora_rank" and target_is_mla:
                value = 0  # an MLA target without a query down-projection (DeepSeek-V2-Lite)
        if value is None:
            missing.append(f"--mla-{name.replace('_', '-')}")
        dims[name] = int(value or 0)
    if missing:
        raise EyasError(f"--draft-attention mla: the target has no MLA attention to take {', '.join(missing)} from; "
                        "pass them (e.g. --mla-q-lora-rank 64 --mla-kv-lora-rank 512 --mla-qk-nope-head-dim 64 "
                        "--mla-qk-rope-head-dim 64 --mla-v-head-dim 64), or train --draft-attention llama")
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind not in ("default", "yarn") or (kind == "yarn" and not rope_scaling.get("factor")):
        raise EyasError(f"--draft-attention mla: the target's rope scaling {rope_scaling} is not one the engines' MLA "
                        "draft layer computes (plain rope or DeepSeek's yarn with a factor): train "
                        "--draft-attention llama")
    if dims["qk_rope_head_dim"] % 2:
        raise EyasError(f"--draft-attention mla: qk_rope_head_dim {dims['qk_rope_head_dim']} is odd; rope turns "
                        "channel pairs: pass an even --mla-qk-rope-head-dim")
    return dims


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
                               "layers over the hidden state (vLLM and speculators serve them, SGLang does not). "
                               "dflash: every layer reads the target's context (DFlash's own recipes use 5).")
    fc_norm: bool = option(False, help="EAGLE-3.1: an RMSNorm on each aux layer's state before fc, so a late "
                           "layer's large values do not drown an early one's (vLLM and speculators serve it).")
    norm_output: bool = option(False, help="EAGLE-3.1: each training-time-test step reads the previous step's "
                               "final-normed hidden state, not the raw one (vLLM and speculators serve it).")
    family: str = option("eagle3", help="Draft family: " + "; ".join(f"{f.name} ({f.summary})"
                                                                   for f in FAMILIES.values()) + ".")
    block_size: int = option(16, help="dflash: tokens per block, the anchor included; one draft forward proposes "
                             "block_size - 1 tokens (vLLM's num_speculative_tokens).")
    markov_rank: int = option(64, help="dspark: width of the Markov head's embedding of the previous token (vLLM "
                              "reads at most 256).")
    mask_token_id: int = option(-1, show_default="-1: the target's pad token, else the highest id never trained on",
                                help="dflash, peagle: the token id filling the open slots (dflash reads its frozen "
                                     "embedding there, peagle a learned one); an id the target never produces.")
    draft_attention: Literal["llama", "mla"] = option("llama", help="The draft layer's attention: llama "
                                                      "(grouped-query, served everywhere) or mla (DeepSeek's latent "
                                                      "attention, for MLA targets such as Kimi-K2.5; vLLM and SGLang "
                                                      "serve it).")
    mla_q_lora_rank: int | None = option(None, show_default="the target's", help="mla: rank of the query's "
                                         "down-projection; 0 = none, a plain q_proj (SGLang needs a rank).")
    mla_kv_lora_rank: int | None = option(None, show_default="the target's", help="mla: width of the latent "
                                          "key/value (vLLM's CPU backend runs 512 with a rope dim of 64 only).")
    mla_qk_nope_head_dim: int | None = option(None, show_default="the target's",
                                              help="mla: per-head query/key channels without rope.")
    mla_qk_rope_head_dim: int | None = option(None, show_default="the target's",
                                              help="mla: per-head query/key channels with rope (one rope key for all "
                                                   "heads).")
    mla_v_head_dim: int | None = option(None, show_default="the target's", help="mla: per-head value channels.")
    draft_window: int = option(0, help="Sliding-window attention for the draft: each position sees only the last N "
                               "positions (train, eval and the exported vLLM config); 0 = all of them. For long "
                               "sequences: the draft's attention cost and its reach stop growing with the context.")

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1:
            raise EyasError(f"--draft-vocab-size must be >= 1, got {self.draft_vocab_size}")
        if self.draft_intermediate_size < 0:
            raise EyasError(f"--draft-intermediate-size must be >= 0 (0 = the target's), got "
                            f"{self.draft_intermediate_size}")
        if self.draft_layers < 1:
            raise EyasError(f"--draft-layers must be >= 1, got {self.draft_layers}")
        fam = family(self.family)
        refused = [f"--{name.replace('_', '-')}" for name in ("fc_norm", "norm_output")
                   if getattr(self, name) and name not in fam.switches]
        if refused:
            raise EyasError(f"{' and '.join(refused)}: EAGLE-3.1 switches a {fam.name} draft does not have (it "
                            "proposes a whole chain in one forward and never chains its own outputs): drop them")
        if "markov_rank" in fam.config_fields and not 1 <= self.markov_rank <= 256:
            raise EyasError(f"--markov-rank must be in 1..256 (vLLM caps the Markov head there), got "
                            f"{self.markov_rank}")
        if "block_size" in fam.config_fields and self.block_size < 2:
            raise EyasError(f"--block-size must be >= 2 (the anchor and at least one proposed token), got "
                            f"{self.block_size}")
        if self.draft_window < 0:
            raise EyasError(f"--draft-window must be >= 0 (0 = full attention), got {self.draft_window}")
        if self.draft_window and ("window" not in fam.switches or self.draft_attention != "llama"):
            raise EyasError("--draft-window is a sliding window of an EAGLE-3 draft's Llama attention; a "
                            f"{self.family} draft with {self.draft_attention} attention has none: drop it")
        self._check_mla(fam)

    def _check_mla(self, fam: Family) -> None:
        dims = {name: getattr(self, "mla_" + name) for name in MLA_DIMS}
        given = [f"--mla-{name.replace('_', '-')}" for name, v in dims.items() if v is not None]
        if self.draft_attention != "mla" and given:
            raise EyasError(f"{', '.join(given)} shape an MLA draft layer: add --draft-attention mla, or drop them")
        if self.draft_attention == "mla" and "mla" not in fam.switches:
            raise EyasError(f"--draft-attention mla is an EAGLE-3 draft layer; a {self.family} draft has none: drop it")
        low = [f"--mla-{name.replace('_', '-')} {v}" for name, v in dims.items()
               if v is not None and v < (0 if name == "q_lora_rank" else 1)]
        if low:
            raise EyasError(f"{', '.join(low)}: MLA dims must be >= 1 (--mla-q-lora-rank >= 0, 0 = no q compression)")


MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_MLA_FIELDS = ("attention", *MLA_DIMS)  # DraftConfig fields drafts with Llama-style attention leave out


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
    attention: str = "llama"  # the decoder layers' attention: llama (grouped-query) or mla (eyas.model.mla)
    q_lora_rank: int = 0  # mla: the query's down-projection rank; 0 = a plain q_proj
    kv_lora_rank: int = 0  # mla: the latent key/value width
    qk_nope_head_dim: int = 0  # mla: per-head query/key channels without rope (head_dim = nope + rope)
    qk_rope_head_dim: int = 0  # mla: per-head query/key channels with rope
    v_head_dim: int = 0  # mla: per-head value channels
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    family: str = "eagle3"  # the draft family (eyas.model.family_facts); absent in older drafts
    block_size: int = 0  # dflash: tokens per block, the anchor included
    mask_token_id: int = -1  # dflash, peagle: the token id of the open slots
    markov_rank: int = 0  # dspark: the Markov head's rank
    sliding_window: int = 0  # the draft attends to the last this many positions; 0 = all (absent when 0)
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
        mla = mla_dims(c, opts, scaling)
        if mla:  # per-head keys and values (eyas.model.mla), q and k nope + rope wide
            kv_heads, head_dim = heads, mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
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
            aux_layer_ids=check_aux_layer_ids(aux_layer_ids, int(c.num_hidden_layers)),
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max(target_positions, max_position_embeddings or 0),
            hidden_act=str(getattr(c, "hidden_act", "silu")),
            **{name: getattr(opts, name) for name in family(opts.family).config_fields},
            sliding_window=opts.draft_window,
            target=target,
            target_num_layers=int(c.num_hidden_layers),
            target_config_sha256=target_config_sha256(target_config),
            **mla,
        )

    @property
    def rope_dim(self) -> int:
        """Channels per head that rope turns: all of head_dim, or an MLA layer's rope part."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON; the fields other families own are left out, so an EAGLE-3 config reads (and
        fingerprints) exactly as drafts written before families existed."""
        data = dataclasses.asdict(self)
        for name in set(FAMILY_FIELDS) - set(family(self.family).config_fields):
            data.pop(name)
        if self.attention == "llama":
            for name in _MLA_FIELDS:
                data.pop(name)
        if not self.sliding_window:
            data.pop("sliding_window")  # full attention reads (and fingerprints) as before windows existed
        return data

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
            head_dim=self.rope_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
        )
        if self.rope_scaling:
            kwargs["rope_scaling"] = dict(self.rope_scaling)
        return LlamaConfig(**kwargs)
