"""Faults and bad input for every stage, counted (tests/_reliability.py defines the cases; docs/reliability.md
is rendered from them and from what these tests saw).

Faults: `python -m eyas.cli STAGE ...` on a tiny random Llama (hidden 32, head_dim 16, SmolLM2's tokenizer)
is SIGKILLed at seeded points, then the same command runs again: the result must equal an uninterrupted
run's, byte for byte except wall-clock fields, with no temporary or partial file left behind.
Bad inputs: each kind ends in one clear `eyas: error:` message, exit code 2, no traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from _reliability import BAD_INPUTS, STAGES, TABLE, BadInput, KillPoint, Outcomes, kill_points, render
from _snapshot import debris, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

KILLPOINT = Path(__file__).parent / "_killpoint.py"
OUTCOMES = Outcomes()


@dataclass
class World:
    """The inputs every stage's runs share (built once, in this process)."""

    root: Path
    target: Path
    chat: Path
    prepared: Path
    store: Path
    draft: Path
    vocab: int


@pytest.fixture(scope="module")
def world(tmp_path_factory, smollm2_dir) -> World:
    import torch
    import transformers as tf

    from eyas.recipes.extract import ExtractOptions, run_extract
    from eyas.recipes.prepare import PrepareOptions, prepare
    from eyas.recipes.train import TrainOptions, run_train

    root = tmp_path_factory.mktemp("world")
    tok = tf.AutoTokenizer.from_pretrained(smollm2_dir)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(tok), max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    tf.LlamaForCausalLM(cfg).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Question {i}: what is {i} plus {i + 1}?"},
        {"role": "assistant", "content": f"{i} plus {i + 1} is {2 * i + 1}."}]}) + "\n" for i in range(16)))
    w = World(root, root / "target", chat, root / "prepared", root / "store", root / "train" / "draft", len(tok))
    prepare(PrepareOptions(inputs=[str(chat)], model=str(w.target), out=w.prepared, max_length=64, num_workers=1))
    run_extract(ExtractOptions(prepared=w.prepared, model=str(w.target), out=w.store, device="cpu", dtype="float32",
                               shard_mb=0.05, token_budget=128))
    run_train(TrainOptions(store=w.store, out=root / "train", max_steps=2, token_budget=128, num_workers=0,
                           device="cpu", draft_vocab_size=w.vocab, ttt_steps=2), log=lambda m: None)
    return w


# ---------------------------------------------------------------------------------------------
# the stages' commands
# ---------------------------------------------------------------------------------------------


def command(stage: str, w: World, out: Path) -> list[str]:
    """The stage's command line, writing under `out`."""
    s = str
    return {
        "prepare": ["prepare", s(w.chat), "--model", s(w.target), "--out", s(out / "prepared"), "--max-length", "64",
                    "--num-workers", "1"],
        "regenerate": ["regenerate", s(w.chat), "--model", s(w.target), "--out", s(out / "conv.jsonl"),
                       "--batch-size", "2", "--max-samples", "8", "--max-new-tokens", "6", "--temperature", "0",
                       "--device", "cpu", "--generator", "generate"],
        "extract": ["extract", "--prepared", s(w.prepared), "--model", s(w.target), "--out", s(out / "store"),
                    "--device", "cpu", "--dtype", "float32", "--shard-mb", "0.05", "--token-budget", "128"],
        "train": ["train", "--store", s(w.store), "--out", s(out / "train"), *TRAIN_ARGS(w), "--resume"],
        "export": ["export", "--draft", s(w.draft), "--format", "all", "--out", s(out / "export")],
        "eval": ["eval", "--draft", s(w.draft), "--model", s(w.target), "--prompts", s(w.chat), "--max-prompts", "3",
                 "--max-turns", "1", "--max-new-tokens", "8", "--chain", "2", "--tree", "4:2:2", "--device", "cpu",
                 "--out", s(out / "eval")],
        "run": ["run", s(run_config(w, out))],
    }[stage]


def TRAIN_ARGS(w: World) -> list[str]:  # noqa: N802 - a constant that needs the world
    return ["--max-steps", "6", "--save-every", "2", "--log-every", "1", "--token-budget", "128", "--num-workers", "0",
            "--device", "cpu", "--draft-vocab-size", str(w.vocab), "--ttt-steps", "2"]


def run_config(w: World, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"target": str(w.target), "workdir": str(out / "work"),
           "prepare": {"inputs": [str(w.chat)], "max_length": 64, "num_workers": 1},
           "extract": {"device": "cpu", "dtype": "float32", "shard_mb": 0.05, "token_budget": 128},
           "train": {"max_steps": 4, "save_every": 2, "log_every": 1, "token_budget": 128, "num_workers": 0,
                     "device": "cpu", "draft_vocab_size": w.vocab, "ttt_steps": 2},
           "eval": {"prompts": str(w.chat), "max_prompts": 1, "max_turns": 1, "max_new_tokens": 6, "chain": "2",
                    "tree": "none", "device": "cpu"}}
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(args: list[str], root: Path, **kill: str) -> subprocess.CompletedProcess:
    """`python -m eyas.cli ARGS` through the kill-point launcher, file events counted under `root`."""
    env = {**os.environ, "EYAS_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "EYAS_KILL_ROOT": str(root), **kill}
    return subprocess.run([sys.executable, str(KILLPOINT), *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=root)


# ---------------------------------------------------------------------------------------------
# comparing outputs
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# faults
# ---------------------------------------------------------------------------------------------


def kill_and_rerun(stage: str, w: World, out: Path, point: KillPoint, clean: dict) -> tuple[str, list[str]]:
    """Kill the stage at `point`, run it again; return (the rerun's stderr, what differs from `clean`)."""
    args = command(stage, w, out)
    if point.how == "event":
        kill = {"EYAS_KILL_EVENT": str(max(1, round(point.at * clean["events"])))}
    else:
        # timed from its first change; at the latest just before its last one (a stage that writes for a few
        # milliseconds may otherwise finish before the timer fires)
        kill = {"EYAS_KILL_AFTER": str(point.at * (clean["last"] - clean["first"])),
                "EYAS_KILL_EVENT": str(clean["events"])}
    killed = launch(args, out, **kill)
    for _ in range(3):  # a timed kill that came after the end (this run outpaced the clean one): kill sooner
        if point.how != "time" or killed.returncode != 0:
            break
        shutil.rmtree(out)
        out.mkdir()
        kill["EYAS_KILL_AFTER"] = str(float(kill["EYAS_KILL_AFTER"]) / 2)
        killed = launch(args, out, **kill)
    assert killed.returncode == -9, f"{stage} {point}: not killed (exit {killed.returncode}): {killed.stderr[-2000:]}"
    again = launch(args, out)
    assert again.returncode == 0, f"{stage} {point}: the rerun failed: {again.stderr[-3000:]}"
    ref, got = clean["snapshot"], snapshot(out)
    diff = [k for k in sorted(set(ref) | set(got)) if ref.get(k) != got.get(k)] + debris(out)
    return again.stderr, diff


@pytest.mark.parametrize("stage", STAGES)
def test_killed_at_seeded_points_the_rerun_ends_as_an_uninterrupted_run(stage, world, tmp_path):
    clean_out = tmp_path / "clean"
    clean_out.mkdir()
    count = tmp_path / "clean-killpoint.json"
    r = launch(command(stage, world, clean_out), clean_out, EYAS_KILL_COUNT=str(count))
    assert r.returncode == 0, r.stderr[-3000:]
    clean = {**json.loads(count.read_text()), "snapshot": snapshot(clean_out)}
    assert clean["events"] > 2 and not debris(clean_out)
    points = kill_points(stage)
    outs = [tmp_path / f"killed-{i}" for i in range(len(points))]
    for o in outs:
        o.mkdir()
    with ThreadPoolExecutor(2) as pool:  # two cores: the seeds run side by side
        results = list(pool.map(lambda a: kill_and_rerun(stage, world, *a, clean), zip(outs, points, strict=True)))
    OUTCOMES.kills[stage] = [f"{p}: " + ("identical" if not diff else f"differs in {diff}")
                             for p, (_, diff) in zip(points, results, strict=True)]
    for p, (err, diff) in zip(points, results, strict=True):
        assert not diff, f"{stage} killed at {p}: the rerun differs from an uninterrupted run in {diff}\n{err[-2000:]}"


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------


def damaged_copy(src: Path, dest: Path, shard: str, damage) -> Path:
    shutil.copytree(src, dest)
    f = dest / shard
    f.write_bytes(damage(f.read_bytes()))
    return dest


def truncate(b: bytes) -> bytes:
    return b[:len(b) // 2]


HELD = []  # writer locks this process holds for the "another process writes" case
AROUND = []  # what a case needs in force while its command runs (and only then)


def edited_target(w: World, dest: Path, edit) -> Path:
    """A copy of the world's target with its weights changed by `edit(state_dict)`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(w.target, dest)
    state = load_file(str(dest / "model.safetensors"))
    edit(state)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def nan_norm(state) -> None:
    state["model.norm.weight"][3] = float("nan")


def guard_args(b: BadInput, w: World, tmp: Path) -> list[str] | None:
    """The command lines of the cases where eyas must not report success on a wrong result, or None."""
    from eyas.utils.io import writer_lock

    s = str
    extract = ["--out", s(tmp / "store"), "--device", "cpu", "--dtype", "float32"]
    train = ["--out", s(tmp / "train"), *TRAIN_ARGS(w)]

    def lost_merges() -> str:
        shutil.copytree(w.target, tmp / "lost", ignore=shutil.ignore_patterns("*.safetensors"))
        spec = json.loads((tmp / "lost" / "tokenizer.json").read_text())
        spec["model"]["merges"] = []
        (tmp / "lost" / "tokenizer.json").write_text(json.dumps(spec))
        return s(tmp / "lost")

    def other_target() -> str:
        import transformers as tf

        tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                           num_attention_heads=2, vocab_size=64)).save_pretrained(tmp / "other")
        return s(tmp / "other")

    def hold_out() -> list[str]:
        HELD.append(writer_lock(tmp / "store", "extract"))
        HELD[-1].__enter__()
        return ["extract", "--prepared", s(w.prepared), "--model", s(w.target), *extract]

    def kimi() -> str:
        from _kimi import make_kimi

        return s(make_kimi(tmp / "kimi"))

    def nan_store() -> str:
        from safetensors.torch import load_file, save_file

        shutil.copytree(w.store, tmp / "nan-store")
        head = load_file(str(tmp / "nan-store" / "target_head.safetensors"))
        head["norm.weight"][3] = float("nan")
        save_file(head, str(tmp / "nan-store" / "target_head.safetensors"))
        return s(tmp / "nan-store")

    def held(stage: str, out: Path) -> Path:
        HELD.append(writer_lock(out, stage))
        HELD[-1].__enter__()
        return out

    def file_size_limit() -> list[str]:
        AROUND.append(limited_file_size(16 << 10))
        return ["extract", "--prepared", s(w.prepared), "--model", s(w.target), *extract, "--shard-mb", "0.05"]

    cases = {
        ("prepare", "another process writes the same --out"): lambda: [
            "prepare", s(w.chat), "--model", s(w.target), "--out", s(held("prepare", tmp / "out"))],
        ("regenerate", "another process writes the same --out"): lambda: [
            "regenerate", s(w.chat), "--model", s(w.target), "--out", s(held("regenerate", tmp / "conv.jsonl"))],
        ("eval", "another process writes the same --out"): lambda: [
            "eval", "--draft", s(w.draft), "--model", s(w.target), "--out", s(held("eval", tmp / "eval"))],
        ("extract", "a write fails mid-run (file-size limit)"): file_size_limit,
        ("prepare", "a tokenizer that spells English out (merges lost)"): lambda: [
            "prepare", s(w.chat), "--model", lost_merges(), "--out", s(tmp / "out"), "--num-workers", "1"],
        ("extract", "the checkpoint lacks a weight (lm_head)"): lambda: [
            "extract", "--prepared", s(w.prepared), "--model",
            s(edited_target(w, tmp / "t", lambda st: st.pop("lm_head.weight"))), *extract],
        ("extract", "the final norm holds a NaN"): lambda: [
            "extract", "--prepared", s(w.prepared), "--model", s(edited_target(w, tmp / "t", nan_norm)), *extract],
        ("extract", "--engine vllm: the checkpoint lacks a weight (checked before vLLM starts)"): lambda: [
            "extract", "--prepared", s(w.prepared), "--model", s(edited_target(
                w, tmp / "t", lambda st: st.pop("model.layers.3.mlp.down_proj.weight"))), *extract, "--engine", "vllm"],
        ("extract", "data prepared for another target"): lambda: [
            "extract", "--prepared", s(w.prepared), "--model", other_target(), *extract],
        ("extract", "another process writes the same --out"): hold_out,
        ("train", "the draft vocabulary misses every target token"): lambda: [
            "train", "--store", s(w.store), *train, "--draft-vocab-size", "1"],
        ("train", "a NaN final norm in the store (extracted with --no-preflight)"): lambda: [
            "train", "--store", nan_store(), *train],
        ("train", "--resume over a planted pickle in state.pt"): lambda: planted_resume(w, tmp, train),
        ("eval", "--backend vllm beside a Kimi config without media_placeholder_token_id"): lambda: [
            "eval", "--draft", "random", "--model", kimi(), "--prompts", s(w.chat), "--backend", "vllm",
            "--device", "cpu", "--out", s(tmp / "eval")],
    }
    return cases[(b.stage, b.kind)]() if (b.stage, b.kind) in cases else None


class _Planted:
    def __reduce__(self):
        return print, ("a planted pickle ran",)


def planted_resume(w: World, tmp: Path, train: list[str]) -> list[str]:
    """A run stopped after its step-2 checkpoint whose state.pt now holds a pickle that runs code, and the
    command that resumes it."""
    import torch

    from eyas.recipes.train import TrainOptions, run_train

    run_train(TrainOptions(store=w.store, out=tmp / "train", max_steps=6, save_every=2, log_every=1, token_budget=128,
                           num_workers=0, device="cpu", draft_vocab_size=w.vocab, ttt_steps=2),
              log=lambda m: None, stop_after=3)
    torch.save({"payload": _Planted()}, tmp / "train" / "train_state" / "step-00000002" / "state.pt")
    return ["train", "--store", str(w.store), *train, "--resume"]


@contextlib.contextmanager
def limited_file_size(limit: int):
    """No file this process writes may grow past `limit` bytes: a write beyond fails with EFBIG, as on a full
    disk (root cannot make a disk full or a folder read-only for itself; this limit holds for root too)."""
    before, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
        signal.signal(signal.SIGXFSZ, handler)


def unwritable() -> str:
    """An output path in a folder no process can create files in: /sys (EROFS, EPERM or EACCES, root too)."""
    try:
        os.rmdir(tempfile.mkdtemp(dir="/sys"))
    except OSError:
        return "/sys/eyas-out"
    pytest.skip("/sys takes new folders here")


def output_args(stage: str, w: World, tmp: Path, out: str) -> list[str]:
    """The stage's command line writing to `out` (`eyas run`: its workdir)."""
    s = str
    return {
        "prepare": ["prepare", s(w.chat), "--model", s(w.target), "--out", out, "--num-workers", "1"],
        "regenerate": ["regenerate", s(w.chat), "--model", s(w.target), "--out", out, "--device", "cpu"],
        "extract": ["extract", "--prepared", s(w.prepared), "--model", s(w.target), "--out", out, "--device", "cpu"],
        "train": ["train", "--store", s(w.store), "--out", out, *TRAIN_ARGS(w)],
        "export": ["export", "--draft", s(w.draft), "--out", out],
        "eval": ["eval", "--draft", s(w.draft), "--model", s(w.target), "--prompts", s(w.chat), "--out", out],
        "bundle": ["bundle", s(run_config(w, tmp / "bundled")), "--out", out],
        "run": ["run", s(tmp / "run.yaml")],
    }[stage]


def output_case(b: BadInput, w: World, tmp: Path) -> list[str] | None:
    """The command line of a case of an output path a stage must refuse, or None. What it is given to refuse
    (a folder holding notes.txt, a file) is made here; the test checks they are left as they were."""
    where = {"is a folder eyas did not write": "foreign", "is a file eyas did not write": "afile", "is a file": "afile",
             "is a folder": "foreign", "where this user cannot write (/sys)": "sys"}
    kind = b.kind.removeprefix("--out ").removeprefix("workdir ")
    if kind not in where:
        return None
    out = unwritable() if where[kind] == "sys" else str(tmp / where[kind])
    if b.stage == "run":
        (tmp / "run.yaml").write_text(yaml.safe_dump({"target": str(w.target), "workdir": out}))
    return output_args(b.stage, w, tmp, out)


def bad_input_args(b: BadInput, w: World, tmp: Path) -> list[str]:
    """The command line of one bad input (making the broken files it needs under `tmp`)."""
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "notes.txt").write_text("mine")
    (tmp / "afile").write_text("mine")
    guarded = guard_args(b, w, tmp) or output_case(b, w, tmp)
    if guarded is not None:
        return guarded
    s, empty = str, tmp / "empty"
    empty.mkdir()
    shard = "shard-00000.safetensors"
    prep = ["--model", s(w.target), "--out", s(tmp / "out"), "--num-workers", "1"]
    regen = ["--out", s(tmp / "conv.jsonl"), "--device", "cpu", "--max-new-tokens", "4"]
    extract = ["--out", s(tmp / "store"), "--device", "cpu", "--dtype", "float32"]
    train = ["--out", s(tmp / "train"), *TRAIN_ARGS(w)]
    evaluate = ["--model", s(w.target), "--prompts", s(w.chat), "--max-prompts", "1", "--device", "cpu", "--out",
                s(tmp / "eval")]

    def write(name: str, text: str) -> str:
        (tmp / name).write_text(text)
        return s(tmp / name)

    def run_cfg(text: str, name: str = "bad.yaml") -> list[str]:
        return ["run", write(name, f"target: {w.target}\nworkdir: {tmp / 'work'}\n{text}")]

    return {
        ("prepare", "input file does not exist"): lambda: ["prepare", s(tmp / "nope.jsonl"), *prep],
        ("prepare", "input is not chat data (CSV named .jsonl)"): lambda: [
            "prepare", write("table.jsonl", "a,b\n1,2\n"), *prep],
        ("prepare", "every JSONL line cut off"): lambda: [
            "prepare", write("cut.jsonl", '{"messages": [{"role": "user", "content": "hi\n' * 2), *prep],
        ("prepare", "target folder without a tokenizer"): lambda: [
            "prepare", s(w.chat), "--model", s(empty), "--out", s(tmp / "out")],
        ("prepare", "--template-kwargs is not JSON"): lambda: ["prepare", s(w.chat), *prep, "--template-kwargs", "{a"],
        ("regenerate", "input file does not exist"): lambda: [
            "regenerate", s(tmp / "nope.jsonl"), "--model", s(w.target), *regen],
        ("regenerate", "--temperature -1"): lambda: [
            "regenerate", s(w.chat), "--model", s(w.target), *regen, "--temperature", "-1"],
        ("regenerate", "GGUF target transformers cannot read"): lambda: [
            "regenerate", s(w.chat), "--model", write("broken.gguf", "GGUF" + "\0" * 60), *regen],
        ("extract", "--prepared is not a prepared dataset"): lambda: [
            "extract", "--prepared", s(tmp / "nope"), "--model", s(w.target), *extract],
        ("extract", "prepared shard truncated"): lambda: [
            "extract", "--prepared", s(damaged_copy(w.prepared, tmp / "prepared", shard, truncate)),
            "--model", s(w.target), *extract],
        ("extract", "aux layer beyond the target's layers"): lambda: [
            "extract", "--prepared", s(w.prepared), "--model", s(w.target), "--aux-layers", "1,99", *extract],
        ("extract", "target folder without config.json"): lambda: [
            "extract", "--prepared", s(w.prepared), "--model", s(empty), *extract],
        ("train", "store shard with a damaged header"): lambda: [
            "train", "--store", s(damaged_copy(w.store, tmp / "store", shard, lambda b: b[:12] + b"#" * 8 + b[20:])),
            *train],
        ("train", "store shard truncated"): lambda: [
            "train", "--store", s(damaged_copy(w.store, tmp / "store", shard, truncate)), *train],
        ("train", "flipped bytes in a shard, --verify-store"): lambda: [
            "train", "--store", s(damaged_copy(w.store, tmp / "store", shard, lambda b: b[:-5] + bytes(
                [b[-5] ^ 0xFF]) + b[-4:])), *train, "--verify-store"],
        ("train", "--store is not a store"): lambda: ["train", "--store", s(tmp / "nope"), *train],
        ("train", "--aux-layers N (the last layer's output) on a store"): lambda: [
            "train", "--store", s(w.store), *train, "--aux-layers", "2,8"],
        ("train", "both --store and --prepared"): lambda: [
            "train", "--store", s(w.store), "--prepared", s(w.prepared), *train],
        ("export", "--draft is not a draft folder"): lambda: ["export", "--draft", s(empty), "--out", s(tmp / "x")],
        ("export", "draft weights truncated"): lambda: [
            "export", "--draft", s(damaged_copy(w.draft, tmp / "draft", "model.safetensors", truncate)),
            "--out", s(tmp / "x")],
        ("export", "--num-speculative-tokens -1"): lambda: [
            "export", "--draft", s(w.draft), "--out", s(tmp / "x"), "--num-speculative-tokens", "-1"],
        ("export", "--force-aux-layers without --model, ids beyond the draft's target"): lambda: [
            "export", "--draft", s(w.draft), "--out", s(tmp / "x"), "--aux-layers", "7,8,9", "--force-aux-layers"],
        ("export", "--format sglang of a draft reading aux id N (the last layer's output)"): lambda: [
            "export", "--draft", s(w.draft), "--out", s(tmp / "x"), "--format", "sglang", "--aux-layers", "2,4,8",
            "--force-aux-layers"],
        ("eval", "--draft does not exist"): lambda: ["eval", "--draft", s(tmp / "nope"), *evaluate],
        ("eval", "--chain is not numbers"): lambda: ["eval", "--draft", s(w.draft), *evaluate, "--chain", "a,b"],
        ("eval", "--tree is malformed"): lambda: ["eval", "--draft", s(w.draft), *evaluate, "--tree", "5"],
        ("eval", "--temperature -1"): lambda: ["eval", "--draft", s(w.draft), *evaluate, "--temperature", "-1"],
        ("run", "text where a number belongs"): lambda: run_cfg("train:\n  lr: fast\n"),
        ("run", "a number where text belongs"): lambda: run_cfg("eval:\n  prompts: 5\n"),
        ("run", "text where a list belongs"): lambda: run_cfg("prepare:\n  inputs: dummy\n"),
        ("run", "unknown key"): lambda: run_cfg("train:\n  lerning_rate: 0.001\n"),
        ("run", "invalid YAML"): lambda: run_cfg("train:\n  lr: [1\n"),
        ("run", "config file does not exist"): lambda: ["run", s(tmp / "nope.yaml")],
    }[(b.stage, b.kind)]()


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=[f"{b.stage}: {b.kind}" for b in BAD_INPUTS])
def test_bad_input_ends_in_one_clear_error(bad, world, tmp_path, capsys, monkeypatch):
    """In this process through the CLI's own entry point (what `eyas` runs): an exception other than
    EyasError would escape as a traceback and fail the test."""
    from eyas.cli import main

    args = bad_input_args(bad, world, tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["eyas", *args])
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))  # a GGUF that fails leaves nothing behind
    with pytest.raises(SystemExit) as ended, contextlib.ExitStack() as around:
        while AROUND:
            around.enter_context(AROUND.pop())
        main()
    err = capsys.readouterr().err
    assert ended.value.code == 2, err
    assert [p.name for p in (tmp_path / "foreign").iterdir()] == ["notes.txt"], "a folder eyas did not write changed"
    assert (tmp_path / "foreign" / "notes.txt").read_text() == (tmp_path / "afile").read_text() == "mine"
    assert "Traceback" not in err and err.count("eyas: error:") == 1, err
    assert re.search(bad.expect, " ".join(err.split()), re.S), f"{bad.kind}: {err}"
    OUTCOMES.bad[(bad.stage, bad.kind)] = "clear error (exit 2)"


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------


def test_the_reliability_table_is_what_the_tests_define_and_saw():
    """docs/reliability.md is rendered from tests/_reliability.py's cases and this session's outcomes;
    EYAS_WRITE_RELIABILITY=1 rewrites it (after every case above ran and passed)."""
    if not OUTCOMES.complete():
        pytest.skip("not every fault and bad-input case ran in this session: the table needs them all")
    text = render(OUTCOMES)
    if os.environ.get("EYAS_WRITE_RELIABILITY"):
        TABLE.write_text(text)
    assert TABLE.is_file() and TABLE.read_text() == text, (
        f"{TABLE} is out of date with the cases: rerun `EYAS_WRITE_RELIABILITY=1 pytest tests/test_reliability.py`")
