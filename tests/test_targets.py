"""One way to name a target everywhere: every command family (prepare, regenerate, extract, train --online,
export, eval, run, plan) takes the embedded default's alias, a GGUF file, a local folder and a Hugging Face id from
the local cache, and works on the folder the one resolver gives for it. The alias and the GGUF are the real
SmolLM2 package; the folder is a tiny random Llama over SmolLM2's tokenizer, and the hub id names that same
tiny model laid out in a Hugging Face cache (blobs, snapshots/REV, refs/main) under $HF_HUB_CACHE, offline."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from _eval_utils import save_tiny_chat_target
from transformers import AutoConfig, AutoTokenizer
from typer.testing import CliRunner

from eyas.assets import resolve_model, smollm2_gguf
from eyas.cli import app
from eyas.utils.io import read_json

pytestmark = pytest.mark.usefixtures("one_thread")

FORMS = ("alias", "gguf", "folder", "hub")
HUB_ID = "tiny-org/tiny-llama"


@dataclass(frozen=True)
class Target:
    name: str  # as the user types it
    folder: Path  # what the resolver must give
    hidden: int


def hub_cache(cache: Path, repo_id: str, files: Path) -> Path:
    """`files` laid out as huggingface_hub caches a download: content-addressed blobs, a snapshot of links to
    them, and refs/main naming the snapshot's revision. Returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(files.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture(scope="module")
def targets(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("targets")
    save_tiny_chat_target(root / "tiny", AutoTokenizer.from_pretrained(smollm2_dir))
    snapshot = hub_cache(root / "hub", HUB_ID, root / "tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(root / "hub"))
        mp.setenv("HF_HUB_OFFLINE", "1")  # the cache is all there is
        yield {"alias": Target("smollm2", Path(smollm2_dir), 576),
               "gguf": Target(str(smollm2_gguf()), Path(smollm2_dir), 576),
               "folder": Target(str(root / "tiny"), root / "tiny", 32),
               "hub": Target(HUB_ID, snapshot, 32)}


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    with open(path, "w") as f:
        for i in range(4):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Count to {i + 3}."},
                                             {"role": "assistant", "content": " ".join(map(str, range(i + 3)))}]})
                    + "\n")
    return path


@pytest.fixture(scope="module")
def prepared(targets, chats, tmp_path_factory):
    """One prepared dataset serves every target: all four share SmolLM2's tokenizer."""
    out = tmp_path_factory.mktemp("prepared") / "p"
    eyas("prepare", str(chats), "--model", "smollm2", "--out", str(out), "--num-workers", "1", "--max-length", "64")
    return out


def eyas(*args: str) -> str:
    done = CliRunner().invoke(app, list(args))
    assert done.exit_code == 0, (done.output, done.exception)
    return done.output


def test_the_resolver_gives_each_form_its_folder(targets):
    for form in FORMS:
        assert Path(resolve_model(targets[form].name)) == targets[form].folder, form


@pytest.mark.parametrize("form", FORMS)
def test_prepare(targets, chats, tmp_path, form):
    t = targets[form]
    eyas("prepare", str(chats), "--model", t.name, "--out", str(tmp_path / "p"), "--num-workers", "1")
    assert Path(read_json(tmp_path / "p" / "manifest.json")["tokenizer"]) == t.folder


@pytest.mark.parametrize("form", FORMS)
def test_regenerate(targets, chats, tmp_path, form):
    t = targets[form]
    out = tmp_path / "r.jsonl"
    eyas("regenerate", str(chats), "--model", t.name, "--out", str(out), "--max-samples", "1", "--max-new-tokens",
         "3", "--temperature", "0", "--device", "cpu", "--no-preflight")
    manifest = read_json(out.with_name(out.name + ".manifest.json"))
    assert Path(manifest["model"]) == t.folder and manifest["complete"]


@pytest.mark.parametrize("form", FORMS)
def test_extract(targets, prepared, tmp_path, form):
    t = targets[form]
    eyas("extract", "--prepared", str(prepared), "--model", t.name, "--out", str(tmp_path / "s"), "--device", "cpu",
         "--dtype", "float32", "--max-samples", "2")
    manifest = read_json(tmp_path / "s" / "manifest.json")
    assert Path(manifest["target"]) == t.folder and manifest["hidden_size"] == t.hidden


@pytest.mark.parametrize("form", FORMS)
def test_train_online(targets, prepared, tmp_path, form):
    t = targets[form]
    eyas("train", "--online", "--prepared", str(prepared), "--model", t.name, "--out", str(tmp_path / "t"),
         "--device", "cpu", "--max-steps", "1", "--ttt-steps", "1", "--draft-vocab-size", "64", "--token-budget",
         "128", "--num-workers", "0", "--report-to", "none", "--save-every", "0")
    draft = read_json(tmp_path / "t" / "draft" / "config.json")
    assert draft["target_hidden_size"] == t.hidden and Path(draft["target"]) == t.folder


def random_draft(target: Path, out: Path) -> Path:
    import torch

    from eyas.model.config import DraftConfig
    from eyas.model.eagle3 import Eagle3Draft
    from eyas.model.vocab import build_draft_vocab

    cfg = DraftConfig.from_target_config(AutoConfig.from_pretrained(target), [1, 2, 3], 64, target=str(target))
    draft = Eagle3Draft(cfg)
    draft.set_vocab(*build_draft_vocab(torch.zeros(cfg.vocab_size, dtype=torch.long), cfg.draft_vocab_size))
    draft.save_pretrained(out)
    return out


@pytest.mark.parametrize("form", FORMS)
def test_export(targets, tmp_path, form):
    """--model checks the draft against the target; --verifier is what the serving engine loads: a hub id or a
    folder as given, the alias and a GGUF as the converted folder (no engine knows the alias)."""
    t = targets[form]
    draft = random_draft(t.folder, tmp_path / "d")
    eyas("export", "--draft", str(draft), "--model", t.name, "--verifier", t.name, "--format", "speculators",
         "--out", str(tmp_path / "e"))
    verifier = read_json(tmp_path / "e" / "config.json")["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == (str(t.folder.absolute()) if form in ("alias", "gguf") else t.name)
    if form == "hub":  # without --verifier: the target recorded at training (its snapshot) is served by its id
        eyas("export", "--draft", str(draft), "--format", "speculators", "--out", str(tmp_path / "e2"))
        assert read_json(tmp_path / "e2" / "config.json")["speculators_config"]["verifier"]["name_or_path"] == HUB_ID


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "q.jsonl"
    path.write_text(json.dumps({"question_id": 1, "turns": ["Count to five."]}) + "\n")
    return path


@pytest.mark.parametrize("form", FORMS)
def test_eval(targets, questions, tmp_path, form):
    """The alias's real report also feeds the quickstart's closing words: they call 3.51 tau and give 3.41 as
    the tokens per target forward (docs/benchmarks.md), never the other way round."""
    from eyas.recipes.run import in_words

    t = targets[form]
    eyas("eval", "--draft", "random", "--model", t.name, "--prompts", f"q={questions}", "--max-prompts", "1",
         "--max-turns", "1", "--max-new-tokens", "4", "--chain", "1", "--tree", "none", "--device", "cpu",
         "--out", str(tmp_path / "ev"))
    report = read_json(tmp_path / "ev" / "report.json")
    assert Path(report["meta"]["target"]) == t.folder
    if form == "alias":
        words = in_words(report, {}, tmp_path / "export")
        assert "tau 3.51 (chain of 7; 3.41 tokens per target forward)" in words, words
        assert "3.51 tokens" not in words
        chain = report["results"]["all"]["chain-1"]
        assert f"{chain['tau']:.2f} tokens on average with chain-1 (tau;" in words
        assert f"{chain['tokens_per_target_forward']:.2f} per target forward" in words


@pytest.mark.parametrize("form", ["gguf", "folder", "hub"])  # the alias: tests/test_run.py's end-to-end run
def test_run(targets, chats, questions, tmp_path, form):
    t = targets[form]
    config = {"target": t.name, "workdir": str(tmp_path / "w"),
              "prepare": {"inputs": [str(chats)], "max_length": 64, "num_workers": 1},
              "extract": {"dtype": "float32", "device": "cpu"},
              "train": {"ttt_steps": 1, "draft_vocab_size": 64, "max_steps": 1, "token_budget": 128,
                        "num_workers": 0, "report_to": "none", "device": "cpu"},
              "eval": {"prompts": f"q={questions}", "max_prompts": 1, "max_turns": 1, "max_new_tokens": 4,
                       "chain": "1", "tree": "none", "device": "cpu"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    eyas("run", str(path))
    assert Path(read_json(tmp_path / "w" / "store" / "manifest.json")["target"]) == t.folder
    assert Path(read_json(tmp_path / "w" / "eval" / "trained" / "report.json")["meta"]["target"]) == t.folder


@pytest.mark.parametrize("form", FORMS)
def test_plan(targets, tmp_path, form):
    """`eyas plan` reads configs only: a GGUF's header, the cached snapshot's config.json; never a weight."""
    from eyas.plan.estimate import read_target

    t = targets[form]
    assert read_target(t.name).shape.hidden == t.hidden
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"target": t.name, "workdir": str(tmp_path / "w")}))
    assert "prepare" in eyas("plan", str(path))
