"""The target's output head: turns stored final hidden states into the target's next-token logits."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


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
