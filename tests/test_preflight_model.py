"""The preflight checks the model that was loaded, not the model against itself: a checkpoint that lacks
weights is refused naming them (unless allowed), a NaN or zero final norm or lm_head is named, and
samples with images go through it with their images (hf engine; the vllm engine in test_kimi_vllm.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from _train_utils import VOCAB, make_target
from safetensors.torch import load_file, save_file

from eyas.engines.hf import HFEngine
from eyas.engines.preflight import PreflightError, preflight_engine, preflight_samples
from eyas.engines.weights import MissingWeightsError
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target") / "t")


def _seqs():
    g = torch.Generator().manual_seed(1)
    return preflight_samples([{"input_ids": torch.randint(0, VOCAB, (n,), generator=g)} for n in (60, 40, 9, 30)])


def _edited(target, out, edit):
    """A copy of the target folder with its weights changed by `edit(state_dict)`."""
    import shutil

    shutil.copytree(target, out)
    state = load_file(str(out / "model.safetensors"))
    edit(state)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("weight, value, words", [
    ("model.norm.weight", float("nan"), "the final norm's weight holds 1 NaN/inf"),
    ("model.norm.weight", 0.0, "the final norm's weight is all zeros"),
    ("lm_head.weight", 0.0, "lm_head is all zeros"),
    ("lm_head.weight", float("inf"), "lm_head holds"),
])
def test_a_damaged_head_is_named(target, tmp_path, weight, value, words):
    def damage(state):
        if value == 0.0:
            state[weight].zero_()
        else:
            state[weight].view(-1)[5] = value

    engine = HFEngine(str(_edited(target, tmp_path / "t", damage)), aux_layer_ids=[1, 3, 4], dtype="float32",
                      device="cpu")
    with pytest.raises(PreflightError) as e:
        preflight_engine(engine, _seqs())
    assert e.value.kinds == ["head_weights"] and words in str(e.value), str(e.value)


def test_the_clean_target_passes(target):
    engine = HFEngine(str(target), aux_layer_ids=[1, 3, 4], dtype="float32", device="cpu")
    assert preflight_engine(engine, _seqs())["reference"]


@pytest.mark.parametrize("dropped", [["lm_head.weight"], ["model.layers.2.mlp.up_proj.weight",
                                                           "model.layers.4.self_attn.q_proj.weight"]])
def test_weights_the_checkpoint_lacks_are_named_unless_allowed(target, tmp_path, dropped):
    from eyas.recipes.extract import ExtractOptions, run_extract

    folder = _edited(target, tmp_path / "t", lambda state: [state.pop(k) for k in dropped])
    with pytest.raises(MissingWeightsError, match=rf"lacks {len(dropped)} weight\(s\).*{dropped[0]}.*"
                                                  "--allow-missing-weights"):
        HFEngine(str(folder), aux_layer_ids=[1, 3, 4], dtype="float32", device="cpu")
    engine = HFEngine(str(folder), aux_layer_ids=[1, 3, 4], dtype="float32", device="cpu", allow_missing_weights=True)
    assert engine.num_layers == 6
    data = [{"input_ids": torch.arange(20), "loss_mask": torch.ones(20, dtype=torch.bool)}]
    with pytest.raises(EyasError, match=dropped[0]):  # the stage: one error line, before any work
        run_extract(ExtractOptions(prepared=tmp_path / "none", out=tmp_path / "store", model=str(folder),
                                   aux_layer_ids=[1, 3, 4], dtype="float32", device="cpu"), dataset=_Data(data))
    assert not (tmp_path / "store").exists()


def _kimi_without(tmp_path, drop) -> Path:
    """The tiny Kimi-K2.5 (real layout) with the tensors whose names `drop(name)` selects deleted."""
    from _kimi import make_kimi

    folder = make_kimi(tmp_path / "kimi")
    state = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not drop(k)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def test_missing_weights_are_named_from_the_checkpoints_names_alone(target, tmp_path):
    """The check an engine that loads weights itself (vLLM) runs first: checkpoint names renamed as
    transformers renames them, against the model built on the meta device; tied and merged weights count."""
    from eyas.engines.weights import missing_weights

    assert missing_weights(target) == []
    dropped = ["model.layers.2.mlp.up_proj.weight", "model.norm.weight"]
    assert missing_weights(_edited(target, tmp_path / "t", lambda st: [st.pop(k) for k in dropped])) == sorted(
        dropped, key=lambda k: k != dropped[0])
    routed = re.compile(r"layers\.[1-3]\.mlp\.experts\.\d+\.")  # layer 0 is dense; shared experts stay
    assert missing_weights(_kimi_without(tmp_path / "a", lambda k: False)) == []
    assert missing_weights(_kimi_without(tmp_path / "b", routed.search)) == [
        f"model.language_model.layers.{i}.mlp.experts.{w}" for i in (1, 2, 3)
        for w in ("gate_up_proj", "down_proj")]
    one = _kimi_without(tmp_path / "c", lambda k: ".layers.2.mlp.experts.3.down_proj" in k)
    assert missing_weights(one) == ["model.language_model.layers.2.mlp.experts.down_proj (3 of 4 experts)"]


def test_the_vllm_engine_names_missing_weights_before_vllm_starts(tmp_path):
    """Without the check, vLLM ran the uninitialized experts and capture stopped at non-finite states,
    blaming the capture path; the check needs no vLLM, so it runs here too."""
    from eyas.engines.vllm import VllmEngine

    folder = _kimi_without(tmp_path, re.compile(r"layers\.[1-3]\.mlp\.experts\.\d+\.").search)
    with pytest.raises(MissingWeightsError, match=r"lacks 6 weight\(s\).*layers\.1\.mlp\.experts\.gate_up_proj, "
                                                  r".*vLLM would run with them uninitialized.*"
                                                  "--allow-missing-weights"):
        VllmEngine(str(folder), aux_layer_ids=[1, 2, 3])


class _Data(list):
    @property
    def lengths(self):
        return [len(d["input_ids"]) for d in self]


def test_a_missing_weight_in_a_reference_copy_is_named_too(target, tmp_path):
    """Engines that run the target elsewhere (vLLM) are checked against a CPU transformers copy: one that
    lacks weights is refused, not compared with itself."""
    from eyas.engines.preflight import load_reference_copy

    folder = _edited(target, tmp_path / "t", lambda state: state.pop("lm_head.weight"))
    with pytest.raises(MissingWeightsError, match="lm_head.weight"):
        load_reference_copy(folder)
    assert load_reference_copy(folder, allow_missing_weights=True)[0] is not None
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False


def test_regenerate_refuses_a_target_whose_logits_are_nan(tmp_path, smollm2_dir):
    """A NaN final norm makes every logit NaN, whose argmax agrees with any reply: the generator check names it."""
    import transformers as tf

    from eyas.recipes.regenerate import RegenerateOptions, run_regenerate

    tok = tf.AutoTokenizer.from_pretrained(smollm2_dir)
    torch.manual_seed(0)
    tiny = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=1, vocab_size=len(tok),
                                              eos_token_id=tok.eos_token_id)).eval()
    with torch.no_grad():
        tiny.model.norm.weight[3] = float("nan")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                    {"role": "assistant", "content": "OLD"}]}) + "\n"
                           for q in ("Hi", "Name a color.")))
    with pytest.raises(PreflightError, match=r"\[final_head\] the target's own logits over its prompts are not finite"):
        run_regenerate(RegenerateOptions(inputs=[str(src)], out=tmp_path / "out.jsonl", max_new_tokens=3,
                                         engine="generate"), model=tiny, tokenizer=tok)
    assert not (tmp_path / "out.jsonl").exists()
