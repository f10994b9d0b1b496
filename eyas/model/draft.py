"""The EAGLE-3 draft model, readable top to bottom.

One decoder layer sees, at every position, the target's token embedding and a hidden state side by
side. At the first step that hidden state is `fc` of the target's aux-layer states (low, mid, high
features fused); at later steps it is the draft's own previous output. A reduced vocabulary head
predicts the next token; `d2t` maps its ids back to the target's. Optionally more decoder layers
follow the first as plain Llama layers over the hidden state alone (`num_hidden_layers`, the layout
vLLM and speculators build for such drafts). EAGLE-3.1's two switches: `fc_norm` gives each aux
layer's state its own RMSNorm before `fc` (deep layers' large norms no longer drown the early
layer), and `norm_output` feeds the next step the final-normed hidden state instead of the raw one
(so its scale cannot drift over the unrolled steps).

The layer's attention is Llama's or, with `attention: mla`, DeepSeek's latent attention
(eyas.model.mla, for MLA targets). Attention is pluggable: the layer computes q, k, v with rotary
positions and hands them to an `attend(q, k, v)` callable, so the training-time-test pattern
(eyas.model.attention.TTTAttention), plain causal prefill and KV-cached / tree decoding all share
the same weights and math.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from eyas.model.config import DraftConfig
from eyas.model.vocab import draft_to_target_ids
from eyas.utils.io import EyasError, atomic_path

# attend(q [B, nh, T, hd], k [B, nkv, T, hd], v [B, nkv, T, hd]) -> [B, nh, T, hd]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n, T, hd]; cos, sin [B, T, hd]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, in_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, in_dim] -> q [B, nh, T, hd], k and v [B, nkv, T, hd], rotary applied."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """attention output [B, nh, T, hd] -> [B, T, H]."""
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        return self.output(attend(*self.project(x, cos, sin)))


def attention_module(cfg: DraftConfig, in_dim: int) -> nn.Module:
    """The layer's attention: Llama's grouped-query attention, or DeepSeek's latent attention (MLA)."""
    if cfg.attention == "mla":
        from eyas.model.mla import MLAAttention  # it builds on this module

        return MLAAttention(cfg, in_dim)
    return DraftAttention(cfg, in_dim)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """The first layer attends over [norm(embedding) ; norm(hidden)]; a later one (`first=False`) is a
    plain Llama layer over the hidden state, which has no use for the embedding."""

    def __init__(self, cfg: DraftConfig, first: bool = True) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.first = first
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)  # first: the token embedding; later: the hidden state
        if first:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)  # for the incoming hidden state
        self.self_attn = attention_module(cfg, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    # The layer in two halves around the attention call, so that a trainer can compile each half
    # (static shapes, no Python state) and keep the attention pattern outside.
    def attention_inputs(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.first:
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        else:
            x = self.input_layernorm(hidden)  # [B, T, H]
        return self.self_attn.project(x, cos, sin)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H], attention output [B, nh, T, hd] -> the layer's output [B, T, H]."""
        hidden = hidden + self.self_attn.output(attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        return self.finish(hidden, attend(*self.attention_inputs(emb, hidden, cos, sin)))


class DraftModel(nn.Module):
    """What every draft family shares (eyas.model.families): the frozen target embedding, rotary
    positions, the draft vocabulary (lm_head rows and the d2t/t2d maps), the target's head as a start,
    and the checkpoint folder (docs/architecture.md, contract 3). A family adds its layers, `forward`
    and `logits`."""

    config: DraftConfig
    head_from_target = False  # True: lm_head is the target's head, set from it and frozen

    def _register_vocab_maps(self) -> None:
        """d2t [V_d] int64 (target id = draft id + d2t[draft id]) and t2d [V] bool (in the draft vocabulary)."""
        cfg = self.config
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool)
                             if cfg.draft_vocab_size == cfg.vocab_size
                             else torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def _init_rotary(self) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rc = self.config.rotary_config()
        params = getattr(rc, "rope_parameters", None) or getattr(rc, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            base, dim = self.config.rope_theta, self.config.rope_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](rc, None)
        # A plain attribute, not a buffer: `.to(bfloat16)` must never round the rope frequencies.
        self._inv_freq = inv_freq.float()
        self.attention_scaling = float(scaling)

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if self.config.draft_vocab_size == self.config.vocab_size:
            self.t2d.fill_(True)

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> cos, sin [B, T, hd]."""
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self._inv_freq  # [B, T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- vocabulary and weights from the target --------------------------------------------------

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise EyasError(f"vocab maps of shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not fit a draft "
                            f"with draft_vocab_size={self.config.draft_vocab_size}, "
                            f"vocab_size={self.config.vocab_size}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def init_lm_head_from_target(self, lm_head: torch.Tensor, norm_weight: torch.Tensor,
                                 norm_offset: float = 0.0) -> None:
        """Start lm_head as the target's own head over the draft vocabulary, the target's final-norm
        weight folded in (the draft's norm starts at ones): a draft output equal to the target's last
        hidden state then gives the target's logits. lm_head [V, H], norm_weight [H]; call after set_vocab.

        Why: lm_head is most of a small target's draft (18M of SmolLM2's 31M trainable parameters);
        from random it first has to learn what the target's head already knows."""
        if tuple(lm_head.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise EyasError(f"target lm_head {tuple(lm_head.shape)} does not match the draft's vocabulary and width "
                            f"({self.config.vocab_size}, {self.config.hidden_size})")
        rows = draft_to_target_ids(self.d2t.cpu())  # [V_d] target ids
        folded = lm_head.detach().cpu().float()[rows] * (norm_weight.detach().cpu().float() + norm_offset)[None]
        with torch.no_grad():
            self.lm_head.weight.copy_(folded)
            self.norm.weight.fill_(1.0)

    def load_target_embedding(self, embed_tokens: torch.Tensor, embed_scale: float = 1.0) -> None:
        if tuple(embed_tokens.shape) != tuple(self.embed_tokens.weight.shape):
            raise EyasError(f"target embedding {tuple(embed_tokens.shape)} does not match the draft's "
                            f"{tuple(self.embed_tokens.weight.shape)}: the draft was configured for another target")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_tokens.float() * embed_scale)

    # -- checkpoint (docs/architecture.md, contract 3) -------------------------------------------

    def save_pretrained(self, path: str | Path) -> None:
        with atomic_path(path) as tmp:
            tmp.mkdir()
            self.config.save(tmp / "config.json")
            tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
            # one metadata key: safetensors orders several in a different way in every process (a hash map),
            # and the same draft would not be the same bytes
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> DraftModel:
        path = Path(path)
        cfg = DraftConfig.load(path / "config.json")
        model = cls(cfg)
        try:
            state = load_file(str(path / "model.safetensors"))
        except (OSError, Exception) as e:  # safetensors raises its own error types
            raise EyasError(f"cannot read {path / 'model.safetensors'}: {e}") from e
        check_state_dict(model, state, str(path))
        model.load_state_dict(state)
        return model.to(device=device, dtype=dtype)


class Eagle3Draft(DraftModel):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        if cfg.fc_norm:  # EAGLE-3.1: one norm per aux layer's state
            self.fc_norm = nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                          for _ in range(cfg.num_aux_layers)])
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.target_hidden_size, H, bias=False)
        if cfg.num_hidden_layers < 1:
            raise EyasError(f"a draft needs at least one decoder layer, got num_hidden_layers={cfg.num_hidden_layers}")
        self.layers = nn.ModuleList([DraftDecoderLayer(cfg, first=i == 0) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self._register_vocab_maps()
        self._init_rotary()
        self.reset_parameters()

    # -- pieces the training loop and the decoders compose --------------------------------------

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, k*H_t] target aux states -> [B, T, H] the first step's hidden input."""
        aux_hidden = aux_hidden.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            chunks = aux_hidden.chunk(self.config.num_aux_layers, dim=-1)  # k x [B, T, H_t]
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux_hidden)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attend: Attend, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One draft step. input_ids [B, T], hidden [B, T, H] -> the draft's hidden output [B, T, H]:
        what the next step takes as `hidden`, and what `logits` turns into logits (raw; final-normed
        with `norm_output`).
        `inputs_embeds` [B, T, H], when given, replaces the embedding lookup (a trainer that keeps
        the frozen table on the host). A stateful `attend` (TTT, KV cache) gives each layer its own
        keys through `attend.layer(i)`."""
        emb = (self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds).to(hidden.dtype)
        cos, sin = self.rotary(position_ids, hidden.dtype)
        per_layer = getattr(attend, "layer", None)
        for i, layer in enumerate(self.layers):
            hidden = layer(emb, hidden, cos, sin, per_layer(i) if per_layer else attend)
        return self.norm(hidden) if self.config.norm_output else hidden

    def head_input(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """A step's output [..., H] -> what lm_head reads: final-normed once, whichever the variant."""
        return hidden_out if self.config.norm_output else self.norm(hidden_out)

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V_d] draft-vocabulary logits."""
        return self.lm_head(self.head_input(hidden_out))


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Name every missing, unexpected or mis-shaped tensor instead of failing deep inside torch."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"missing {k} {shape}" for k, shape in expected.items() if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in expected]
    problems += [f"{k} has shape {tuple(state[k].shape)}, expected {shape}"
                 for k, shape in expected.items() if k in state and tuple(state[k].shape) != shape]
    if problems:
        raise EyasError(f"{where}: not a valid draft checkpoint for this config: " + "; ".join(problems[:8])
                        + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))
