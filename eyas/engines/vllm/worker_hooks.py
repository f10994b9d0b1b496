"""The hooks capture path: functions that run inside each vLLM worker, sent by `LLM.collective_rpc`.

Forward hooks on the worker's decoder layers record each forward step's token ids, positions and
the states at the requested layer ids; the engine takes the records after `generate` returns.
vLLM's decoder layers carry the residual stream separately, so a layer's input is
`hidden + residual`. The layers are found by the same finder as the hf engine's
(`eyas.engines.decoder`), so a multimodal wrapper's vision tower is never hooked.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from eyas.engines.decoder import find_text_decoder
from eyas.utils.io import EyasError


def _worker_decoder(worker: Any, num_layers: int) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    model = worker.model_runner.get_model() if hasattr(worker.model_runner, "get_model") else worker.model_runner.model
    try:
        inner, layers, _ = find_text_decoder(model)
    except EyasError as e:
        raise RuntimeError(f"eyas: {e}") from e
    if len(layers) != num_layers:
        raise RuntimeError(f"eyas: the text decoder of {type(model).__name__} has {len(layers)} layers, its config "
                           f"says {num_layers}")
    return inner, layers


def install_hooks(worker: Any, layer_ids: list[int], num_layers: int) -> bool:
    """Hook the decoder: embedding pre-hook (token ids), layer k pre-hook (its input; layer 0 also
    opens the forward's record with the positions), last layer hook (its output = id num_layers)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    for h in getattr(worker, "_eyas_hooks", []):
        h.remove()
    worker._eyas_records = []
    worker._eyas_hooks = []
    if get_tensor_model_parallel_rank() != 0:
        return True  # every rank holds the full (all-reduced) hidden states; rank 0 reports them
    inner, layers = _worker_decoder(worker, num_layers)
    # the layer API the hooks read: forward(positions, hidden_states, residual, ...) -> (hidden, residual)
    params = list(inspect.signature(layers[0].forward).parameters)
    if params[:2] != ["positions", "hidden_states"] or "residual" not in params:
        raise RuntimeError(f"eyas: {type(layers[0]).__name__}.forward{tuple(params)} is not the "
                           "(positions, hidden_states, residual) decoder-layer API the hooks path reads")

    def total(hidden: torch.Tensor, residual: Any) -> torch.Tensor:
        # vLLM layers pass (hidden, residual) separately; the residual stream is their sum
        return (hidden + residual if isinstance(residual, torch.Tensor) else hidden).detach().to("cpu", copy=True)

    # vLLM's compiled-model decorator calls the decoder's forward directly (module hooks on it never
    # fire), so the token ids come from the embedding and a record opens at layer 0.
    embed = getattr(inner, "embed_tokens", None)
    if not isinstance(embed, torch.nn.Module):
        raise RuntimeError(f"eyas: {type(inner).__name__} has no embed_tokens module to read token ids from")

    def on_embed(_m: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        worker._eyas_ids = ids.detach().to("cpu", copy=True)

    def pre(k: int) -> Callable:
        def hook(_m: Any, args: tuple, kwargs: dict) -> None:
            if k == 0:
                pos = kwargs.get("positions", args[0] if args else None)
                worker._eyas_records.append({"input_ids": worker._eyas_ids,
                                             "positions": pos.detach().to("cpu", copy=True)})
            hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
            residual = kwargs.get("residual", args[2] if len(args) > 2 else None)
            if k in wanted:
                worker._eyas_records[-1][k] = total(hidden, residual)
        return hook

    def post(_m: Any, _args: tuple, _kwargs: dict, out: Any) -> None:
        hidden, residual = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
        worker._eyas_records[-1][num_layers] = total(hidden, residual)

    wanted = set(layer_ids)
    worker._eyas_hooks.append(embed.register_forward_pre_hook(on_embed, with_kwargs=True))
    for k in sorted(wanted | {0}):
        if k < num_layers:
            worker._eyas_hooks.append(layers[k].register_forward_pre_hook(pre(k), with_kwargs=True))
    worker._eyas_hooks.append(layers[num_layers - 1].register_forward_hook(post, with_kwargs=True))
    return True


def take_records(worker: Any) -> list[dict] | None:
    """The records of the forward steps since the last call (None on ranks without hooks)."""
    records = getattr(worker, "_eyas_records", None)
    worker._eyas_records = []
    return records if getattr(worker, "_eyas_hooks", None) else None


def remove_hooks(worker: Any) -> bool:
    for h in getattr(worker, "_eyas_hooks", []):
        h.remove()
    worker._eyas_hooks = []
    worker._eyas_records = []
    return True
