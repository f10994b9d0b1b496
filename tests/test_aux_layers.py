"""The aux-layer convention (eyas.model.aux_layers): one default rule, one check, and ids that cross
every layout's boundary without a silent shift by one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from eyas.export import ServeOptions, export_draft
from eyas.model.aux_layers import (
    CONVENTION_KEY,
    INPUT,
    OUTPUT,
    check_aux_layer_ids,
    default_aux_layer_ids,
    from_layout,
    to_layout,
)
from eyas.model.checkpoints import import_draft
from eyas.model.config import DraftConfig
from eyas.model.eagle3 import Eagle3Draft
from eyas.model.vocab import build_draft_vocab
from eyas.recipes.export import ExportOptions, run_export
from eyas.utils.io import EyasError

V, LAYERS = 300, 8


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=V, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target") / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_draft(target_dir: Path, ids: list[int]) -> Eagle3Draft:
    cfg = DraftConfig.from_target_config(AutoConfig.from_pretrained(target_dir), ids, 120, target=str(target_dir))
    draft = Eagle3Draft(cfg)
    draft.set_vocab(*build_draft_vocab(torch.randint(0, 1000, (V,)), 120))
    draft.load_target_embedding(load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"])
    return draft


def edit(folder: Path, fn) -> None:
    data = json.loads((folder / "config.json").read_text())
    fn(data)
    (folder / "config.json").write_text(json.dumps(data))


def test_default_rule_gives_distinct_ids_or_a_clear_error():
    assert default_aux_layer_ids(61) == [2, 30, 58] and default_aux_layer_ids(7) == [2, 3, 4]
    for n in range(3, 70):
        ids = default_aux_layer_ids(n)
        assert check_aux_layer_ids(ids, n) == ids and len(ids) == 3, n
    assert default_aux_layer_ids(5) == [1, 2, 4]  # the rule alone gives [2, 2, 2]
    with pytest.raises(EyasError, match="2 decoder layer.*--aux-layers"):
        default_aux_layer_ids(2)


def test_one_check_refuses_duplicates_range_and_order():
    with pytest.raises(EyasError, match="read twice"):
        check_aux_layer_ids([1, 2, 2], 6)
    assert check_aux_layer_ids([1, 6], 6) == [1, 6]  # N: the last layer's output, which vLLM collects too
    with pytest.raises(EyasError, match=r"\[6\] out of range.*0\.\.5"):  # the capture engines hook layer inputs
        check_aux_layer_ids([1, 6], 6, captured=True)
    with pytest.raises(EyasError, match=r"\[7\] out of range.*0\.\.6"):
        check_aux_layer_ids([1, 7], 6)
    with pytest.raises(EyasError, match=r"\[-1\] out of range"):
        check_aux_layer_ids([-1, 2], 6)
    with pytest.raises(EyasError, match="layer order"):
        check_aux_layer_ids([3, 1], 6)
    with pytest.raises(EyasError, match="read twice"):  # a draft config for a target refuses them too
        DraftConfig.from_target_config(LlamaConfig(num_hidden_layers=6, hidden_size=64, num_attention_heads=4),
                                       [2, 2, 3])


def test_converters_are_inverse_and_name_the_shift():
    ids = [2, 4, 7]
    assert to_layout(ids, INPUT) == ids and to_layout(ids, OUTPUT) == [1, 3, 6]
    for convention in (INPUT, OUTPUT):
        assert from_layout(to_layout(ids, convention), convention) == ids
    with pytest.raises(EyasError, match="convention 'output'"):
        from_layout(ids, "output")


@pytest.mark.parametrize("fmt, field, convention", [
    ("vllm", ("eagle_aux_hidden_state_layer_ids",), INPUT),
    ("speculators", ("eagle_aux_hidden_state_layer_ids",), INPUT),
    ("sglang", ("eagle_config", "eagle_aux_hidden_state_layer_ids"), OUTPUT),
])
def test_round_trip_through_each_layout_and_a_shift_by_one_is_refused(tmp_path, target_dir, fmt, field, convention):
    draft = make_draft(target_dir, [2, 4, 5])
    out = export_draft(draft, tmp_path / fmt, fmt, ServeOptions(verifier=str(target_dir), dtype="float32"))
    data = json.loads((out / "config.json").read_text())
    written = data[field[0]] if len(field) == 1 else data[field[0]][field[1]]
    assert written == to_layout([2, 4, 5], convention) and data["eyas"][CONVENTION_KEY] == convention
    assert import_draft(out, target=target_dir).config.aux_layer_ids == [2, 4, 5]
    # vLLM -> eyas -> SGLang -> eyas: the same layers every time
    again = export_draft(import_draft(out), tmp_path / "again", "sglang", ServeOptions(dtype="float32"))
    assert import_draft(again).config.aux_layer_ids == [2, 4, 5]

    def shift(c):  # what a hand edit, or a writer of the other convention, does
        holder = c if len(field) == 1 else c[field[0]]
        holder[field[-1]] = [i + 1 for i in holder[field[-1]]]

    edit(out, shift)
    with pytest.raises(EyasError, match="shifted by one"):
        import_draft(out, target=target_dir)
    with pytest.raises(EyasError, match="shifted by one"):  # and so never re-exported for serving
        run_export(ExportOptions(draft=out, out=tmp_path / "served", format="vllm", model=str(target_dir)),
                   log=lambda m: None)


def test_a_config_whose_ids_claim_the_other_convention_is_refused(tmp_path, target_dir):
    out = export_draft(make_draft(target_dir, [2, 4, 5]), tmp_path / "s", "sglang", ServeOptions(dtype="float32"))
    edit(out, lambda c: c["eyas"].update({CONVENTION_KEY: INPUT}))  # SGLang adds 1 to these ids whatever it says
    with pytest.raises(EyasError, match="one layer off"):
        import_draft(out)


def test_export_never_relabels_a_drafts_ids_unless_forced(tmp_path, target_dir):
    draft = make_draft(target_dir, [1, 2, 4])
    draft.save_pretrained(tmp_path / "draft")
    opts = dict(draft=tmp_path / "draft", format="vllm", model=str(target_dir))
    with pytest.raises(EyasError, match=r"trained on aux layers \[1, 2, 4\].*--force-aux-layers"):
        run_export(ExportOptions(out=tmp_path / "a", aux_layer_ids=[2, 3, 4], **opts), log=lambda m: None)
    same = run_export(ExportOptions(out=tmp_path / "b", aux_layer_ids=[1, 2, 4], **opts), log=lambda m: None)
    assert json.loads((same[0] / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    said = []
    forced = run_export(ExportOptions(out=tmp_path / "c", aux_layer_ids=[2, 3, 4], force_aux_layers=True, **opts),
                        log=said.append)
    assert json.loads((forced[0] / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert any(re.search(r"--force-aux-layers: relabelled the draft's aux layer ids \[1, 2, 4\] -> \[2, 3, 4\]", m)
               for m in said), said


@pytest.mark.parametrize(("ids", "why"), [([2, 2, 2], "read twice"), ([7, 8, 9], r"\[9\] out of range .*0\.\.8"),
                                          ([-3, -2, -1], r"\[-3, -2, -1\] out of range")])
def test_forced_ids_without_a_target_are_checked_against_the_drafts_target(tmp_path, target_dir, ids, why):
    """Without --model, the layer count the draft recorded at training bounds --force-aux-layers' ids."""
    make_draft(target_dir, [1, 2, 4]).save_pretrained(tmp_path / "draft")
    with pytest.raises(EyasError, match=rf"draft: --aux-layers {re.escape(str(ids))}.*{why}"):
        run_export(ExportOptions(draft=tmp_path / "draft", out=tmp_path / "x", aux_layer_ids=ids,
                                 force_aux_layers=True), log=lambda m: None)
    assert not (tmp_path / "x").exists()


def test_sglang_export_of_a_draft_reading_the_last_layers_output_is_refused(tmp_path, target_dir):
    """vLLM collects id N (the last layer's output); SGLang hooks decoder-layer inputs 0..N-1 only, so a config
    naming N would serve the draft fewer states than it was trained on."""
    make_draft(target_dir, [2, 4, LAYERS]).save_pretrained(tmp_path / "draft")
    with pytest.raises(EyasError, match=rf"SGLang captures the inputs of decoder layers 0\.\.{LAYERS - 1} only.*"
                                        rf"\[2, 4, {LAYERS}\]. Export --format vllm"):
        run_export(ExportOptions(draft=tmp_path / "draft", out=tmp_path / "s", format="sglang"), log=lambda m: None)
    assert not (tmp_path / "s").exists()
    vllm = run_export(ExportOptions(draft=tmp_path / "draft", out=tmp_path / "v", format="vllm"), log=lambda m: None)
    assert json.loads((vllm[0] / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, LAYERS]
