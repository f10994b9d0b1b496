"""Image+text chat data: OpenAI-style image parts go through the target's own processor in `eyas prepare`
(placeholders expanded, never trained, the vision inputs and image files kept in media shards), and the
hf engine runs the vision tower for those samples: its states equal transformers' output_hidden_states
on the processor's inputs, on tiny Kimi-K2.5, Qwen2.5-VL and Gemma3 targets with real PNG files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _kimi import IMAGE_PAD, image_chats, kimi_processor, make_kimi
from _vlm import make_gemma3, make_qwen25vl, qwen25vl_processor

import eyas.data.media as media
from eyas.data.prepared import PreparedDataset
from eyas.data.readers import SkipLog, normalize_record, read_conversations
from eyas.engines.hf import HFEngine
from eyas.recipes.prepare import PrepareOptions, run_prepare

pytestmark = pytest.mark.usefixtures("one_thread")

# Kimi's and Qwen's image processors need torchvision in transformers (not on this machine): the tests
# hand eyas a processor built on a PIL image processor instead. Gemma3's loads as it is saved.
STAND_IN_PROCESSORS = {"kimi": kimi_processor, "qwen25vl": qwen25vl_processor, "gemma3": None}
MAKERS = {"kimi": make_kimi, "qwen25vl": make_qwen25vl, "gemma3": make_gemma3}


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    return image_chats(tmp_path_factory.mktemp("chats"))


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {name: make(root / name) for name, make in MAKERS.items()}


def prepare_for(name: str, target: Path, chats: Path, out: Path, monkeypatch, **kw) -> Path:
    if STAND_IN_PROCESSORS[name] is not None:
        monkeypatch.setattr(media, "load_processor", STAND_IN_PROCESSORS[name])
    return run_prepare(PrepareOptions(inputs=[str(chats)], model=str(target), out=out, num_workers=1, **kw))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_image_parts_are_kept_in_order_and_bad_ones_skipped(tmp_path):
    rec = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x.png"}},
        {"type": "image", "url": "file:///y.png"}, {"type": "image", "base64": "AAAA"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "b"}]}]}  # fmt: skip
    msgs = normalize_record(rec)
    assert msgs[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image", "image": "x.png"},
                                  {"type": "image", "image": "file:///y.png"},
                                  {"type": "image", "image": "data:image;base64,AAAA"}]
    assert msgs[1]["content"] == "b"  # text-only content is still one string
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps({"messages": m}) for m in [
        [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}, {"role": "assistant", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, {"role": "assistant", "content": "x"}],
    ]) + "\n")  # fmt: skip
    log = SkipLog()
    assert read_conversations(bad, log) == [] and log.counts["bad_shape"] == 2
    assert "(audio)" in log.examples["bad_shape"][0] and "without a path or URL" in log.examples["bad_shape"][1]


def test_kimi_prepare_expands_images_masks_them_and_keeps_what_extraction_needs(tmp_path, chats, targets,
                                                                                   monkeypatch, capsys):
    out = prepare_for("kimi", targets["kimi"], chats, tmp_path / "prep", monkeypatch, show=5)
    shown = capsys.readouterr().out.replace("\n", "")  # (lines wrap at the console's width)
    ds = PreparedDataset(out)
    m = ds.manifest
    tok = kimi_processor(targets["kimi"]).tokenizer
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    assert m["skipped"] == {"image_unreadable": 1}
    assert m["skipped_examples"]["image_unreadable"][0].startswith(f"{chats}:5: ") and "missing.png" in shown + str(m)
    assert m["media"] == {"num_samples": 2, "num_images": 3, "token_keys": [],
                          "image_token_ids": sorted([pad, tok.convert_tokens_to_ids("<|kimi_k25_video_placeholder|>")])}
    assert [s.get("media") for s in m["shards"]] == ["media-00000.safetensors"]
    files = {p.name: p.read_bytes() for p in chats.parent.glob("*.png")}
    for i, images in ((0, ["cat.png"]), (2, ["noise.png", "cat.png"])):
        sample, med = ds[i], ds.media(i)
        ids, mask = sample["input_ids"], sample["loss_mask"]
        grid = med.inputs["image_grid_thw"]
        assert med.files == [files[f] for f in images]  # the files themselves, for engines with their own processor
        assert med.inputs["pixel_values"].shape == (int(grid.prod(-1).sum()), 3, 14, 14)
        assert int((ids == pad).sum()) == int(grid.prod(-1).sum()) // 4  # one token per 2x2 patches
        assert not mask[ids == pad].any()  # placeholders are never trained
    assert tok.decode(ds[0]["input_ids"][ds[0]["loss_mask"]]) == "</think>A cat.<|im_end|>"
    assert ds.media(1) is None and ds.media(3) is None
    # the text rows are what a text-only dataset holds: no media for them, the same tokens and mask
    text_rows = tmp_path / "text.jsonl"
    text_rows.write_text("".join(line + "\n" for k, line in enumerate(chats.read_text().splitlines()) if k in (1, 3)))
    plain = prepare_for("kimi", targets["kimi"], text_rows, tmp_path / "plain", monkeypatch)
    pm = json.loads((plain / "manifest.json").read_text())
    assert "media" not in pm and all(set(s) == {"file", "num_samples", "num_tokens"} for s in pm["shards"])
    assert sorted(p.name for p in plain.iterdir()) == ["manifest.json", "shard-00000.safetensors",
                                                       "token_counts.safetensors"]
    for i, j in ((1, 0), (3, 1)):
        assert torch.equal(ds[i]["input_ids"], PreparedDataset(plain)[j]["input_ids"])
        assert torch.equal(ds[i]["loss_mask"], PreparedDataset(plain)[j]["loss_mask"])
    # --show: one mark per image instead of its placeholders
    assert shown.count("⟪image: 6 tokens⟫") == 2 and shown.count("⟪image: 4 tokens⟫") == 1 and IMAGE_PAD not in shown


def test_image_rows_for_a_text_only_target_are_counted_skips(tmp_path, chats, smollm2_dir):
    out = run_prepare(PrepareOptions(inputs=[str(chats)], model="smollm2", out=tmp_path / "p", num_workers=1))
    m = json.loads((out / "manifest.json").read_text())
    assert m["skipped"] == {"image_for_text_target": 3} and m["num_samples"] == 2 and "media" not in m
    assert [e.split(": ")[0] for e in m["skipped_examples"]["image_for_text_target"]] == \
        [f"{chats}:{k}" for k in (1, 3, 5)]


def test_max_length_never_cuts_an_image(tmp_path, chats, targets, monkeypatch):
    cat = {"type": "image", "image": str(chats.parent / "cat.png")}
    rows = [[{"role": "user", "content": [cat, {"type": "text", "text": "What?"}]},
             {"role": "assistant", "content": "A cat."}],
            [{"role": "user", "content": [{"type": "text", "text": "Look closely at this picture. " * 4}, cat]},
             {"role": "assistant", "content": "A cat."}]]
    path = tmp_path / "late.jsonl"
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    out = prepare_for("kimi", targets["kimi"], path, tmp_path / "p", monkeypatch, max_length=130)
    m = json.loads((out / "manifest.json").read_text())
    assert m["num_samples"] == 1 and m["skipped"] == {"image_cut": 1}
    assert m["skipped_examples"]["image_cut"][0].startswith(f"{path}:2: ") and "raise --max-length" in str(m)


@pytest.mark.parametrize("name", ["kimi", "qwen25vl", "gemma3"])
def test_hf_engine_runs_the_vision_tower_and_matches_output_hidden_states(name, tmp_path, chats, targets,
                                                                            monkeypatch):
    """Text samples batched as before, image samples through the whole model: every aux layer (< N) equals
    hidden_states[k] of transformers' forward on the processor's inputs, the final state its pre-norm
    state (hidden_states[-1] is after the norm), to 1e-5."""
    ds = PreparedDataset(prepare_for(name, targets[name], chats, tmp_path / "p", monkeypatch))
    engine = HFEngine(str(targets[name]), aux_layer_ids=[0, 1, 3], dtype="float32", device="cpu")
    seqs, meds = [ds[i]["input_ids"] for i in range(len(ds))], [ds.media(i) for i in range(len(ds))]
    assert [m is not None for m in meds] == [True, False, True, False]
    vision = engine.model.model.vision_tower if name == "kimi" else (
        engine.model.model.visual if name == "qwen25vl" else engine.model.model.vision_tower)
    calls = []
    vision.register_forward_hook(lambda *_: calls.append(1))
    caps = engine.capture(seqs, meds)
    assert len(calls) == 2, "the vision tower runs once per image sample"
    pre_norm = {}
    engine.norm.register_forward_pre_hook(lambda _m, a: pre_norm.__setitem__("x", a[0]))
    H = engine.hidden_size
    for s, med, cap in zip(seqs, meds, caps, strict=True):
        inputs = med.model_inputs(torch.float32, torch.device("cpu")) if med is not None else {}
        with torch.no_grad():
            hs = engine.model(input_ids=s[None], output_hidden_states=True, **inputs).hidden_states
        for j, k in enumerate(engine.aux_layer_ids):
            assert rel(cap.aux[:, j * H:(j + 1) * H], hs[k][0]) <= 1e-5, (name, k)
        assert rel(cap.final, pre_norm["x"][0]) <= 1e-5 and rel(engine.norm(cap.final), hs[-1][0]) <= 1e-5
    image_rows = np.isin(seqs[0].numpy(), ds.manifest["media"]["image_token_ids"])
    text_only = engine.capture([seqs[0]])[0]  # the same ids without the image: differs exactly at its tokens
    diff = (text_only.aux[:, :H] - caps[0].aux[:, :H]).abs().sum(-1)
    assert bool((diff[image_rows] > 0).all()) and bool((diff[~image_rows] == 0).all())


@pytest.mark.parametrize("name", ["kimi", "qwen25vl"])
def test_the_preflight_runs_image_samples_with_their_images(name, tmp_path, chats, targets, monkeypatch):
    """Extract's preflight sends the image samples with their pixel values (the engine's vision tower and
    the reference's both run) and passes; Kimi's ids without their images fail it, as they did before."""
    from eyas.engines.preflight import PreflightError, preflight_engine, preflight_inputs
    from eyas.recipes.extract import ExtractOptions, run_extract

    prepared = prepare_for(name, targets[name], chats, tmp_path / "p", monkeypatch)
    seqs, meds = preflight_inputs(PreparedDataset(prepared))
    assert meds is not None and sum(m is not None for m in meds) == 2
    engine = HFEngine(str(targets[name]), aux_layer_ids=[0, 1, 3], dtype="float32", device="cpu")
    calls = []
    vision = engine.model.model.vision_tower if name == "kimi" else engine.model.model.visual
    vision.register_forward_hook(lambda *_: calls.append(1))
    assert preflight_engine(engine, seqs, media=meds)["reference"]
    assert len(calls) == 4  # each image sample: once in the engine's batch, once in the reference
    if name == "kimi":
        with pytest.raises(PreflightError):
            preflight_engine(engine, seqs)
    run_extract(ExtractOptions(prepared=prepared, out=tmp_path / "store", model=str(targets[name]),
                               aux_layer_ids=[0, 1, 3], dtype="float32", device="cpu"))
    assert (tmp_path / "store" / "manifest.json").is_file()


def test_a_processor_that_needs_torchvision_says_so(targets):
    """Kimi's own image processor needs torchvision (absent here): transformers raises a ValueError, which
    is one error line naming what to install."""
    pytest.importorskip("PIL")
    if __import__("importlib").util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here")
    media.load_processor.cache_clear()
    with pytest.raises(media.EyasError, match=r"image processor of .* needs torchvision, which is not installed"):
        media.load_processor(str(targets["kimi"]))


def test_eval_through_vllm_names_a_kimi_config_without_its_media_placeholder(tmp_path, chats, targets):
    """vLLM reads a Kimi target's media_placeholder_token_id to serve a draft beside it: a config without it
    is one error naming the key and its value, before any decoding (here no vLLM is needed to say so)."""
    from eyas.recipes.evaluate import EvalOptions, run_eval

    assert "media_placeholder_token_id" not in json.loads((targets["kimi"] / "config.json").read_text())
    with pytest.raises(media.EyasError, match=r"config\.json has no media_placeholder_token_id.*add "
                                              r"\"media_placeholder_token_id\": \d+"):
        run_eval(EvalOptions(draft="random", model=str(targets["kimi"]), prompts=str(chats), engine="vllm",
                             out=tmp_path / "eval", device="cpu"), log=lambda m: None)
