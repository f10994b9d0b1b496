"""A tiny Kimi-K2.5 (`kimi_k25`: a DeepSeek-V3 text model with MLA attention and routed + shared experts,
a MoonViT vision tower; Kimi's chat template with thinking blocks, tool calls and images) through every
stage on a CPU: prepare -> extract -> train (offline and online) -> export -> eval (chain and tree)."""

from __future__ import annotations

import json

import pytest
import torch
from _kimi import image_chats, kimi_processor, make_kimi

import eyas.data.media as media
from eyas.data.prepared import PreparedDataset
from eyas.engines.head import read_target_head
from eyas.engines.hf import HFEngine
from eyas.model.config import DraftConfig
from eyas.recipes.evaluate import EvalOptions, run_eval
from eyas.recipes.export import ExportOptions, run_export
from eyas.recipes.extract import ExtractOptions, run_extract, target_facts
from eyas.recipes.prepare import PrepareOptions, run_prepare
from eyas.recipes.train import TrainOptions, run_train
from eyas.store import HiddenStore
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")
AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return make_kimi(tmp_path_factory.mktemp("kimi") / "target")


def test_every_dimension_comes_from_the_text_config(kimi):
    """The wrapper's config has no hidden_size, layers or vocabulary of its own: every stage reads text_config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(kimi)
    text = config.text_config
    assert type(config).__name__ == "Kimi_K25Config" and not hasattr(config, "hidden_size")
    assert (text.hidden_size, text.num_hidden_layers, text.kv_lora_rank, text.n_routed_experts) == (128, 4, 512, 4)
    facts = target_facts(str(kimi), AUX)
    assert (facts["num_layers"], facts["hidden_size"]) == (4, 128)
    engine = HFEngine(str(kimi), aux_layer_ids=AUX, dtype="float32", device="cpu")
    assert (engine.num_layers, engine.hidden_size, engine.vocab_size) == (4, 128, text.vocab_size)
    draft = DraftConfig.from_target_config(config, AUX, draft_vocab_size=64)
    assert (draft.hidden_size, draft.target_hidden_size, draft.vocab_size) == (128, 128, text.vocab_size)
    head, on_disk = engine.target_head(), read_target_head(kimi)  # (the vllm engine reads the head from disk)
    assert torch.equal(head.lm_head, on_disk.lm_head) and torch.equal(head.norm_weight, on_disk.norm_weight)
    assert torch.equal(head.embed_tokens, on_disk.embed_tokens) and head.norm_eps == on_disk.norm_eps


def test_kimi_through_every_stage(tmp_path, kimi, monkeypatch):
    monkeypatch.setattr(media, "load_processor", kimi_processor)  # (Kimi's own needs torchvision; not here)
    chats = image_chats(tmp_path)
    prepared = run_prepare(PrepareOptions(inputs=[str(chats)], model=str(kimi), out=tmp_path / "prepared",
                                          num_workers=1))
    ds = PreparedDataset(prepared)
    assert len(ds) == 4 and ds.manifest["media"]["num_images"] == 3

    store = run_extract(ExtractOptions(prepared=prepared, out=tmp_path / "store", model=str(kimi), aux_layer_ids=AUX,
                                       dtype="float32", device="cpu"))
    st = HiddenStore(store)
    assert (st.manifest["hidden_size"], st.manifest["num_layers"], len(st)) == (128, 4, 4)
    engine = HFEngine(str(kimi), aux_layer_ids=AUX, dtype="float32", device="cpu")
    for i in (0, 1):  # an image sample and a text one: the store holds the engine's states (in bf16)
        want = engine.capture([ds[i]["input_ids"]], [ds.media(i)])[0]
        got = st[i]
        assert torch.equal(got["input_ids"], ds[i]["input_ids"])
        assert torch.allclose(got["aux_hidden"].float(), want.aux, rtol=1e-2, atol=1e-2)
        assert torch.allclose(got["final_hidden"].float(), want.final, rtol=1e-2, atol=1e-2)

    common = dict(draft_vocab_size=64, ttt_steps=2, token_budget=512, num_workers=0, max_steps=3, log_every=1,
                  save_every=0, report_to="none")
    offline = run_train(TrainOptions(store=store, out=tmp_path / "train", **common))
    draft = tmp_path / "train" / "draft"
    cfg = json.loads((draft / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["target_hidden_size"], cfg["aux_layer_ids"]) == (128, 128, AUX)

    # online: the target in the loop (text samples: online batches carry no images, and say so)
    with pytest.raises(EyasError, match="online training does not run the vision tower"):
        run_train(TrainOptions(prepared=prepared, online=True, model=str(kimi), out=tmp_path / "x", **common))
    text = tmp_path / "text.jsonl"
    text.write_text("".join(line + "\n" for k, line in enumerate(chats.read_text().splitlines()) if k in (1, 3)))
    text_prepared = run_prepare(PrepareOptions(inputs=[str(text)], model=str(kimi), out=tmp_path / "text-prepared",
                                               num_workers=1))
    online = run_train(TrainOptions(prepared=text_prepared, online=True, model=str(kimi), aux_layer_ids=AUX,
                                    target_dtype="float32", out=tmp_path / "online", **common))
    assert offline and online and (tmp_path / "online" / "draft" / "model.safetensors").is_file()

    written = run_export(ExportOptions(draft=draft, format="all", out=tmp_path / "export", model=kimi))
    assert {p.name for p in written} == {"vllm", "sglang", "speculators"}

    report = run_eval(EvalOptions(draft=str(draft), model=str(kimi), prompts=str(text_prepared), max_prompts=1,
                                  max_turns=1, max_new_tokens=6, chain="2", tree="4:2:2", out=tmp_path / "eval",
                                  device="cpu", dtype="float32"))
    result = json.loads((report / "report.json").read_text())
    assert set(result["methods"]) == {"chain-2", "tree-4:2:2"}
    overall = result["results"]["all"]
    assert all(overall[m]["identical_to_target"] for m in result["methods"])  # greedy: lossless


def test_an_mla_target_decodes_batched_over_static_caches(kimi):
    """MLA caches a latent and a rotary key, not per-head keys and values: the static decoder's cache takes the
    shapes the layers write, so a Kimi target decodes batched (chain and tree, greedy) as it does alone, and no
    fallback is taken."""
    import warnings

    from _eval_utils import make_draft
    from transformers import AutoModelForImageTextToText

    from eyas.eval import evaluate_draft

    model = AutoModelForImageTextToText.from_pretrained(kimi, dtype=torch.float32).eval()
    draft = make_draft(model, AUX, 64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(20, 200, (n,), generator=g).tolist() for n in (5, 9, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to eager decoding warns
        res = evaluate_draft(model, None, draft, prompts, chain=[2], tree=["4:2:2"], max_new_tokens=6,
                             batch_sizes=[1, 2], progress=False, stop_ids=set())
    rows = {(r["batch_size"], r["method"]): r for r in res.serving}
    assert all(rows[(b, m)]["identical"] == 1.0 for b in (1, 2) for m in ("chain-2", "tree-4:2:2"))
