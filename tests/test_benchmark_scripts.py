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
