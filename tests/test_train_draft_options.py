"""Draft options through training: starting from a draft or from the target's head, a wider MLP, more
layers, EAGLE-3.1's norms, and a subset of the store's aux layers; each one carried to the saved and
exported draft, and a mismatch refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from _train_utils import metric_rows, run_tiny_train, train_store

from eyas.engines.hf import HFEngine
from eyas.model.checkpoints import import_draft
from eyas.model.eagle3 import Eagle3Draft
from eyas.store import HiddenStore
from eyas.train.data import PackDataset, PackSchedule, SampleSource, fill_states
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return train_store(tmp_path_factory.mktemp("train_options"))


def test_init_draft_starts_from_its_weights_and_vocabulary(data, tmp_path):
    """--init-draft: the run starts from the given draft (here in vLLM's layout), keeps its vocabulary
    over --draft-vocab-size, and learns on from where it was; a draft of another shape is refused."""
    import dataclasses

    from eyas.export import ServeOptions, export_draft

    target, _, store = data
    run_tiny_train(tmp_path / "first", store, max_steps=40)
    first = Eagle3Draft.from_pretrained(tmp_path / "first" / "draft")
    export_draft(first, tmp_path / "vllm", "vllm", ServeOptions(verifier=str(target), dtype="float32"))
    # lr 0: the optimizer moves nothing, so the written draft is the init draft itself
    run_tiny_train(tmp_path / "frozen", store, max_steps=1, lr=0.0, init_draft=tmp_path / "vllm", draft_vocab_size=40)
    frozen = Eagle3Draft.from_pretrained(tmp_path / "frozen" / "draft").state_dict()
    assert all(torch.equal(v, frozen[k]) for k, v in first.state_dict().items())
    # learning on: the first loss is the one the first run ended near, far below a fresh draft's
    run_tiny_train(tmp_path / "more", store, max_steps=3, init_draft=tmp_path / "first" / "draft")
    first_rows, more = metric_rows(tmp_path / "first"), metric_rows(tmp_path / "more")
    fresh, before = first_rows[0], first_rows[-1]
    assert more[0]["loss"] < 0.8 * fresh["loss"] and abs(more[0]["loss"] - before["loss"]) < 0.25 * before["loss"]
    other = Eagle3Draft(dataclasses.replace(first.config, aux_layer_ids=[0, 1, 2]))
    other.set_vocab(first.d2t, first.t2d)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(EyasError, match="does not fit this target.*aux_layer_ids \\[0, 1, 2\\]"):
        run_tiny_train(tmp_path / "bad", store, max_steps=1, init_draft=tmp_path / "other")


def test_init_head_starts_the_lm_head_as_the_targets_head(data, tmp_path):
    """--init-head: before any update the draft's logits over its vocabulary are the target's own logits
    of the same hidden state (the target's final norm folded into lm_head); the option changes the run's
    fingerprint, and together with --init-draft it is refused."""
    import dataclasses

    from eyas.model.vocab import draft_to_target_ids

    _, _, store = data
    plain = run_tiny_train(tmp_path / "plain", store, max_steps=1, lr=0.0)
    run = run_tiny_train(tmp_path / "head", store, max_steps=1, lr=0.0, init_head=True)
    assert run["options_sha256"] != plain["options_sha256"]
    draft = Eagle3Draft.from_pretrained(tmp_path / "head" / "draft")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, draft.config.hidden_size, generator=g) * 3

    def rel_err(head):
        want = head.logits(h)[:, draft_to_target_ids(draft.d2t)]
        return ((draft.logits(h) - want).norm() / want.norm()).item()

    head = HiddenStore(store).target_head()
    assert rel_err(head) < 1e-5
    from_target = draft.lm_head.weight.clone()
    draft.lm_head.weight.data = Eagle3Draft.from_pretrained(tmp_path / "plain" / "draft").lm_head.weight
    assert rel_err(head) > 0.5
    # a target whose final norm is not all ones, Gemma-style (1 + w): folded into lm_head, norm left at ones
    gemma = dataclasses.replace(head, norm_weight=torch.rand(head.hidden_size, generator=g), norm_offset=1.0,
                                lm_head=torch.randn(head.lm_head.shape, generator=g))
    draft.init_lm_head_from_target(gemma.lm_head, gemma.norm_weight, gemma.norm_offset)
    assert rel_err(gemma) < 1e-5 and rel_err(head) > 0.5 and not torch.equal(draft.lm_head.weight, from_target)
    with pytest.raises(EyasError, match="--init-head starts a fresh draft"):
        run_tiny_train(tmp_path / "both", store, max_steps=1, init_head=True, init_draft=tmp_path / "plain" / "draft")


def test_draft_intermediate_size_widens_the_mlp_through_export(data, tmp_path):
    """--draft-intermediate-size: the trained draft's MLP has that width, every export format says so and
    imports back to it, and it learns; --init-draft of the target's width is refused by name."""
    from eyas.export import ServeOptions, export_draft

    target, _, store = data
    narrow = Eagle3Draft.from_pretrained(_trained_narrow(tmp_path, store))
    wide_size = 3 * narrow.config.intermediate_size
    run_tiny_train(tmp_path / "wide", store, max_steps=40, draft_intermediate_size=wide_size)
    wide = Eagle3Draft.from_pretrained(tmp_path / "wide" / "draft")
    assert wide.config.intermediate_size == wide_size
    assert wide.layers[0].mlp.gate_proj.weight.shape == (wide_size, wide.config.hidden_size)
    rows = metric_rows(tmp_path / "wide")
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    for fmt in ("vllm", "speculators", "sglang"):
        export_draft(wide, tmp_path / fmt, fmt, ServeOptions(verifier=str(target), dtype="float32"))
        back = import_draft(tmp_path / fmt, target=str(target))
        assert back.config.intermediate_size == wide_size
        assert torch.equal(back.layers[0].mlp.down_proj.weight, wide.layers[0].mlp.down_proj.weight)
    with pytest.raises(EyasError, match=f"intermediate_size {narrow.config.intermediate_size} "
                                        f"\\(this run: {wide_size}\\)"):
        run_tiny_train(tmp_path / "bad", store, max_steps=1, draft_intermediate_size=wide_size,
              init_draft=tmp_path / "narrow" / "draft")
    with pytest.raises(EyasError, match="--draft-intermediate-size must be >= 0"):
        run_tiny_train(tmp_path / "neg", store, max_steps=1, draft_intermediate_size=-1)


def test_draft_layers_trains_a_deeper_draft(data, tmp_path):
    """--draft-layers 2: the draft gets a second (plain) decoder layer, learns, and a one-layer
    --init-draft is refused by name; fewer than one layer is refused."""
    _, _, store = data
    run_tiny_train(tmp_path / "two", store, max_steps=40, draft_layers=2)
    two = Eagle3Draft.from_pretrained(tmp_path / "two" / "draft")
    assert two.config.num_hidden_layers == 2 and len(two.layers) == 2 and not two.layers[1].first
    rows = metric_rows(tmp_path / "two")
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    one = _trained_narrow(tmp_path, store)
    with pytest.raises(EyasError, match="num_hidden_layers 1 \\(this run: 2\\)"):
        run_tiny_train(tmp_path / "bad", store, max_steps=1, draft_layers=2, init_draft=one)
    with pytest.raises(EyasError, match="--draft-layers must be >= 1"):
        run_tiny_train(tmp_path / "none", store, max_steps=1, draft_layers=0)


def test_eagle31_switches_train_export_and_import(data, tmp_path):
    """--fc-norm --norm-output: the draft carries one norm per aux layer and learns; vLLM and
    speculators exports say so and import back to the same tensors; SGLang's is refused (releases
    without the switches would drop them silently); a plain --init-draft is refused by name."""
    from eyas.export import ServeOptions, export_draft

    target, _, store = data
    run_tiny_train(tmp_path / "e31", store, max_steps=40, fc_norm=True, norm_output=True)
    draft = Eagle3Draft.from_pretrained(tmp_path / "e31" / "draft")
    assert draft.config.fc_norm and draft.config.norm_output and len(draft.fc_norm) == 3
    assert any(not torch.equal(n.weight, torch.ones_like(n.weight)) for n in draft.fc_norm)  # trained
    rows = metric_rows(tmp_path / "e31")
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    for fmt in ("vllm", "speculators"):
        export_draft(draft, tmp_path / fmt, fmt, ServeOptions(verifier=str(target), dtype="float32"))
        config = json.loads((tmp_path / fmt / "config.json").read_text())
        assert config["fc_norm"] is True and config["norm_output"] is True
        back = import_draft(tmp_path / fmt, target=str(target))
        assert back.config.fc_norm and back.config.norm_output
        assert all(torch.equal(a.weight, b.weight) for a, b in zip(back.fc_norm, draft.fc_norm, strict=True))
    # a config that says fc_norm without the tensors is refused by name, not loaded with norms of 1
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "vllm" / "model.safetensors"
    save_file({k: v for k, v in load_file(str(weights)).items() if not k.startswith("fc_norm.")}, str(weights))
    with pytest.raises(EyasError, match="missing fc_norm.0.weight"):
        import_draft(tmp_path / "vllm", target=str(target))
    with pytest.raises(EyasError, match="EAGLE-3.1 draft.*Export --format vllm or speculators"):
        export_draft(draft, tmp_path / "sglang", "sglang", ServeOptions(verifier=str(target)))
    with pytest.raises(EyasError, match="fc_norm False \\(this run: True\\)"):
        run_tiny_train(tmp_path / "bad", store, max_steps=1, fc_norm=True, init_draft=_trained_narrow(tmp_path, store))


def test_offline_training_on_some_of_the_stores_layers(data, tmp_path):
    """--aux-layers offline: the draft is built for, and fed, the chosen layers of the store: the very
    states the target gives an online run capturing only those layers (to bf16 rounding); it learns,
    and a layer the store lacks is refused by name."""
    target, prepared, store = data
    packs = PackSchedule(HiddenStore(store).lengths, 256, 0, 1, 1).packs(0)[:1]
    off = PackDataset(SampleSource(store, "store", [1, 4]), packs, 256, None, states=True)[0]
    engine = HFEngine(str(target), aux_layer_ids=[1, 4], dtype="float32", device="cpu")
    on = fill_states(PackDataset(SampleSource(prepared, "prepared"), packs, 256, None, states=False)[0], engine)
    assert off["aux_hidden"].shape == on["aux_hidden"].shape == (off["num_tokens"], 2 * 32)
    err = (off["aux_hidden"].float() - on["aux_hidden"]).norm() / on["aux_hidden"].norm()
    assert err.item() < 1e-2, err  # bf16 rounding only: the wrong layer would be ~100%
    run_tiny_train(tmp_path / "two", store, max_steps=40, aux_layer_ids=[1, 4])
    two = Eagle3Draft.from_pretrained(tmp_path / "two" / "draft")
    assert two.config.aux_layer_ids == [1, 4] and two.fc.weight.shape == (32, 2 * 32)
    rows = metric_rows(tmp_path / "two")
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    with pytest.raises(EyasError, match=r"holds aux layers \[1, 3, 4\], not \[2\]"):
        run_tiny_train(tmp_path / "bad", store, max_steps=1, aux_layer_ids=[1, 2])


def _trained_narrow(tmp_path, store):
    run_tiny_train(tmp_path / "narrow", store, max_steps=1)
    return tmp_path / "narrow" / "draft"
