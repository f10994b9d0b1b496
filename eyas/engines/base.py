"""The one small interface every target engine implements: token ids in, hidden states out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from eyas.engines.head import TargetHead


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's rule: an early, a middle and a late layer (61 layers -> [2, 30, 58])."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class Capture:
    """Hidden states of one sequence.

    aux:   [T, k*H]  inputs of decoder layers `aux_layer_ids`, side by side in that order
    final: [T, H]    output of the last decoder layer, before the final norm
    """

    aux: torch.Tensor
    final: torch.Tensor


class TargetEngine(ABC):
    """A target model that runs prefill-only forward passes and captures hidden states."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]

    @abstractmethod
    def capture(self, seqs: list[torch.Tensor]) -> list[Capture]:
        """Run the target on a batch of 1-D token-id tensors; one Capture per sequence, same order."""

    @abstractmethod
    def target_head(self) -> TargetHead:
        """The target's token embedding, final norm and lm_head, for the loss and the draft's embedding."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources (GPU memory, worker processes)."""


def validate_aux_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    from eyas.utils.io import EyasError

    ids = [int(i) for i in aux_layer_ids]
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise EyasError(
            f"aux layer ids {bad} are out of range for a target with {num_layers} decoder layers "
            f"(valid: 0..{num_layers - 1}; id k is the input of decoder layer k)"
        )
    return ids
