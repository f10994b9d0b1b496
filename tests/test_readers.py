"""Reading chat data: ShareGPT/OpenAI/datasets inputs, every kind of bad row, the truncated ShareGPT file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.data.readers import SkipLog, normalize_record, read_conversations, resolve_input
from eyas.utils.io import EyasError


def jsonl(path: Path, lines: list) -> Path:
    """Write lines (objects are dumped, bytes/str written as they are) as a JSONL file."""
    with open(path, "wb") as f:
        for x in lines:
            if isinstance(x, bytes):
                f.write(x)
            elif isinstance(x, str):
                f.write(x.encode())
            else:
                f.write(json.dumps(x, ensure_ascii=False).encode())
            f.write(b"\n")
    return path


def sharegpt(*turns: str) -> dict:
    roles = ["human", "gpt"]
    return {"id": "x", "conversations": [{"from": roles[i % 2], "value": t} for i, t in enumerate(turns)]}


def test_sharegpt_json_and_role_mapping(tmp_path):
    rec = {"conversations": [{"from": "system", "value": "Be nice."}, {"from": "human", "value": "hi"},
                             {"from": "chatgpt", "value": "hello"}, {"from": "user", "value": "bye"},
                             {"from": "bard", "value": "ciao"}]}  # fmt: skip
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([rec, sharegpt("q", "a")], indent=2))
    convs = read_conversations(path)
    assert convs[0] == [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                        {"role": "assistant", "content": "ciao"}]  # fmt: skip
    assert convs[1] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_openai_messages_with_tools_and_content_parts(tmp_path):
    call = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]
    rec = {"messages": [
        {"role": "system", "content": "tools on"},
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": call},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"},
        {"role": "assistant", "content": "21 °C."},
    ]}  # fmt: skip
    convs = read_conversations(jsonl(tmp_path / "oa.jsonl", [rec]))
    assert [m["role"] for m in convs[0]] == ["system", "user", "assistant", "tool", "assistant"]
    assert convs[0][1]["content"] == "Weather in Paris?"
    assert convs[0][2] == {"role": "assistant", "content": "", "tool_calls": call}
    assert convs[0][3]["tool_call_id"] == "c1"


def test_cleanup_rules():
    # leading assistant turns have no prompt: dropped (system kept); trailing user turns train nothing
    conv = normalize_record({"conversations": [
        {"from": "system", "value": "s"}, {"from": "gpt", "value": "orphan"}, {"from": "human", "value": "q"},
        {"from": "gpt", "value": "a"}, {"from": "human", "value": "unanswered"}]})  # fmt: skip
    assert [m["content"] for m in conv] == ["s", "q", "a"]
    # cut at the first blank message: everything after it lost its context
    conv = normalize_record(sharegpt("q1", "a1", "q2", "  ", "q3", "a3"))
    assert [m["content"] for m in conv] == ["q1", "a1"]
    # blank system prompt: left out, the rest kept
    conv = normalize_record({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "a"}]})  # fmt: skip
    assert [m["role"] for m in conv] == ["user", "assistant"]


def test_every_bad_row_kind_is_skipped_and_counted_with_file_and_line(tmp_path):
    path = jsonl(tmp_path / "bad.jsonl", [
        sharegpt("q", "a"),                                                        # 1 ok
        "{not json",                                                               # 2 not_json
        {"conversations": [{"from": "wizard", "value": "x"}]},                     # 3 unknown_role
        {"conversations": []},                                                     # 4 empty
        b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}',             # 5 not_utf8
        {"text": "no conversation here"},                                          # 6 bad_shape
        sharegpt("only a question"),                                               # 7 no_assistant
        sharegpt("", ""),                                                          # 8 empty
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},      # 9 bad_shape
        sharegpt("q2", "a2"),                                                      # 10 ok
        {"messages": None},                                                        # 11 bad_shape
    ])  # fmt: skip
    log = SkipLog()
    convs = read_conversations(path, log)
    assert len(convs) == 2
    assert dict(log.counts) == {"not_json": 1, "unknown_role": 1, "empty": 2, "not_utf8": 1, "bad_shape": 3,
                                "no_assistant": 1}  # fmt: skip
    assert log.examples["not_json"][0].startswith(f"{path}:2: ")
    assert log.examples["unknown_role"][0].startswith(f"{path}:3: ") and "wizard" in log.examples["unknown_role"][0]
    assert [e.split(": ")[0] for e in log.examples["empty"]] == [f"{path}:4", f"{path}:8"]
    assert log.examples["not_utf8"][0].startswith(f"{path}:5: ")
    assert f"{path}:11: 'messages' is null" in log.examples["bad_shape"][-1]
    assert any("wizard" in line for line in log.lines())


def test_json_array_resyncs_after_a_broken_record_and_reports_a_cut_file(tmp_path):
    good = json.dumps(sharegpt("q", "a"), indent=2).replace("\n", "\n  ")
    broken = '{\n    "conversations": [\n      {"from": "human" "value": "missing comma"}\n    ]\n  }'
    text = f"[\n  {good},\n  {broken},\n  {good},\n  {good[:40]}"  # the last record is cut off
    path = tmp_path / "cut.json"
    path.write_text(text)
    log = SkipLog()
    convs = read_conversations(path, log)
    assert len(convs) == 2
    assert dict(log.counts) == {"not_json": 1, "truncated_file": 1}
    lines = text.split("\n")
    broken_line = next(i for i, line in enumerate(lines, 1) if line.startswith("  {") and "missing" in lines[i + 1])
    assert log.examples["not_json"][0].startswith(f"{path}:{broken_line}: ")
    assert "2 records before it" in log.examples["truncated_file"][0]


def test_json_array_row_with_invalid_utf8_is_skipped(tmp_path):
    good = json.dumps(sharegpt("q", "a")).encode()
    bad = json.dumps(sharegpt("caf_", "ok")).encode().replace(b"caf_", b"caf\xe9")
    path = tmp_path / "latin1.json"
    path.write_bytes(b"[\n" + good + b",\n" + bad + b",\n" + good + b"\n]\n")
    log = SkipLog()
    assert len(read_conversations(path, log)) == 2
    assert dict(log.counts) == {"not_utf8": 1} and log.examples["not_utf8"][0].startswith(f"{path}:3: ")


def test_embedded_sharegpt_file_is_truncated_and_recovered():
    """The shipped ShareGPT JSON is cut off: every complete record is recovered, the cut one reported."""
    from eyas.assets import sharegpt_path

    path = sharegpt_path()
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8"))
    rows = list(resolve_input("sharegpt").rows())
    complete = [r for r in rows if r.skip != "truncated_file"]
    assert len(complete) == 17_671
    assert [r.skip for r in rows].count("truncated_file") == 1 and rows[-1].skip == "truncated_file"
    assert "17,671 records before it" in rows[-1].detail
    reasons = {r.skip for r in complete if r.skip}
    assert reasons <= {"empty", "no_assistant"}
    assert sum(r.skip == "empty" for r in complete) == 126
    usable = [r.messages for r in complete if r.skip is None]
    assert len(usable) > 17_000
    assert all(c[-1]["role"] == "assistant" and any(m["role"] == "user" for m in c) for c in usable)


def test_datasets_parquet_and_saved_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(3)]  # fmt: skip
    rows.append({"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]})
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for name in ("chat.parquet", "saved"):
        log = SkipLog()
        convs = read_conversations(tmp_path / name, log)
        assert [c[1]["content"] for c in convs] == ["a0", "a1", "a2"]
        assert dict(log.counts) == {"unknown_role": 1}
        assert log.examples["unknown_role"][0].startswith(f"{tmp_path / name}:4: ")


def test_unreadable_inputs_raise_a_user_error(tmp_path):
    (tmp_path / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    for name, words in [(tmp_path / "missing.jsonl", "not found"), (tmp_path / "binary.json", "neither"),
                        (tmp_path / "folder", "not a saved dataset"),
                        (tmp_path / "notes.txt", "unknown file type")]:  # fmt: skip
        with pytest.raises(EyasError) as e:
            read_conversations(name)
        assert e.value.exit_code == 2 and words in str(e.value) and str(name) in str(e.value)


def test_a_cut_off_jsonl_line_is_reported_as_truncated_with_what_to_do(tmp_path):
    """A line cut inside a string used to read "Invalid control character at column 54": now it says
    truncated, where (file:line) and what to do; the last line of a cut file says the file ends there."""
    full = json.dumps({"messages": [{"role": "user", "content": "hello there, how are you today?"},
                                    {"role": "assistant", "content": "fine"}]})
    path = tmp_path / "cut.jsonl"
    path.write_text("\n".join([full, full[:54], full, full[:30]]))  # line 2 cut mid-string, the file mid-record
    log = SkipLog()
    assert len(read_conversations(path, log)) == 2
    assert dict(log.counts) == {"truncated_line": 1, "truncated_file": 1}
    line2, line4 = log.examples["truncated_line"][0], log.examples["truncated_file"][0]
    assert line2.startswith(f"{path}:2: truncated: the line ends inside its JSON record after 54 characters"), line2
    assert "complete or delete line 2" in line2 and "control character" not in line2
    assert line4.startswith(f"{path}:4: truncated: the file ends inside its JSON record")
    path.write_text(full + "\n" + full.replace('"role"', '"role" 1') + "\n")  # malformed, not cut: still not_json
    log = SkipLog()
    read_conversations(path, log)
    assert dict(log.counts) == {"not_json": 1}
