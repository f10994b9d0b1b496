"""The one small interface every target engine implements: token ids in, hidden states out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eyas.engines.head import TargetHead

if TYPE_CHECKING:
    from eyas.data.media import SampleMedia


@dataclass
class Capture:
    """Hidden states of one sequence.

    aux:   [T, k*H]  inputs of decoder layers `aux_layer_ids`, side by side in that order
    final: [T, H]    output of the last decoder layer, before the final norm
    """

    aux: torch.Tensor
    final: torch.Tensor


@dataclass
class FlatCapture:
    """Hidden states of a batch, padding removed and sequences concatenated (what the store writes).

    aux:        [N, k*H]  N = sum of the sequence lengths
    final:      [N, H]
    cu_seqlens: [B+1]     sequence b is rows [cu_seqlens[b], cu_seqlens[b+1]) (host ints, no device sync)
    """

    aux: torch.Tensor
    final: torch.Tensor
    cu_seqlens: list[int]

    def split(self) -> list[Capture]:
        cu = self.cu_seqlens
        return [Capture(self.aux[cu[b]:cu[b + 1]], self.final[cu[b]:cu[b + 1]]) for b in range(len(cu) - 1)]


class TargetEngine(ABC):
    """A target model that runs prefill-only forward passes and captures hidden states."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]
    device: torch.device = torch.device("cpu")  # where capture() leaves its tensors
    tp: int = 1  # tensor-parallel ranks the target runs on
    last_greedy: list[int] | None = None  # the target's own greedy next token after each sequence of the last
    # capture, for engines that compute one (vllm; the preflight checks the final state against it)

    @abstractmethod
    def capture(self, seqs: list[torch.Tensor], media: list[SampleMedia | None] | None = None) -> list[Capture]:
        """Run the target on a batch of 1-D token-id tensors; one Capture per sequence, same order.
        `media[i]`: sequence i's images (eyas.data.media), whose placeholders the sequence holds expanded."""

    def capture_flat(self, seqs: list[torch.Tensor], media: list[SampleMedia | None] | None = None) -> FlatCapture:
        """`capture` with the sequences concatenated; engines override it to skip the per-sequence split."""
        caps = self.capture(seqs) if media is None else self.capture(seqs, media)
        cu = [0]
        for c in caps:
            cu.append(cu[-1] + c.aux.shape[0])
        return FlatCapture(torch.cat([c.aux for c in caps]), torch.cat([c.final for c in caps]), cu)

    @abstractmethod
    def target_head(self) -> TargetHead:
        """The target's token embedding, final norm and lm_head, for the loss and the draft's embedding."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources (GPU memory, worker processes)."""


def parse_layer_ids(text: str | list[int] | None, option: str = "--aux-layers") -> list[int] | None:
    """'2,15,27' -> [2, 15, 27]; '' / None -> None (the EAGLE-3 default)."""
    from eyas.utils.io import EyasError

    if text is None or text == "" or text == []:
        return None
    if isinstance(text, (list, tuple)):
        return [int(x) for x in text]
    try:
        return [int(x) for x in str(text).replace(" ", "").split(",") if x] or None
    except ValueError as e:
        raise EyasError(f"{option} must be comma-separated integers like 2,15,27 (got {text!r})") from e


def group_batches(lengths: list[int], token_budget: int, max_padding: float = 0.2) -> list[list[int]]:
    """Group sequence indices into batches of at most `token_budget` padded tokens (B * max T).

    Longest first, so the first batch shows at once whether the budget fits in memory, and
    neighbours have similar lengths. A batch that already holds a quarter of the budget also
    closes when the next sequence would make more than `max_padding` of it padding: past that
    size a smaller batch costs less than computing padding. A sequence longer than the budget
    runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    real = 0
    for i in order:
        if cur:
            padded = lengths[cur[0]] * (len(cur) + 1)
            too_big = padded > token_budget
            too_padded = padded - real - lengths[i] > max_padding * padded and \
                lengths[cur[0]] * len(cur) >= token_budget // 4
            if too_big or too_padded:
                batches.append(cur)
                cur, real = [], 0
        cur.append(i)
        real += lengths[i]
    if cur:
        batches.append(cur)
    return batches
