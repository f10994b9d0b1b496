"""`eyas prepare` end to end with SmolLM2's real tokenizer: output format, reuse, atomicity, --show, errors."""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from eyas.data.chat import ChatEncoder
from eyas.data.prepared import PreparedDataset
from eyas.data.readers import Row
from eyas.recipes.prepare import PrepareOptions, _encoded_chunks, prepare, show_samples
from eyas.utils.io import EyasError

EOT = "<|im_end|>"


def conv(i: int, turns: int = 2) -> dict:
    msgs = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}.{t}: what is {i} + {t}?"})
        msgs.append({"role": "assistant", "content": f"It is {i + t}. " + "Indeed. " * (i % 7)})
    return {"messages": msgs}


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture()
def chat_file(tmp_path) -> Path:
    path = tmp_path / "chat.jsonl"
    lines = [json.dumps(conv(i, 1 + i % 3)) for i in range(40)]
    lines[5] = "{broken"
    lines[9] = json.dumps({"messages": [{"role": "alien", "content": "x"}]})
    lines[30] = json.dumps({"messages": [{"role": "user", "content": "long " * 3000},
                                         {"role": "assistant", "content": "ok"}]})  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def read_shards(out: Path) -> dict[str, np.ndarray]:
    m = json.loads((out / "manifest.json").read_text())
    parts = [load_file(str(out / s["file"])) for s in m["shards"]]
    return {k: np.concatenate([p[k] for p in parts]) for k in ("input_ids", "loss_mask")}


def test_prepare_writes_the_documented_format(tmp_path, chat_file, tok):
    out = tmp_path / "prep"
    prepare(PrepareOptions(inputs=[str(chat_file)], out=out, max_length=512, num_workers=1, shard_tokens=1000))
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == "eyas.prepared/1" and m["vocab_size"] == 49152 and m["max_length"] == 512
    assert m["skipped"] == {"not_json": 1, "unknown_role": 1, "no_loss_tokens": 1}
    assert m["skipped_examples"]["not_json"][0].startswith(f"{chat_file}:6: ")
    assert m["num_samples"] == 37 and len(m["shards"]) > 1
    assert sum(s["num_samples"] for s in m["shards"]) == 37
    assert sum(s["num_tokens"] for s in m["shards"]) == m["num_tokens"]
    assert m["truncated"] == 0 and m["sources"] == [str(chat_file)] and len(m["options_sha256"]) == 64
    for key in ("tokenizer", "chat_template_sha256", "num_loss_tokens"):
        assert key in m

    ds = PreparedDataset(out)
    assert len(ds) == 37 and int(ds.lengths.sum()) == m["num_tokens"]
    kept = [i for i in range(40) if i not in (5, 9, 30)]
    for k in (0, 1, 17, 36):  # across shards
        s = ds[k]
        assert s["input_ids"].dtype == torch.long and s["loss_mask"].dtype == torch.bool
        msgs = conv(kept[k], 1 + kept[k] % 3)["messages"]
        assert s["input_ids"].tolist() == tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
        trained = tok.decode(s["input_ids"][s["loss_mask"]].tolist(), skip_special_tokens=False)
        assert trained == "".join(x["content"] + EOT for x in msgs if x["role"] == "assistant")
    arrays = read_shards(out)
    assert arrays["input_ids"].dtype == np.int32 and arrays["loss_mask"].dtype == np.uint8
    counts = ds.token_counts()
    assert counts.shape == (49152,) and counts.dtype == torch.long
    expected = np.bincount(arrays["input_ids"][arrays["loss_mask"] == 1], minlength=49152)
    np.testing.assert_array_equal(counts.numpy(), expected)
    assert int(counts.sum()) == m["num_loss_tokens"] == int(arrays["loss_mask"].sum())


def test_workers_give_identical_output_and_max_samples_is_exact(tmp_path, chat_file):
    one = prepare(PrepareOptions(inputs=[str(chat_file)], out=tmp_path / "w1", max_length=512, num_workers=1,
                                max_samples=25))  # fmt: skip
    two = prepare(PrepareOptions(inputs=[str(chat_file)], out=tmp_path / "w2", max_length=512, num_workers=2,
                                max_samples=25))  # fmt: skip
    a, b = read_shards(one), read_shards(two)
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    np.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (one, two))
    assert ma["num_samples"] == mb["num_samples"] == 25
    assert ma["skipped"] == mb["skipped"] == {"not_json": 1, "unknown_role": 1}  # row 30 is past the cut


def _two_workers_past_their_first_chunk(tok):
    """A two-worker stream over 8 chunks of 3 real conversations, read up to its first chunk (3 more are in
    flight then): the stream, that chunk and the workers."""
    rows = [Row(f"chat.jsonl:{i + 1}", conv(i, 2)["messages"]) for i in range(24)]
    stream = _encoded_chunks((rows[i : i + 3] for i in range(0, len(rows), 3)), ChatEncoder(tok), 2)
    first = next(stream)
    return stream, first, mp.active_children()


def test_an_early_stop_lets_the_workers_finish_their_chunks_and_exit(tok):
    """--max-samples closes the chunk stream with chunks in flight. Killing the workers then (Pool.terminate)
    could deadlock for good; they must instead finish what they hold and exit on their own (exit code 0)."""
    stream, first, workers = _two_workers_past_their_first_chunk(tok)
    assert [o[0] for o in first.outcomes] == ["ok"] * 3
    assert len(workers) == 2
    stream.close()
    assert [w.exitcode for w in workers] == [0, 0]
    assert mp.active_children() == []


def test_ctrl_c_is_left_to_the_parent_so_the_workers_still_finish_and_exit(tok):
    """Ctrl-C reaches the workers too. Were they to die of it mid-chunk, that chunk would never finish and
    the parent's orderly stop would wait for it forever: they ignore it, and the parent stops them."""
    stream, _, workers = _two_workers_past_their_first_chunk(tok)
    time.sleep(1.0)  # the chunks in flight are done: a worker that dies of SIGINT now leaves nothing unfinished
    for w in workers:
        os.kill(w.pid, signal.SIGINT)
    stream.close()
    assert [w.exitcode for w in workers] == [0, 0]
    assert mp.active_children() == []


def test_reuse_and_rebuild(tmp_path, chat_file):
    cfg = PrepareOptions(inputs=[str(chat_file)], out=tmp_path / "p", max_length=512, num_workers=1)
    prepare(cfg)
    manifest = cfg.out / "manifest.json"
    before = manifest.stat().st_mtime_ns
    prepare(cfg)  # same inputs and options: reused
    assert manifest.stat().st_mtime_ns == before
    cfg.overlong = "drop"  # an option changed: rebuilt
    prepare(cfg)
    m = json.loads(manifest.read_text())
    assert m["skipped"]["overlong"] == 1 and m["num_samples"] == 37
    with open(chat_file, "a") as f:  # the input changed: rebuilt
        f.write(json.dumps(conv(99)) + "\n")
    prepare(cfg)
    assert json.loads(manifest.read_text())["num_samples"] == 38


def test_unreadable_input_leaves_no_output_and_keeps_the_old_one(tmp_path, chat_file):
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\xff\xfe\x00binary\n\x00\x01\x02\n")
    out = tmp_path / "p"
    with pytest.raises(EyasError) as e:
        prepare(PrepareOptions(inputs=[str(chat_file), str(garbage)], out=out, num_workers=1))
    assert e.value.exit_code == 2 and str(garbage) in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))
    prepare(PrepareOptions(inputs=[str(chat_file)], out=out, max_length=512, num_workers=1))
    before = (out / "manifest.json").read_text()
    with pytest.raises(EyasError):
        prepare(PrepareOptions(inputs=[str(chat_file), str(tmp_path / "missing.json")], out=out, num_workers=1))
    assert (out / "manifest.json").read_text() == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(EyasError, match="mine is a folder that `eyas prepare` did not write"):
        prepare(PrepareOptions(inputs=[str(chat_file)], out=tmp_path / "mine", num_workers=1))
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "precious"


def test_show_highlights_exactly_the_trained_tokens(tmp_path, chat_file, tok):
    out = prepare(PrepareOptions(inputs=[str(chat_file)], out=tmp_path / "p", max_length=512, num_workers=1))
    buf = io.StringIO()
    show_samples(out, 2, tok, Console(file=buf, color_system=None, width=200))
    text = buf.getvalue()
    assert "sample 0:" in text and "sample 36:" in text
    assert f"⟦It is 0. {EOT}⟧" in text  # sample 0: one turn, answer + end of turn marked
    assert "⟦" not in text.split("<|im_start|>assistant")[0]  # nothing trained before the first reply
    # colour terminal: the trained text carries the highlight style instead of markers
    buf = io.StringIO()
    show_samples(out, 1, tok, Console(file=buf, force_terminal=True, color_system="standard", width=200))
    assert "⟦" not in buf.getvalue() and "\x1b[" in buf.getvalue()


def test_cli_exit_code_and_show(tmp_path, chat_file, monkeypatch, capsys):
    """The real `eyas` entry point, in-process: exit code 2 on an unreadable input, --show after a run."""
    from eyas.cli import main

    def eyas(*args: str) -> int:
        monkeypatch.setattr(sys, "argv", ["eyas", "prepare", *args])
        with pytest.raises(SystemExit) as e:
            main()
        return e.value.code

    assert eyas(str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "x")) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "nope.jsonl" in err and not (tmp_path / "x").exists()
    assert eyas(str(chat_file), "--out", str(tmp_path / "p"), "--max-length", "512", "--show", "1") == 0
    out, err = capsys.readouterr()
    assert "⟦It is 0. <|im_end|>⟧" in out and "37" in err and "not_json" in err
    assert eyas("--out", str(tmp_path / "p"), "--show", "1") == 0  # look again without inputs: no rebuild
    assert "⟦It is 0. <|im_end|>⟧" in capsys.readouterr().out


def test_output_to_a_log_file_gets_plain_progress_lines(tmp_path, chat_file, monkeypatch, capsys):
    """stderr that is not a terminal (here: captured, as in `eyas ... 2> log`) gets status lines with
    count, tok/s and elapsed time instead of a bar that is never redrawn."""
    import re

    from eyas.cli import main

    monkeypatch.delenv("EYAS_NO_PROGRESS", raising=False)
    monkeypatch.setenv("EYAS_PROGRESS_EVERY", "0")
    monkeypatch.setattr(sys, "argv", ["eyas", "prepare", str(chat_file), "--out", str(tmp_path / "p"),
                                      "--max-length", "512"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("prepare ")]
    assert lines and re.fullmatch(r"prepare 37  [\d.]+k? tok/s  3 skipped  elapsed \d:\d\d:\d\d", lines[-1]), lines
    assert all("━" not in ln for ln in lines)
    monkeypatch.setenv("EYAS_PROGRESS_EVERY", "soon")  # a bad setting: a clear error, not a traceback
    monkeypatch.setattr(sys, "argv", ["eyas", "prepare", str(chat_file), "--out", str(tmp_path / "q")])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2 and "EYAS_PROGRESS_EVERY='soon'" in capsys.readouterr().err


def test_trim_loops_cuts_each_turn_keep_tokens_after_it_repeats_itself():
    """Hand-built ids: a turn that loops with period 10, and a later turn that opens by repeating it."""
    from eyas.data.chat import trim_loops

    prompt, unique, unit, eot = [1, 2, 3, 4, 5], list(range(100, 120)), list(range(200, 210)), [2]
    turn1 = unique + unit * 5 + eot  # the 16 tokens from the first 200 recur 10 tokens later
    turn2 = unique[:16] + list(range(300, 330)) + eot  # opens with 16 tokens turn 1 wrote
    ids = np.array(prompt + turn1 + [7, 8] + turn2, dtype=np.int32)
    mask = np.array([0] * 5 + [1] * len(turn1) + [0, 0] + [1] * len(turn2), dtype=np.uint8)

    got_ids, got_mask = trim_loops(ids, mask, keep=3)
    onset1 = len(unique) + 25  # within turn 1: the gram unit[0..9] + unit[0..5] first recurs there
    want1 = turn1[: onset1 + 1 + 3] + eot
    onset2 = 15  # within turn 2: its first 16 tokens complete a gram from turn 1
    want2 = turn2[: onset2 + 1 + 3] + eot
    assert got_ids.tolist() == prompt + want1 + [7, 8] + want2
    assert got_mask.tolist() == [0] * 5 + [1] * len(want1) + [0, 0] + [1] * len(want2)
    assert got_ids.dtype == np.int32 and got_mask.dtype == np.uint8

    big_keep = trim_loops(ids, mask, keep=100)  # the loop ends before `keep` runs out: nothing to cut
    assert big_keep[0].tolist() == ids.tolist() and big_keep[1].tolist() == mask.tolist()
    quoting = np.array(unique + unique[:16] + list(range(300, 320)) + eot, dtype=np.int32)
    plain = trim_loops(quoting, np.array([0] * 20 + [1] * 37, dtype=np.uint8), keep=0)  # quotes the user
    assert plain[0].tolist() == quoting.tolist()  # only what the assistant wrote counts as a repeat


def test_prepare_trim_loops_with_the_real_tokenizer(tmp_path, tok):
    loop = "Intro: the answer follows, in my own words. " + "The cat sat on the mat and looked at the door. " * 30
    rows = [
        {"messages": [{"role": "user", "content": "Tell me about the cat."}, {"role": "assistant", "content": loop}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]},
    ]
    src = tmp_path / "loops.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole = prepare(PrepareOptions(inputs=[str(src)], out=tmp_path / "whole", max_length=2048, num_workers=1))
    cfg = PrepareOptions(inputs=[str(src)], out=tmp_path / "cut", max_length=2048, num_workers=1, trim_loops=8)
    cut = prepare(cfg)
    mw, mc = (json.loads((p / "manifest.json").read_text()) for p in (whole, cut))
    assert mc["trim_loops"] == 8 and mc["trimmed_tokens"] == mw["num_tokens"] - mc["num_tokens"] > 300
    assert mw["trim_loops"] is None and mw["trimmed_tokens"] == 0
    assert mc["options_sha256"] != mw["options_sha256"]

    full, short = PreparedDataset(whole), PreparedDataset(cut)
    assert short[1]["input_ids"].tolist() == full[1]["input_ids"].tolist()  # no loop: untouched
    text = tok.decode(short[0]["input_ids"][short[0]["loss_mask"]].tolist(), skip_special_tokens=False)
    assert text.endswith(EOT) and loop.startswith(text.removesuffix(EOT))  # the reply's head + end of turn
    sentence = "The cat sat on the mat and looked at the door."
    assert text.count(sentence) in (1, 2)  # one period of the loop, plus the few kept tokens
    assert int(short[0]["loss_mask"].sum()) < 60

    with pytest.raises(EyasError, match="--trim-loops"):
        prepare(PrepareOptions(inputs=[str(src)], out=tmp_path / "bad", trim_loops=-1))
