"""What every draft family shares (eyas.model.families): the frozen target embedding, rotary positions,
the draft vocabulary (lm_head rows and the d2t/t2d maps), the target's head as a start, and the
checkpoint folder (docs/architecture.md, contract 3). Each family's model builds on `DraftModel`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from eyas.model.config import DraftConfig
from eyas.model.layers import RMSNorm
from eyas.model.vocab import draft_to_target_ids
from eyas.utils.io import EyasError, atomic_path


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
