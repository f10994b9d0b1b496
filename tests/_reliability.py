"""What the reliability tests (tests/test_reliability.py) try, per stage, and the table they render into
docs/reliability.md. The table is written from these definitions and the outcomes the tests recorded,
never by hand; a test checks the committed table against them, so it cannot drift.

Faults: each stage runs as `python -m eyas.cli ...` (through tests/_killpoint.py) and is SIGKILLed at
seeded points, then the same command runs again and must end with the uninterrupted run's output.
Bad inputs: each kind must end in one `eyas: error:` message saying what, where and what to do, exit
code 2 and no traceback.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

STAGES = ("prepare", "regenerate", "extract", "train", "export", "eval", "run")
TABLE = Path(__file__).parent.parent / "docs" / "reliability.md"


@dataclass(frozen=True)
class KillPoint:
    """`event`: just before the stage's Nth change to its output folder, N = at x the uninterrupted run's
    count; `time`: at x of the way from the uninterrupted run's first to its last change."""

    how: str
    at: float

    def __str__(self) -> str:
        return f"{self.how} {self.at:.2f}"


def kill_points(stage: str) -> list[KillPoint]:
    rng = random.Random(f"eyas-faults-{stage}")  # a str seed: the same points on every machine
    return [KillPoint("event", round(rng.uniform(0.05, 0.95), 2)), KillPoint("time", round(rng.uniform(0.1, 0.9), 2))]


@dataclass(frozen=True)
class Rerun:
    """How a rerun after a kill must match the uninterrupted run, and why where it is not bitwise."""

    bitwise: str  # what is compared byte for byte
    bounded: str = ""  # what is compared without its wall-clock fields, and why those differ


RERUNS = {
    "prepare": Rerun("the shards, token counts and manifest"),
    "regenerate": Rerun("the regenerated JSONL and its manifest (greedy decoding)"),
    "extract": Rerun("every shard, the target head and the manifest (the plan fixes each shard's samples)"),
    "train": Rerun("the draft and every checkpoint's weights (exact resume: weights, optimizer, RNG and data "
                   "position are checkpointed)",
                   "`seconds`, `elapsed`, `tok_per_s` in the manifests and metrics.jsonl (the resumed run redoes "
                   "the steps after its last checkpoint); progress.json's `start` (where this process began); "
                   "state.pt by content (optimizer, schedule, metrics window), less the global RNG states: Python's "
                   "and NumPy's are never seeded, torch's is one DataLoader seed draw ahead after a resume, and "
                   "nothing in training draws from them"),
    "export": Rerun("every layout's weights, config, README and manifest"),
    "eval": Rerun("every generation, acceptance count and the acceptance plots (greedy decoding; finished "
                  "generations are kept in OUT.partial.jsonl)",
                  "timings (`seconds`, `tok_s`, `tokens_per_s`, `speedup`, `speedup_range`, `speedup_note`, "
                  "`created`) and the `recommendation` they decide, in report.json and report.md, and the speedup "
                  "plot tau_vs_k.png: a resumed run times only what it redid"),
    "run": Rerun("every stage's outputs, as above", "as above, run_state.json's per-stage fingerprints and "
                 "seconds (they hash the work folder's own path), and summary.json's `in_words` (it quotes the "
                 "speedup)"),
}


@dataclass(frozen=True)
class BadInput:
    stage: str
    kind: str  # a short name, shown in the table
    expect: str  # a regex the one error message must match: what, where and what to do


BAD_INPUTS = [
    BadInput("prepare", "input file does not exist",
             r"nope\.jsonl.*(not found|does not exist)"),
    BadInput("prepare", "input is not chat data (CSV named .jsonl)",
             r"table\.jsonl:1: neither a JSON array nor JSONL.*Give ShareGPT/OpenAI chat data"),
    BadInput("prepare", "every JSONL line cut off",
             r"no usable conversation.*truncated_line.*cut\.jsonl:1: truncated.*complete or delete line 1"),
    BadInput("prepare", "target folder without a tokenizer",
             r"cannot load the tokenizer of .*empty.*Pass a local model folder"),
    BadInput("prepare", "a tokenizer that spells English out (merges lost)",
             r"splits plain English into \d+ tokens for \d+ words .* lost its merges"),
    BadInput("prepare", "--template-kwargs is not JSON",
             r"--template-kwargs is not valid JSON"),
    BadInput("prepare", "--out is a folder eyas did not write",
             r"--out .*foreign is a folder that `eyas prepare` did not write "
             r"\(it holds notes\.txt.*Choose a new or empty folder"),
    BadInput("prepare", "--out is a file",
             r"--out .*afile is a file, not a folder: `eyas prepare` writes a folder there"),
    BadInput("prepare", "--out where this user cannot write (/sys)",
             r"--out /sys/eyas-out: cannot write in /sys \(.+\)\. "
             r"Choose a --out on a disk and folder this user can write"),
    BadInput("prepare", "another process writes the same --out",
             r"is being written by another eyas process \(`eyas prepare`, pid \d+ on .*pick another --out"),
    BadInput("regenerate", "input file does not exist",
             r"nope\.jsonl.*(not found|does not exist)"),
    BadInput("regenerate", "--temperature -1",
             r"sampling options out of range: need --temperature >= 0"),
    BadInput("regenerate", "GGUF target transformers cannot read",
             r"cannot read .*broken\.gguf.*damaged or truncated file fails too\. Give --model the model's safetensors"),
    BadInput("regenerate", "--out is a file eyas did not write",
             r"--out .*afile exists and `eyas regenerate` did not write it.*Choose another --out"),
    BadInput("regenerate", "--out is a folder",
             r"--out .*foreign is a folder; `eyas regenerate` writes a file there.*Give --out a file path"),
    BadInput("regenerate", "--out where this user cannot write (/sys)",
             r"--out /sys/eyas-out: cannot write in /sys \(.+\)\. "
             r"Choose a --out on a disk and folder this user can write"),
    BadInput("regenerate", "another process writes the same --out",
             r"is being written by another eyas process \(`eyas regenerate`, pid \d+ on .*pick another --out"),
    BadInput("extract", "--prepared is not a prepared dataset",
             r"nope is not a prepared dataset \(no manifest\.json\)\. Run `eyas prepare` first"),
    BadInput("extract", "prepared shard truncated",
             r"shard-00000\.safetensors is damaged: .*truncated.*delete .* and rerun the `eyas prepare` command"),
    BadInput("extract", "aux layer beyond the target's layers",
             r"out of range"),
    BadInput("extract", "target folder without config.json",
             r"cannot read the config of target .*empty"),
    BadInput("extract", "the checkpoint lacks a weight (lm_head)",
             r"lacks 1 weight\(s\) its model has: lm_head\.weight.*--allow-missing-weights"),
    BadInput("extract", "the final norm holds a NaN",
             r"\[head_weights\] the final norm's weight holds 1 NaN/inf"),
    BadInput("extract", "data prepared for another target",
             r"prepared with the tokenizer of .*\(vocabulary [\d,]+\), but the target .* has a vocabulary of 64"),
    BadInput("extract", "--engine vllm: the checkpoint lacks a weight (checked before vLLM starts)",
             r"lacks 1 weight\(s\) its model has: model\.layers\.3\.mlp\.down_proj\.weight\. vLLM would run with "
             r"them uninitialized.*--allow-missing-weights"),
    BadInput("extract", "another process writes the same --out",
             r"is being written by another eyas process \(`eyas extract`, pid \d+ on .*pick another --out"),
    BadInput("extract", "--out is a folder eyas did not write",
             r"--out .*foreign is a folder that `eyas extract` did not write "
             r"\(it holds notes\.txt.*Choose a new or empty folder"),
    BadInput("extract", "--out is a file",
             r"--out .*afile is a file, not a folder: `eyas extract` writes a folder there"),
    BadInput("extract", "--out where this user cannot write (/sys)",
             r"--out /sys/eyas-out: cannot write in /sys \(.+\)\. "
             r"Choose a --out on a disk and folder this user can write"),
    BadInput("extract", "a write fails mid-run (file-size limit)",
             r"store\.partial/\.tmp-shard-\d+\.safetensors: File too large\. A file outgrew this process' "
             r"file-size limit"),
    BadInput("train", "the draft vocabulary misses every target token",
             r"training steps up to step \d+ had no valid token .*outside the draft vocabulary"),
    BadInput("train", "a NaN final norm in the store (extracted with --no-preflight)",
             r"the store .*nan-store holds non-finite values.*target_head\.safetensors: the final norm's weight holds "
             r"1 NaN/inf.*rerun `eyas extract` with its preflight on"),
    BadInput("train", "--resume over a planted pickle in state.pt",
             r"state\.pt holds .*, not only tensors and plain values: resume does not unpickle it"),
    BadInput("train", "store shard with a damaged header",
             r"shard-00000\.safetensors is damaged: the header is not valid JSON.*eyas extract --out .* --verify"),
    BadInput("train", "store shard truncated",
             r"shard-00000\.safetensors is damaged: .*\(truncated\).*rerun the `eyas extract` command"),
    BadInput("train", "flipped bytes in a shard, --verify-store",
             r"failed verification.*shard-00000\.safetensors: sha256 differs.*Re-extract"),
    BadInput("train", "--store is not a store",
             r"nope/manifest\.json not found: .* is not a finished eyas hidden-state store"),
    BadInput("train", "both --store and --prepared",
             r"give exactly one of --store \(offline\) or --prepared"),
    BadInput("train", "--aux-layers N (the last layer's output) on a store",
             r"--aux-layers for the store .* \[2, 8\]: \[8\] out of range .*valid: 0\.\.7"),
    BadInput("train", "--out is a folder eyas did not write",
             r"--out .*foreign is a folder that `eyas train` did not write "
             r"\(it holds notes\.txt.*Choose a new or empty folder"),
    BadInput("train", "--out is a file",
             r"--out .*afile is a file, not a folder: `eyas train` writes a folder there"),
    BadInput("train", "--out where this user cannot write (/sys)",
             r"--out /sys/eyas-out: cannot write in /sys \(.+\)\. "
             r"Choose a --out on a disk and folder this user can write"),
    BadInput("export", "--draft is not a draft folder",
             r"empty is not a draft checkpoint: it has no config\.json"),
    BadInput("export", "draft weights truncated",
             r"cannot read weights .*model\.safetensors.*train or export the draft again"),
    BadInput("export", "--num-speculative-tokens -1",
             r"--num-speculative-tokens must be >= .*got -1"),
    BadInput("export", "--force-aux-layers without --model, ids beyond the draft's target",
             r"--aux-layers \[7, 8, 9\]: \[9\] out of range for a target with 8 decoder layers"),
    BadInput("export", "--format sglang of a draft reading aux id N (the last layer's output)",
             r"SGLang captures the inputs of decoder layers 0\.\.7 only.*\[2, 4, 8\]\. Export --format vllm"),
    BadInput("export", "--out is a folder eyas did not write",
             r"--out .*foreign is a folder that `eyas export` did not write "
             r"\(it holds notes\.txt.*Choose a new or empty folder"),
    BadInput("export", "--out is a file",
             r"--out .*afile is a file, not a folder: `eyas export` writes a folder there"),
    BadInput("export", "--out where this user cannot write (/sys)",
             r"--out /sys/eyas-out: cannot write in /sys \(.+\)\. "
             r"Choose a --out on a disk and folder this user can write"),
    BadInput("eval", "--draft does not exist",
             r"--draft .*nope does not exist: give the folder `eyas train` wrote"),
    BadInput("eval", "--chain is not numbers",
             r"--chain must be comma-separated integers like 3,5,7; got 'a,b'"),
    BadInput("eval", "--tree is malformed",
             r"--tree: "),
    BadInput("eval", "--backend vllm beside a Kimi config without media_placeholder_token_id",
             r"config\.json has no media_placeholder_token_id, which vLLM reads to serve a draft"),
    BadInput("eval", "--temperature -1",
             r"--temperature must be >= 0"),
    BadInput("eval", "--out is a folder eyas did not write",
             r"--out .*foreign is a folder that `eyas eval` did not write "
             r"\(it holds notes\.txt.*Choose a new or empty folder"),
    BadInput("eval", "--out is a file",
             r"--out .*afile is a file, not a folder: `eyas eval` writes a folder there"),
    BadInput("eval", "--out where this user cannot write (/sys)",
             r"--out /sys/eyas-out: cannot write in /sys \(.+\)\. "
             r"Choose a --out on a disk and folder this user can write"),
    BadInput("eval", "another process writes the same --out",
             r"is being written by another eyas process \(`eyas eval`, pid \d+ on .*pick another --out"),
    BadInput("run", "text where a number belongs",
             r"train\.lr = 'fast': expected a number"),
    BadInput("run", "a number where text belongs",
             r"eval\.prompts = 5: expected text"),
    BadInput("run", "text where a list belongs",
             r"prepare\.inputs = 'dummy': expected a list of text"),
    BadInput("run", "unknown key",
             r"unknown option\(s\) \['lerning_rate'\]; valid: "),
    BadInput("run", "invalid YAML",
             r"bad\.yaml:5: not valid YAML"),
    BadInput("run", "config file does not exist",
             r"cannot read config .*nope\.yaml"),
    BadInput("run", "workdir is a folder eyas did not write",
             r"workdir .*foreign is a folder that `eyas run` did not write "
             r"\(it holds notes\.txt.*Choose a new or empty folder"),
    BadInput("run", "workdir is a file",
             r"workdir .*afile is a file, not a folder: `eyas run` writes a folder there"),
    BadInput("run", "workdir where this user cannot write (/sys)",
             r"workdir /sys/eyas-out: cannot write in /sys \(.+\)\. "
             r"Choose a workdir on a disk and folder this user can write"),
    BadInput("bundle", "--out is a folder eyas did not write",
             r"--out .*foreign is a folder that `eyas bundle` did not write "
             r"\(it holds notes\.txt.*Choose a new or empty folder"),
    BadInput("bundle", "--out is a file",
             r"--out .*afile is a file, not a folder: `eyas bundle` writes a folder there"),
    BadInput("bundle", "--out where this user cannot write (/sys)",
             r"--out /sys/eyas-out: cannot write in /sys \(.+\)\. "
             r"Choose a --out on a disk and folder this user can write"),
]

NOT_HANDLED = [
    ("all", "power loss (not a kill)", "outputs are renamed into place after an fsync of each file, but store shards "
     "are renamed without one (docs/architecture.md): after a power cut, `eyas extract --out STORE --verify` or "
     "`eyas train --verify-store` finds a damaged shard; nothing repairs it but re-extracting"),
    ("all", "flipped bytes without --verify-store", "header and size checks cannot see them: a store whose data "
     "bytes rotted trains silently unless its sha256 is checked (`--verify-store`, about 1.5 s per GiB)"),
    ("regenerate, eval", "kills with vLLM generating or decoding", "not run here (no GPU, and vLLM's own workers "
     "hold state the kill does not reach); the resume logic is the same PartialLog"),
    ("train", "kills under torchrun (DDP/FSDP)", "not run here; checkpoints are written by rank 0 only, through the "
     "same atomic folder rename"),
]


@dataclass
class Outcomes:
    """What the tests saw, keyed like the table's rows; filled as the tests run."""

    kills: dict[str, list[str]] = field(default_factory=dict)  # stage -> "event 0.42: identical" ...
    bad: dict[tuple[str, str], str] = field(default_factory=dict)  # (stage, kind) -> "clear error (exit 2)"

    def complete(self) -> bool:
        return set(self.kills) == set(STAGES) and set(self.bad) == {(b.stage, b.kind) for b in BAD_INPUTS}


def render(outcomes: Outcomes) -> str:
    """docs/reliability.md: per stage, the faults injected and survived, the bad inputs tried and how each
    ended, and what is not handled."""
    lines = ["# Reliability: faults injected and bad inputs tried, per stage", "",
             "Generated by `tests/test_reliability.py` from the cases it runs (`EYAS_WRITE_RELIABILITY=1 pytest "
             "tests/test_reliability.py` rewrites it; the test fails when this file and the cases disagree). Do not "
             "edit by hand.", "",
             "**Faults.** Each stage runs as `python -m eyas.cli STAGE ...` on a tiny random Llama and is killed with "
             "SIGKILL at seeded points: *event x* = just before its N-th change to its output folder (N = x times the "
             "changes an uninterrupted run makes), *time x* = x of the way through an uninterrupted run's writing. "
             "Then the same command runs again and its output is compared with an uninterrupted run's, and no "
             "temporary or partial file may be left.", "",
             "| stage | kills (seeded) | survived: rerun ends identical | compared byte for byte | compared without "
             "wall-clock fields |", "| --- | --- | --- | --- | --- |"]
    for stage in STAGES:
        points = kill_points(stage)
        seen = outcomes.kills.get(stage, [])
        survived = sum(1 for s in seen if s.endswith(": identical"))
        result = f"{survived} of {len(points)}" if seen else "not run"
        r = RERUNS[stage]
        lines.append(f"| `{stage}` | {', '.join(map(str, points))} | {result} | {r.bitwise} | {r.bounded or '-'} |")
    lines += ["", "**Bad inputs.** Each must end in one `eyas: error:` message (what, where, what to do), exit code "
              "2, no traceback.", "", "| stage | bad input | how it ends |", "| --- | --- | --- |"]
    for b in BAD_INPUTS:
        lines.append(f"| `{b.stage}` | {b.kind} | {outcomes.bad.get((b.stage, b.kind), 'not run')} |")
    lines += ["", "**Not handled, or not tested here.**", "", "| stage | case | why |", "| --- | --- | --- |"]
    lines += [f"| {stage} | {case} | {why} |" for stage, case, why in NOT_HANDLED]
    return "\n".join(lines) + "\n"
