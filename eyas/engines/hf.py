"""The `hf` engine: any transformers causal LM, hidden states captured with hooks on the needed layers.

Why hooks and not `output_hidden_states=True`: that keeps every layer's [B, T, H] alive (61 layers
of a large target) and runs the final norm and the lm_head (full-vocabulary logits, the biggest
matmul of the model) for nothing. Here a forward pre-hook on decoder layer k takes its input
(= transformers' `hidden_states[k]`), a pre-hook on the final norm takes the last layer's output
and stops the forward there. Only the text decoder runs, so a vision-language wrapper's vision
tower is never touched.

Batches are right-padded with an attention mask: with a causal mask, padding after a sequence
cannot change its states, so a ragged batch equals one-at-a-time runs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from eyas.data.media import SampleMedia
from eyas.engines.base import (
    Capture,
    FlatCapture,
    TargetEngine,
)
from eyas.engines.decoder import find_text_decoder
from eyas.engines.head import TargetHead
from eyas.engines.weights import check_loaded
from eyas.model.aux_layers import check_aux_layer_ids, default_aux_layer_ids
from eyas.model.config import text_config
from eyas.utils.devices import resolve_device, resolve_dtype
from eyas.utils.io import EyasError


class _StopForward(Exception):
    """Raised by the final-norm hook: everything after the last decoder layer is skipped."""


def load_hf_model(model: str, dtype: torch.dtype, device: torch.device, device_map: str | None = None,
                  attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                  allow_missing_weights: bool = False) -> nn.Module:
    """AutoModelForCausalLM, falling back to AutoModelForImageTextToText for vision-language wrappers.
    Weights the checkpoint lacks are a `MissingWeightsError` naming them, unless `allow_missing_weights`."""
    import transformers

    kwargs: dict[str, Any] = dict(dtype=dtype, attn_implementation=attn_implementation,
                                  trust_remote_code=trust_remote_code, output_loading_info=True)
    kwargs["device_map"] = device_map if device_map else {"": str(device)}
    quant = (_read_config(model).get("quantization_config") or {}).get("quant_method")
    errors = []
    for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        cls = getattr(transformers, auto, None)
        if cls is None:
            continue
        try:
            if quant == "compressed-tensors":  # dequantized at load: packed attention layers then load too
                kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
            with warnings.catch_warnings():  # "the model's quantization_config will be used": as meant
                warnings.filterwarnings("ignore", message="You passed `quantization_config`")
                loaded, info = cls.from_pretrained(model, **kwargs)
            check_loaded(model, info.get("missing_keys") or [], allow_missing_weights)
            return _upcast_dequantized(loaded, dtype, quant is not None)
        except ValueError as e:
            if "Unrecognized configuration class" not in str(e):  # not "another AutoModel class": a real failure
                raise EyasError(f"transformers cannot load target '{model}': {str(e)[:600]}") from e
            errors.append(f"{auto}: {e}")
        except ImportError as e:  # a quantized checkpoint whose package is missing (compressed-tensors, ...)
            raise EyasError(f"target '{model}' is quantized ({quant or '?'}) and loading it needs a package that "
                            f"is not installed here: {str(e).strip()[:400]}") from e
        except OSError as e:
            raise EyasError(f"cannot load target '{model}': {e}. Give a local transformers folder or a hub id "
                            "that is in the local cache.") from e
    raise EyasError(f"transformers cannot load '{model}' as a causal LM: " + " | ".join(errors)[:800])


def _read_config(model: str) -> dict:
    """A local folder's config.json ({} when there is none to read)."""
    import json
    from pathlib import Path

    path = Path(model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _upcast_dequantized(model: nn.Module, dtype: torch.dtype, quantized: bool) -> nn.Module:
    """A quantized checkpoint that transformers dequantizes at load (compressed-tensors W4A16 experts;
    block FP8 on a CPU) keeps those weights in their scales' dtype (bf16) whatever dtype was asked, and
    `model.to()` is refused on a quantized model: upcast them in place, so a float32 engine computes
    (and captures) in float32. Never downcasts (weights kept in float32 on purpose stay so)."""
    if not quantized or dtype != torch.float32:
        return model
    for p in model.parameters():
        if p.dtype in (torch.bfloat16, torch.float16):
            p.data = p.data.float()
    return model


class HFEngine(TargetEngine):
    """Hidden-state capture from a transformers model (a path/hub id, or an already built nn.Module)."""

    name = "hf"

    def __init__(
        self,
        model: str | nn.Module,
        aux_layer_ids: list[int] | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = "auto",
        device_map: str | None = None,
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
        compile: bool = False,
        allow_missing_weights: bool = False,
    ) -> None:
        if compile and device_map is not None:
            raise EyasError("--compile runs the target on one device; drop --device-map (or --compile)")
        dev = resolve_device(device)
        self.dtype = resolve_dtype(dtype, dev)
        if isinstance(model, nn.Module):
            self.model = model
            self.model_name = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
            if device_map is None:
                self.model.to(device=dev, dtype=self.dtype)
        else:
            self.model_name = str(model)
            self.model = load_hf_model(str(model), self.dtype, dev, device_map, attn_implementation,
                                       trust_remote_code, allow_missing_weights)
        self.model.eval().requires_grad_(False)
        self.config = self.model.config
        self.text_model, self.layers, self.norm = find_text_decoder(self.model)
        text_cfg = text_config(self.config)
        self.text_config = text_cfg
        self.num_layers = min(len(self.layers), int(getattr(text_cfg, "num_hidden_layers", len(self.layers))))
        self.hidden_size = int(text_cfg.hidden_size)
        out = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        self.vocab_size = int(out.weight.shape[0]) if out is not None else int(text_cfg.vocab_size)
        ids = default_aux_layer_ids(self.num_layers) if aux_layer_ids is None else list(aux_layer_ids)
        self.aux_layer_ids = check_aux_layer_ids(ids, self.num_layers, captured=True)
        embed = self.text_model.get_input_embeddings()
        self.device = embed.weight.device  # inputs go here, captures come back here
        pad = getattr(text_cfg, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < embed.weight.shape[0] else 0

        # hooks: only on the aux layers and the final norm; idle unless a capture is running
        self._active = False
        self._rows: torch.Tensor | None = None  # [N] rows of the flattened [B*T] batch that are real tokens
        self._stash: dict[Any, torch.Tensor] = {}
        self._hooks = [self.layers[k].register_forward_pre_hook(self._layer_hook(k), with_kwargs=True)
                       for k in sorted(set(self.aux_layer_ids))]
        last = self.layers[self.num_layers - 1]
        if self.norm is not None:
            self._hooks.append(self.norm.register_forward_pre_hook(self._final_pre_hook))
        else:  # no final norm found: take the last layer's output (the forward then runs to the end)
            self._hooks.append(last.register_forward_hook(self._final_post_hook))
        self._compiled = compile
        if compile:
            compile_layers(self.layers[: self.num_layers])

    def _uncompile(self) -> None:
        uncompile_layers(self.layers)
        self._compiled = False

    # ---- hooks ------------------------------------------------------------------------------
    def _keep(self, key: Any, h: torch.Tensor) -> None:
        h = h.reshape(-1, self.hidden_size)  # [B*T, H]
        if self._rows is not None:
            h = h.index_select(0, self._rows.to(h.device, non_blocking=True))  # [N, H], padding dropped
        self._stash[key] = h.to(self.device, non_blocking=True)

    def _layer_hook(self, k: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._active:
                self._keep(k, args[0] if args else kwargs["hidden_states"])
        return hook

    def _final_pre_hook(self, module: nn.Module, args: tuple) -> None:
        if self._active:
            self._keep("final", args[0])
            raise _StopForward

    def _final_post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._active:
            self._keep("final", output[0] if isinstance(output, tuple) else output)

    # ---- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_flat(self, seqs: list[torch.Tensor], media: list[SampleMedia | None] | None = None) -> FlatCapture:
        """Run one batch; returns states on `self.device` without any host<->device sync of our own.

        Samples with images (`media[i]` not None) run one by one through the whole model, so its vision
        tower embeds their images; the text-only samples of the batch run together as usual."""
        if not seqs:
            raise ValueError("capture() needs at least one sequence")
        lengths = [int(s.shape[0]) for s in seqs]
        if min(lengths) < 1:
            raise EyasError("cannot capture an empty sequence (0 tokens); drop it from the dataset")
        if media is not None and any(m is not None for m in media):
            return self._capture_with_images(seqs, media)
        B, T = len(seqs), max(lengths)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, : lengths[b]] = s
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        ragged = min(lengths) != T
        if ragged:  # right padding: real tokens are rows b*T + [0, len_b) of the flattened batch
            mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # [B, T]
            self._rows = mask.reshape(-1).nonzero().squeeze(1).to(self.device, non_blocking=True)
            attention_mask = mask.long().to(self.device, non_blocking=True)
        else:
            self._rows, attention_mask = None, None  # plain causal: no mask built, no padding to drop
        pin = self.device.type == "cuda"
        ids = (ids.pin_memory() if pin else ids).to(self.device, non_blocking=True)
        aux, final = self._hooked(self.text_model, input_ids=ids, attention_mask=attention_mask)
        return FlatCapture(aux, final, cu)

    def _hooked(self, forward: nn.Module, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [N, k*H], final [N, H]) of one forward with the hooks on; `self._rows` picks the rows."""
        rows, self._stash, self._active = self._rows, {}, True
        try:
            forward(**inputs, use_cache=False)
        except _StopForward:
            pass
        except (torch.OutOfMemoryError, EyasError):
            raise
        except Exception as e:
            if not self._compiled:
                raise
            import warnings

            why = " ".join(str(e).split())[:160]
            warnings.warn(f"torch.compile failed on {self.model_name}'s decoder layers ({type(e).__name__}: {why}); "
                          "running them uncompiled (--no-compile skips the attempt)", stacklevel=2)
            self._uncompile()
            self._rows = rows
            return self._hooked(forward, **inputs)
        finally:
            self._active, self._rows = False, None
        stash, self._stash = self._stash, {}
        missing = [k for k in [*self.aux_layer_ids, "final"] if k not in stash]
        if missing:
            raise RuntimeError(f"hooks did not fire for layers {missing} of {type(self.text_model).__name__}")
        return torch.cat([stash[k] for k in self.aux_layer_ids], dim=-1), stash["final"]

    def _capture_with_images(self, seqs: list[torch.Tensor], media: list[SampleMedia | None]) -> FlatCapture:
        if getattr(self.config, "vision_config", None) is None:
            raise EyasError(f"the samples hold images but {self.model_name} reads only text: prepare the data "
                            "with this target (`eyas prepare --model`), which skips image rows for it")
        parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        text = [i for i, m in enumerate(media) if m is None]
        if text:
            flat = self.capture_flat([seqs[i] for i in text])
            parts.update({i: (c.aux, c.final) for i, c in zip(text, flat.split(), strict=True)})
        for i, m in enumerate(media):
            if m is not None:  # the wrapper's forward: vision tower, projector, then the hooked text decoder
                parts[i] = self._hooked(self.model, input_ids=seqs[i][None].to(self.device),
                                        **m.model_inputs(self.dtype, self.device))
        cu = [0]
        for s in seqs:
            cu.append(cu[-1] + int(s.shape[0]))
        order = range(len(seqs))
        return FlatCapture(torch.cat([parts[i][0] for i in order]), torch.cat([parts[i][1] for i in order]), cu)

    def capture(self, seqs: list[torch.Tensor], media: list[SampleMedia | None] | None = None) -> list[Capture]:
        """One Capture per sequence; tensors stay on `self.device` (views into one batch buffer)."""
        return self.capture_flat(seqs, media).split()

    # ---- head -------------------------------------------------------------------------------
    @torch.no_grad()
    def target_head(self) -> TargetHead:
        """The head in the engine's dtype, on the CPU (the store saves it as bf16)."""
        embed = self.text_model.get_input_embeddings()
        lm_head = self.model.get_output_embeddings()
        if lm_head is None or self.norm is None:
            raise EyasError(f"{type(self.model).__name__} has no lm_head or final norm that eyas can find")
        scale = getattr(embed, "scalar_embed_scale", None) or getattr(embed, "embed_scale", None)
        embed_scale = float(scale) if scale is not None else 1.0
        eps = next((float(getattr(self.norm, a)) for a in ("variance_epsilon", "eps")
                    if isinstance(getattr(self.norm, a, None), (int, float))),
                   float(getattr(self.text_config, "rms_norm_eps", 1e-6)))
        norm_offset = _probe_norm_offset(self.norm, eps)
        if getattr(self.text_config, "final_logit_softcapping", None):
            import warnings

            warnings.warn("the target soft-caps its logits; eyas' TargetHead does not (the argmax is unchanged)",
                          stacklevel=2)
        return TargetHead(
            embed_tokens=embed.weight.detach().to("cpu"),
            norm_weight=self.norm.weight.detach().to("cpu"),
            lm_head=lm_head.weight.detach().to("cpu"),
            norm_eps=eps, norm_offset=norm_offset, embed_scale=embed_scale,
        )

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._uncompile()  # a model handed in leaves as it came


def compile_layers(layers: Any) -> None:
    """torch.compile each decoder layer's forward, so its norms, rotary and activation fuse.

    Per layer and not the whole decoder: hooks on the layers (eyas' captures, the stop at the final norm) stay
    eager, and all layers share the compiled graphs: one for a batch of one, one for any larger batch, one
    more for ragged batches (they carry a mask)."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


def uncompile_layers(layers: Any) -> None:
    """Undo compile_layers: each layer's own forward again."""
    for layer in layers:
        layer.__dict__.pop("forward", None)


def _probe_norm_offset(norm: nn.Module, eps: float) -> float:
    """0.0 for RMSNorm `x̂ * w`, 1.0 for Gemma's `x̂ * (1 + w)`; refuses a norm that is neither."""
    w = norm.weight.detach().float()
    x = torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0))
    y = norm(x.to(norm.weight.device, norm.weight.dtype)).float().cpu()
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    w = w.cpu()
    errs = {off: ((y - xn * (w + off)).norm() / (y.norm() + 1e-12)).item() for off in (0.0, 1.0)}
    off = min(errs, key=errs.get)
    if errs[off] > 2e-2:
        raise EyasError(f"the target's final norm ({type(norm).__name__}) is not an RMSNorm (x̂*w or x̂*(1+w)); "
                        "eyas' TargetHead cannot reproduce it")
    return off
