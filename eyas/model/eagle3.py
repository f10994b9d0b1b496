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

import torch
from torch import nn

from eyas.model.config import DraftConfig
from eyas.model.draft import DraftModel
from eyas.model.layers import Attend, DraftAttention, DraftMLP, RMSNorm
from eyas.model.mla import MLAAttention
from eyas.utils.io import EyasError


def attention_module(cfg: DraftConfig, in_dim: int) -> nn.Module:
    """The layer's attention: Llama's grouped-query attention, or DeepSeek's latent attention (MLA)."""
    if cfg.attention == "mla":
        return MLAAttention(cfg, in_dim)
    return DraftAttention(cfg, in_dim)


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
