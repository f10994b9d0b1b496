"""GGUF targets: a GGUF file, or a folder holding one, is a target like any transformers folder (converted
once, cached by the file's content); one transformers cannot read is refused with what to do."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from eyas.assets import resolve_model, smollm2_gguf
from eyas.utils.io import EyasError


def test_a_gguf_file_or_a_folder_holding_one_is_a_target(tmp_path, smollm2_dir, capsys):
    """The real SmolLM2 GGUF copied under another name: its content is the embedded default's, so it
    resolves to the folder converted once; `eyas prepare --model FILE.gguf` then reads its tokenizer and
    chat template (it used to fail with "not a valid JSON file", and its folder with "need sentencepiece")."""
    from eyas.cli import main

    models = tmp_path / "models"
    models.mkdir()
    copy = models / "my-model.Q4_1.gguf"
    shutil.copy(smollm2_gguf(), copy)
    assert resolve_model(str(copy)) == resolve_model(str(models)) == str(smollm2_dir)
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    for i, model in enumerate((copy, models)):
        with pytest.raises(SystemExit) as done:
            main_args(main, "prepare", str(chat), "--model", str(model), "--out", str(tmp_path / f"prepared-{i}"),
                      "--num-workers", "1")
        assert done.value.code in (0, None), capsys.readouterr().err
        assert (tmp_path / f"prepared-{i}" / "manifest.json").is_file()
    shutil.copy(copy, models / "other.gguf")
    with pytest.raises(EyasError, match=r"holds 2 GGUF files .*pass the one to use, e\.g\. --model .*\.gguf"):
        resolve_model(str(models))


def main_args(main, *args: str) -> None:
    import sys

    saved = sys.argv
    sys.argv = ["eyas", *args]
    try:
        main()
    finally:
        sys.argv = saved


def test_a_gguf_transformers_cannot_read_is_refused_with_what_to_do(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    odd = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(odd), "rwkv7")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(EyasError, match=r"cannot read .*odd.gguf .*architecture rwkv7 is not supported.*reads GGUF "
                                        r"files of these architectures: llama, .*Give --model the model's safetensors"):
        resolve_model(str(odd))
    split = tmp_path / "big-00001-of-00003.gguf"
    shutil.copy(odd, split)
    with pytest.raises(EyasError, match=r"one part of a split GGUF.*llama-gguf-split --merge .*00001-of-00003\.gguf"):
        resolve_model(str(split))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 16)
    assert resolve_model(str(not_gguf)) == str(not_gguf)  # not GGUF: transformers' own error will name it
    assert not list((tmp_path / "cache").glob("gguf/*/config.json"))  # nothing half-converted left


def test_a_target_folder_is_the_folder_and_an_unknown_name_says_what_to_pass(tmp_path, monkeypatch):
    """resolve_model (every command, online training's clients, the vllm engine): a folder is itself; a name that
    is none of the four forms ends in one error naming it, offline or where the hub cannot be reached."""
    from huggingface_hub import constants

    from eyas.assets import resolve_model

    assert resolve_model(str(tmp_path)) == str(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EyasError, match=r"(?s)target 'no-org/no-such-model' is not the alias smollm2, a folder or a "
                                        r"GGUF file, nor a hub id in the local cache .*HF_HUB_OFFLINE is set.*hf "
                                        "download no-org/no-such-model"):
        resolve_model("no-org/no-such-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the fetch fails at once
    with pytest.raises(EyasError, match=r"(?s)nor a hub id in the local cache .*could not be fetched from the hub .*"
                                        "Pass a local folder with config.json"):
        resolve_model("no-org/no-such-model")
