"""The target model for decoding: a transformers causal LM and the aux-layer hidden states the draft needs,
captured during the same forward pass (the batched decoder's verify, or a plain `forward`).

Aux id k is the input of decoder layer k (transformers' `hidden_states[k]`,
docs/architecture.md): a forward pre-hook on layer k records it, so no extra pass and no
`output_hidden_states` over all layers. The layers are found as the hf engine finds them
(`eyas.engines.decoder`), so eval hooks the very modules extraction and training hooked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from eyas.engines.decoder import find_text_decoder
from eyas.model.config import text_config
from eyas.utils.io import EyasError


class HFTarget:
    """Wraps a transformers causal LM for speculative decoding: hooks that capture the aux layers' inputs
    (`capture`, `_captured`), and `forward`, one sequence against a cache -> logits and aux states. Call
    `close()` to remove the hooks.
    """

    def __init__(self, model: nn.Module, aux_layer_ids: list[int]) -> None:
        self.model = model.eval()
        _, self.layers, _ = find_text_decoder(model)
        bad = [i for i in aux_layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise EyasError(f"the draft's aux layer ids {bad} do not exist in a target with {len(self.layers)} "
                            "decoder layers: this draft was trained for another target")
        self.aux_layer_ids = list(aux_layer_ids)
        self.capture = True
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [self.layers[i].register_forward_pre_hook(self._make_hook(i), with_kwargs=True)
                       for i in sorted(set(self.aux_layer_ids))]
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = text_config(model.config)
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(cfg.hidden_size)

    def _make_hook(self, layer_id: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            if self.capture:
                self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def new_cache(self) -> DynamicCache:
        return DynamicCache()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache,
                attention_mask: torch.Tensor | None = None, last_logits_only: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, position_ids [1, T] -> logits [T or 1, V], aux [T, k*H] (None when capture is off).

        attention_mask: None for causal, or a 4-D mask [1, 1, T, cached + T].
        """
        self._captured.clear()
        kwargs: dict[str, Any] = {}
        if last_logits_only:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache,
                         attention_mask=attention_mask, use_cache=True, **kwargs)
        logits = out.logits[0]
        if not self.capture:
            return logits, None
        aux = torch.cat([self._captured[i][0] for i in self.aux_layer_ids], dim=-1)  # [T, k*H]
        self._captured.clear()
        return logits, aux


def stop_token_ids(model: nn.Module, tokenizer: Any | None) -> set[int]:
    """End-of-sequence ids from the tokenizer, the model config and the generation config."""
    ids: set[int] = set()
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids
