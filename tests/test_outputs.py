"""Output paths: a stage writes only where it may (a new or empty folder, or its own earlier output), says so
before any work when it may not, and turns a write that fails mid-run into one `eyas: error:` line. Each
stage's refusals, through the CLI, are rows of tests/test_reliability.py; here is the rule itself."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest
from _train_utils import make_prepared, make_target
from safetensors.torch import save_file

from eyas.utils.io import EyasError, as_os_error, check_output, has_manifest, os_error_line

pytestmark = pytest.mark.usefixtures("one_thread")


def exported(p: Path) -> bool:
    return has_manifest(p / "manifest.json", "eyas.export/1")


def test_a_new_an_empty_and_its_own_folder_are_written_anything_else_is_refused(tmp_path):
    check_output(tmp_path / "new" / "out", "export", exported)  # missing, parents too
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", "export", exported)
    own = tmp_path / "own"
    own.mkdir()
    (own / "manifest.json").write_text(json.dumps({"format": "eyas.export/2"}))  # another version of the same kind
    (own / "model.safetensors").write_bytes(b"")
    check_output(own, "export", exported)
    debris = tmp_path / "debris"  # what a killed eyas writer leaves inside is not a user's file
    (debris / f".tmp-x-1@{os.uname().nodename}-abcdefgh").mkdir(parents=True)
    check_output(debris, "export", exported)

    other_kind = tmp_path / "eval"
    other_kind.mkdir()
    (other_kind / "manifest.json").write_text(json.dumps({"format": "eyas.eval/1"}))
    with pytest.raises(EyasError, match=r"eval is a folder that `eyas export` did not write \(it holds manifest"):
        check_output(other_kind, "export", exported)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(EyasError, match="file is a file, not a folder: `eyas export` writes a folder there"):
        check_output(tmp_path / "file", "export", exported)
    with pytest.raises(EyasError, match=r"file/out: .*file is a file, not a folder, so nothing can be written under"):
        check_output(tmp_path / "file" / "out", "export", exported)
    with pytest.raises(EyasError, match="empty is a folder; `eyas regenerate` writes a file there"):
        check_output(tmp_path / "empty", "regenerate", lambda p: False, file=True)
    with pytest.raises(EyasError, match="file exists and `eyas regenerate` did not write it"):
        check_output(tmp_path / "file", "regenerate", lambda p: False, file=True)
    assert (tmp_path / "file").read_text() == "mine"
    assert sorted(p.name for p in other_kind.iterdir()) == ["manifest.json"]
    assert not [p for p in tmp_path.rglob(".tmp-probe-*")], "the write probe is removed"


def test_export_to_the_current_folder_leaves_it_as_it_was(tmp_path, monkeypatch, capsys):
    """`eyas export --out .` emptied the folder it ran in: now it refuses, and nothing there changes."""
    from eyas.cli import main

    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["eyas", "export", "--draft", str(tmp_path / "data"), "--out", "."])
    with pytest.raises(SystemExit) as ended:
        main()
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("eyas: error:") == 1 and "Traceback" not in err, err
    assert "--out . is a folder that `eyas export` did not write (it holds data and 1 more" in " ".join(err.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


def test_a_failed_write_reads_as_one_line_naming_the_file_and_what_to_do(tmp_path):
    """Real errors: a folder where a file goes, and safetensors' writer (its own error type, no path) on /sys."""
    try:
        open(tmp_path, "w")  # noqa: SIM115 - raises
    except OSError as e:
        line = os_error_line(e)
    assert line.startswith(f"{tmp_path}: Is a directory. A folder stands where a file is needed"), line
    try:
        save_file({}, "/sys/eyas.safetensors")
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError, whatever its module
        err = as_os_error(e)
    if err is None:
        pytest.skip("/sys takes files here")
    assert err.errno in (errno.EPERM, errno.EACCES, errno.EROFS, errno.ENOENT)
    assert os_error_line(err).startswith(f"writing a safetensors file: {os.strerror(err.errno)}. ")
    assert as_os_error(ValueError("I/O error: x (os error 28)")) is None  # only safetensors' own errors


def test_extract_says_what_the_target_computes_in_and_where(tmp_path, capsys):
    from eyas.recipes.extract import ExtractOptions, run_extract

    target, prepared = make_target(tmp_path / "target"), make_prepared(tmp_path / "prepared", n=4)
    run_extract(ExtractOptions(prepared=prepared, out=tmp_path / "store", model=str(target), engine="hf",
                               aux_layer_ids=[1, 3, 4], dtype="float32", device="cpu", preflight=False))
    assert "extracting with the hf engine: the target computes in float32 on cpu" in capsys.readouterr().err
