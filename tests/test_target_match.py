"""The target is checked against the data before any work: extract, online train and eval refuse prepared
data made with another tokenizer or vocabulary, naming both; prepare refuses a tokenizer that spells plain
English out character by character."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _kimi import KIMI_CHAT_TEMPLATE, KIMI_SPECIALS, byte_tokenizer
from _train_utils import make_target

from eyas.recipes.prepare import PrepareOptions, run_prepare
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


def _chats(folder):
    path = folder / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Say something about the number {i}."},
                          {"role": "assistant", "content": f"The number {i} comes after {i - 1}."}]} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prepare(model, root):
    return run_prepare(PrepareOptions(inputs=[str(_chats(root))], model=str(model), out=root / "prepared",
                                      num_workers=1))


def _byte_target(folder, specials):
    """A tiny Llama with a byte-level tokenizer (its vocabulary: 256 bytes + `specials`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer(specials, bos_token="[BOS]", eos_token="[EOS]", pad_token="[EOS]")
    tok.chat_template = KIMI_CHAT_TEMPLATE
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=len(tok))).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _stages(prepared, target, tmp_path):
    """Extract, online train and eval of `prepared` with `target`, each as a call."""
    from eyas.recipes.evaluate import EvalOptions, run_eval
    from eyas.recipes.extract import ExtractOptions, run_extract
    from eyas.recipes.train import TrainOptions, run_train

    return {
        "extract": lambda: run_extract(ExtractOptions(prepared=prepared, out=tmp_path / "store", model=str(target),
                                                      aux_layer_ids=[1, 3, 4], device="cpu")),
        "train": lambda: run_train(TrainOptions(prepared=prepared, out=tmp_path / "run", model=str(target),
                                                online=True, aux_layer_ids=[1, 3, 4], device="cpu"),
                                   log=lambda m: None),
        "eval": lambda: run_eval(EvalOptions(draft="random", model=str(target), prompts=str(prepared),
                                             out=tmp_path / "eval", device="cpu"), log=lambda m: None),
    }


def test_data_prepared_for_another_vocabulary_is_refused_by_every_stage(tmp_path, smollm2_dir):
    prepared = _prepare(smollm2_dir, tmp_path)
    target = make_target(tmp_path / "tiny")  # vocabulary 64
    for stage, start in _stages(prepared, target, tmp_path).items():
        with pytest.raises(EyasError, match=r"prepared with the tokenizer of .*SmolLM2.*\(vocabulary 49,152\), but "
                                            r"the target .* has a vocabulary of 64"):
            start()
        assert not any(p.name.startswith(("store", "run", "eval")) for p in tmp_path.iterdir()), stage


def test_data_prepared_with_a_tokenizer_of_the_same_size_but_other_ids_is_refused(tmp_path):
    mine = _byte_target(tmp_path / "mine", KIMI_SPECIALS)
    other = _byte_target(tmp_path / "other", KIMI_SPECIALS[:2] + KIMI_SPECIALS[2:][::-1])  # same size, other ids
    prepared = _prepare(mine, tmp_path)
    with pytest.raises(EyasError, match="maps text to other ids than the target"):
        _stages(prepared, other, tmp_path)["extract"]()
    _stages(prepared, mine, tmp_path)["extract"]()  # its own target passes
    assert (tmp_path / "store" / "manifest.json").is_file()


def test_a_tokenizer_that_spells_english_out_is_refused(tmp_path, smollm2_dir):
    """SmolLM2's tokenizer without its merges: what a GGUF tokenizer reloaded character by character is."""
    folder = tmp_path / "lost-merges"
    shutil.copytree(smollm2_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["merges"] = []
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(EyasError, match=r"splits plain English into \d+ tokens for 17 words .* lost its merges"):
        _prepare(folder, tmp_path)
    (tmp_path / "intact").mkdir()
    assert _prepare(smollm2_dir, tmp_path / "intact").is_dir()  # the intact tokenizer passes


def test_the_target_fingerprint_covers_every_field_that_changes_the_states():
    """Three Kimi targets that differ only in an MLA rank or the rope dims: the 7-field fingerprint eyas
    recorded before gave them one hash; the whole text config (less names, paths and dtypes) tells them apart."""
    from _kimi import kimi_config, kimi_tokenizer

    from eyas.model.config import legacy_target_config_sha256, target_config_sha256

    tok = kimi_tokenizer()
    targets = [kimi_config(tok), kimi_config(tok, kv_lora_rank=256),
               kimi_config(tok, qk_rope_head_dim=32, qk_nope_head_dim=96)]
    assert len({target_config_sha256(c) for c in targets}) == 3
    assert len({legacy_target_config_sha256(c) for c in targets}) == 1
    moved = kimi_config(tok)
    moved._name_or_path, moved.architectures, moved.dtype = "/elsewhere/kimi", ["KimiK25ForConditionalGeneration"], \
        "bfloat16"
    assert target_config_sha256(moved) == target_config_sha256(targets[0])


def test_a_draft_with_an_older_fingerprint_is_checked_in_that_form_with_a_warning(tmp_path):
    """A draft saved before the whole-config fingerprint records the 7-field one: it is accepted on the target
    it matches (saying what that form cannot check) and refused on one it does not; the full one is exact."""
    import dataclasses

    from transformers import LlamaConfig

    from eyas.model.checkpoints import check_draft_target
    from eyas.model.config import DraftConfig, legacy_target_config_sha256

    def llama(**over):
        return LlamaConfig(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, vocab_size=300), **over})

    target, other_rope, other_size = llama(), llama(rope_theta=1e6), llama(intermediate_size=256)
    cfg = DraftConfig.from_target_config(target, [2, 4, 5], 120, target="tiny")
    check_draft_target(cfg, target, "draft")
    with pytest.raises(EyasError, match=r"draft: this draft does not fit .*target_config_sha256 .* != target's"):
        check_draft_target(cfg, other_rope, "draft")
    legacy = dataclasses.replace(cfg, target_config_sha256=legacy_target_config_sha256(target))
    with pytest.warns(UserWarning, match=r"draft: its target fingerprint is the older 7-field form"):
        check_draft_target(legacy, other_rope, "draft")  # a rope change that form cannot see
    with pytest.raises(EyasError, match=r"target_config_sha256 .* != target's"):
        check_draft_target(legacy, other_size, "draft")
