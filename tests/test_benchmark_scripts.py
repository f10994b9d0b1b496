"""Pieces of the analysis scripts under benchmarks/ that read user data: what they keep, and a clear
error when nothing is usable."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from eyas.data.chat import ChatEncoder
from eyas.data.readers import SkipLog, read_conversations
from eyas.utils.io import EyasError

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_acceptance_by_position_keeps_the_first_turns_and_names_unusable_data(tmp_path, smollm2_dir):
    abp = load_script("acceptance_by_position")
    assert abp.reply_positions(torch.tensor([0, 1, 1, 1, 0, 0, 1, 1])).tolist() == [-1, 0, 1, 2, -1, -1, 0, 1]

    encoder = ChatEncoder(AutoTokenizer.from_pretrained(smollm2_dir))
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
            {"role": "user", "content": "More?"}, {"role": "assistant", "content": "Yes, more."}]
    (one,) = abp.encode_turns(encoder, [conv], 1, "chat.jsonl", SkipLog())
    assert one.input_ids.tolist() == encoder.encode(conv[:2]).input_ids.tolist()
    (both,) = abp.encode_turns(encoder, [conv], 2, "chat.jsonl", SkipLog())
    assert both.input_ids.tolist() == encoder.encode(conv).input_ids.tolist()

    questions = tmp_path / "questions.jsonl"  # prompts only, as MT-Bench ships them: nothing to measure
    questions.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                                 for q in ("a", "b")))
    log = SkipLog()
    convs = read_conversations([str(questions)], log)
    with pytest.raises(EyasError, match=r"questions\.jsonl: no conversation with an assistant reply.*no_assistant"):
        abp.encode_turns(encoder, convs, 1, str(questions), log)


def test_acceptance_by_position_splits_step_0_by_the_targets_confidence(smollm2_dir, capsys):
    """The confidence table partitions exactly the tokens and hits of step 0 (first band and all), and
    its bins follow the target's own top-1 probability at each predicted token."""
    from eyas.eval.target import HFTarget
    from eyas.generate import load_generator
    from eyas.recipes.evaluate import load_draft

    abp = load_script("acceptance_by_position")
    model, tokenizer = load_generator(str(smollm2_dir), "float32")
    # a short, unlikely reply: the target is unsure at some of its tokens and sure at others
    conv = [{"role": "user", "content": "Name three colors."},
            {"role": "assistant", "content": "Mauve, red, and the colour of a quiet evening sky."}]
    encoded = abp.encode_turns(ChatEncoder(tokenizer), [conv], 1, "chat", SkipLog())
    draft = load_draft("random", str(smollm2_dir), model, model.device, model.dtype).eval()
    target = HFTarget(model, list(draft.config.aux_layer_ids))
    try:
        correct, count, _, by_conf, n_conf = abp.measure(draft, target, encoded, 2, 16, 2)
        ids = torch.as_tensor(encoded[0].input_ids)[None]
        logits, _ = target.forward(ids, torch.arange(ids.shape[1])[None], target.new_cache())
    finally:
        target.close()
    assert torch.equal(n_conf.sum(1), torch.stack([count[0, 0], count[-1, 0]]))
    assert torch.equal(by_conf.sum(1), torch.stack([correct[0, 0], correct[-1, 0]]))
    # independently: step 0 predicts each trained token from two positions back, i.e. the target's
    # distribution one position back; bin those top-1 probabilities by hand
    mask = torch.as_tensor(encoded[0].loss_mask).bool()
    top1 = torch.softmax(logits.float(), -1).amax(-1)
    tok = torch.arange(2, ids.shape[1])[mask[2:]]
    expect = torch.zeros(len(abp.CONFIDENCE_EDGES) + 1)
    for p in top1[tok - 1].tolist():
        expect[sum(p >= e for e in abp.CONFIDENCE_EDGES)] += 1
    assert torch.equal(n_conf[1], expect) and expect.count_nonzero() >= 3, expect

    # the side-by-side row of several drafts: step 0 of the first band, of all tokens, then the first
    # band's confidence bins; a draft half as good reads 0.50x in every column it has tokens in
    row = abp.step0_row(correct, count, by_conf, n_conf)
    assert row.shape == (2 + len(abp.CONFIDENCE_EDGES) + 1,)
    assert row[0] == correct[0, 0] / count[0, 0] and row[1] == correct[-1, 0] / count[-1, 0]
    assert torch.equal(row[2:], by_conf[0] / n_conf[0].clamp_min(1))
    abp.print_comparison(["a", "b"], [torch.full_like(row, 0.4), torch.full_like(row, 0.2)], 16)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "| b / first | " + " | ".join(["0.50x"] * row.numel()) + " |"
    assert lines[1].count("|") == lines[-1].count("|") and "0-15, p 0.9-1" in lines[1]


def test_draft_parts_fill_each_part_and_round_trip_the_draft(tmp_path, smollm2_dir, monkeypatch):
    """A device call brings back 8 files: parts are filled to the limit (tensors cut into row slices
    across parts), the config rides in part 0, and unpacking gives back the same bf16 weights."""
    import dataclasses

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from eyas.model.config import DraftConfig
    from eyas.model.draft import Eagle3Draft

    dp = load_script("h200/draft_parts")
    cfg = DraftConfig.from_target_config(AutoConfig.from_pretrained(smollm2_dir), [1, 15, 27],
                                         target=str(smollm2_dir))
    cfg = dataclasses.replace(cfg, num_hidden_layers=2)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    ids = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values  # a valid, non-trivial d2t
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(cfg.draft_vocab_size), t2d)
    draft.save_pretrained(tmp_path / "train" / "draft")

    monkeypatch.setattr(dp, "LIMIT", 3 * 2**20)
    (tmp_path / "out").mkdir()
    dp.pack(tmp_path / "train", tmp_path / "out")
    parts = [load_file(str(tmp_path / "out" / f"draft.part{i}.safetensors"))
             for i in range(len(list((tmp_path / "out").iterdir())))]
    sizes = [sum(v.numel() * v.element_size() for v in p.values()) for p in parts]
    widest_row = max(v[0].numel() * v.element_size() for p in parts for v in p.values())
    assert all(s <= dp.LIMIT for s in sizes)
    assert all(s > dp.LIMIT - widest_row for s in sizes[:-1]), sizes  # no part closed while a row still fit
    assert len(parts) > 10 and len(set(k.partition("@")[0] for p in parts for k in p)) < sum(map(len, parts))

    dp.unpack(tmp_path / "out", tmp_path / "back")
    before = load_file(str(tmp_path / "train" / "draft" / "model.safetensors"))
    after = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(after) == set(before)
    for k, v in before.items():
        if k != "embed_tokens.weight":  # the target's, filled in on arrival
            w = after[k]
            same = (torch.equal(w.to(torch.bfloat16), v.to(torch.bfloat16)) if v.is_floating_point()
                    else torch.equal(w, v))
            assert same, k
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_hidden_layers"] == 2
