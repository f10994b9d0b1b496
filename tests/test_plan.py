"""`eyas plan` (estimates from configs and measured rates, no weights) and `eyas run` starting the
processes a config asks for (torchrun, or a refusal naming the command before any stage runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from eyas.model.family_facts import FAMILIES
from eyas.recipes.run import build_stages, load_config, run_pipeline, stage_keys
from eyas.utils.io import EyasError, atomic_write_json, read_json

CONFIGS = Path(__file__).parent.parent / "configs"


def plan_text(path: Path, *args: str) -> str:
    from eyas.cli import app

    out = CliRunner().invoke(app, ["plan", str(path), *args])
    assert out.exit_code == 0, out.output
    return out.output


def write(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_quickstart_plan_matches_its_measured_run(tmp_path):
    """docs/benchmarks.md timed the quickstart on this 2-core CPU: a 272 MiB store, 8 min 53 s in all."""
    cfg = {**yaml.safe_load((CONFIGS / "smollm2-quickstart.yaml").read_text()), "workdir": str(tmp_path / "w")}
    text = plan_text(write(tmp_path, cfg), "--card", "cpu")
    store = next(line for line in text.splitlines() if line.strip().startswith("Disk:") and "shard-" in line
                 and "B/token" in line)
    assert "target_head.safetensors 108.0 MiB" in store  # the head counts: 2 x 49,152 x 576 bf16
    shards = float(store.split("bfloat16) ")[1].split(" MiB")[0])
    assert 250 < shards < 300, store
    total = text.splitlines()[-1]
    minutes = float(total.split("Time ")[1].split(" min")[0])
    assert 6 <= minutes <= 20, total


def test_figures_say_where_they_come_from_and_what_does_not_fit(tmp_path):
    text = plan_text(CONFIGS / "kimi-k2.5.yaml", "--card", "H200")
    assert "measured: prepare" in text and "extrapolated (x" in text and "[docs/benchmarks.md" in text
    assert "8 processes under torchrun" in text and "--nproc-per-node 8 -m eyas.cli train" in text
    assert "! more than one" not in text  # every stage spreads the 1T target: extract and eval at tp 8
    one_card = yaml.safe_load((CONFIGS / "kimi-k2.5.yaml").read_text())
    one_card["eval"] = {**one_card["eval"], "engine": "hf", "tp": 1}
    one_card["workdir"] = str(tmp_path / "w")
    text = plan_text(write(tmp_path, one_card), "--card", "H200")
    assert "! more than one H200's 141 GiB" in text.split("eval:")[1]  # transformers' eval holds it on one card
    b200 = plan_text(CONFIGS / "qwen3-8b.yaml", "--card", "B200")
    assert "measured:" not in b200.split("extract:")[1].split("train")[0]  # no B200 row: scaled by compute


def test_a_stage_over_the_share_of_the_card_vllm_fills_is_flagged():
    """Kimi's eval at tp 8 holds 73.6 GiB a rank: under an H100's 80 GiB, over the 90% vLLM fills by default."""
    h100 = plan_text(CONFIGS / "kimi-k2.5.yaml", "--card", "H100")
    flagged = [line for line in h100.splitlines() if line.startswith("  ! ")]
    assert flagged == ["  ! more than the 90% of one H100's 80 GiB (72.0 GiB) that vLLM (its default "
                       "gpu_memory_utilization) fills: it would fail to start. Spread it over more GPUs (tp) or use "
                       "a larger card"]
    assert h100.index(flagged[0]) > h100.index("\neval:")  # the eval's line (extract's 69.3 GiB fits)
    assert "! more than" not in plan_text(CONFIGS / "kimi-k2.5.yaml", "--card", "H200")


def test_the_kimi_docs_totals_are_the_plans():
    """docs/kimi-k2.5.md's table and its total disk are what `eyas plan` prints for the config as shipped."""
    import re

    doc = (CONFIGS.parent / "docs" / "kimi-k2.5.md").read_text()
    text = plan_text(CONFIGS / "kimi-k2.5.yaml", "--card", "H200")
    total = float(re.search(r"Total for the \d stage\(s\) that will run: Disk ([\d.]+) GiB", text).group(1))
    assert f"Total disk: {total:.0f} GiB" in doc
    table = [float(x) for x in re.findall(r"^\| (?:extract|train|export) .*?\| ([\d.]+) GiB", doc, re.M)]
    assert len(table) == 3 and abs(sum(table) - total) <= 1.5, (table, total)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plan_and_dry_run_take_every_family_that_run_takes(tmp_path, family):
    """A DFlash or P-EAGLE config leaves the mask token to train (-1: chosen from the data); `eyas plan` and
    `eyas run --dry-run` refused it while `eyas run` took it."""
    from eyas.cli import app

    cfg = {**yaml.safe_load((CONFIGS / "smollm2-quickstart.yaml").read_text()), "workdir": str(tmp_path / "w")}
    cfg["train"] = {**cfg["train"], "family": family}
    cfg["eval"] = {k: v for k, v in cfg["eval"].items() if k != "tree"}  # the default: trees where the family has them
    path = write(tmp_path, cfg)
    assert "train:" in plan_text(path, "--card", "cpu")
    dry = CliRunner().invoke(app, ["run", str(path), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "train:" in dry.output and not (tmp_path / "w").exists()  # printed, nothing run


def test_the_plan_says_what_is_up_to_date_and_what_resumes(tmp_path):
    path = write(tmp_path, {"target": "smollm2", "workdir": str(tmp_path / "w"),
                            "prepare": {"inputs": ["dummy"], "max_samples": 24, "max_length": 96}})
    cfg = load_config(path)
    stages = build_stages(cfg, path)
    prepare = stages[0]
    for out in prepare.outputs:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out, {"num_samples": 24, "num_tokens": 1848})
    atomic_write_json(tmp_path / "w" / "run_state.json", {"prepare": {"options_sha256": stage_keys(stages)[0]}})
    (tmp_path / "w" / "store.partial").mkdir()
    text = plan_text(path, "--card", "cpu")
    assert "prepare: up to date: skipped" in text and "Samples: 24  Tokens: 1,848" in text
    assert "extract: will resume (0 shard(s) already in" in text and "train: will run" in text


def test_store_file_bytes_counts_every_file_extract_writes(tmp_path):
    """One formula for the store's files (extract's disk check and `eyas plan`): a real store's files add up
    to it, headers rounded up to a few KiB."""
    from _train_utils import make_store

    from eyas.store.writer import ShardSpec, StoreMeta, store_file_bytes

    _, _, store = make_store(tmp_path)
    m = read_json(store / "manifest.json")
    meta = StoreMeta(**{k: m[k] for k in ("target", "target_config_sha256", "num_layers", "aux_layer_ids",
                                          "hidden_size", "vocab_size", "dtype", "prepared", "prepared_sha256",
                                          "norm_eps", "options_sha256")})
    shards = [ShardSpec(i, s["first_sample"], s["num_samples"], s["num_tokens"]) for i, s in enumerate(m["shards"])]
    planned = store_file_bytes(meta, shards)
    real = {f.name: f.stat().st_size for f in store.iterdir()}
    assert set(planned) == set(real)
    for name, size in real.items():
        assert size <= planned[name] <= size + 4096 + 256 * len(shards), name


def test_a_config_that_asks_for_processes_gets_torchrun_or_a_refusal_before_anything_runs(tmp_path, monkeypatch):
    base = {"target": "smollm2", "workdir": str(tmp_path / "w"), "prepare": {"inputs": ["dummy"]}}
    path = write(tmp_path, {**base, "train": {"nproc": 2, "device": "cpu", "lr": 0.001}})
    (train,) = [s for s in build_stages(load_config(path), path) if s.name == "train"]
    assert train.nproc == 2 and train.commands[0][1:7] == ["-m", "torch.distributed.run", "--standalone",
                                                           "--nproc-per-node", "2", "-m"]
    assert train.commands[0][7:] == ["eyas.cli", "train", "--out", str(tmp_path / "w" / "train"), "--store",
                                     str(tmp_path / "w" / "store"), "--model", "smollm2", "--resume", "--lr",
                                     "0.001", "--device", "cpu"]
    monkeypatch.setattr("eyas.recipes.launch.visible_gpus", lambda: 0)
    for asks, why in (({"gpus": 4}, "extract: gpus: 4"), ({"train": {"fsdp": True}}, "train: train.fsdp: true")):
        path = write(tmp_path, {**base, **asks})
        with pytest.raises(EyasError, match=rf"{why} asks for \d processes, which `eyas run` cannot start "
                                            r"here: .*\n  .*torch.distributed.run --standalone"):
            run_pipeline(load_config(path), path)
        assert not (tmp_path / "w" / "prepared").exists()  # refused before the first stage
    monkeypatch.setattr("eyas.recipes.launch.visible_gpus", lambda: 1)  # FSDP in one process shards nothing
    path = write(tmp_path, {**base, "train": {"fsdp": True}})
    with pytest.raises(EyasError, match=r"shards over several processes and this machine has 1 GPU\(s\) for them"):
        build_stages(load_config(path), path)
    path = write(tmp_path, {**base, "eval": {"nproc": 2}})
    with pytest.raises(EyasError, match="eval.nproc: only extract and train run in several processes"):
        build_stages(load_config(path), path)


def test_options_go_to_torchrun_as_flags_that_build_them_again():
    from eyas.recipes.extract import ExtractOptions
    from eyas.recipes.train import TrainOptions
    from eyas.utils.schema import cli_command, from_mapping, to_cli_args

    for cls, values in ((TrainOptions, {"out": "o", "prepared": "p", "online": True, "model": "m", "engine": "vllm",
                                        "tp": 2, "aux_layer_ids": "1,2", "betas": [0.8, 0.9], "compile": False,
                                        "target_options": {"gpu_memory_utilization": 0.5}, "lr": 1e-3}),
                        (ExtractOptions, {"out": "s", "prepared": "p", "fp8": True, "shard_mb": 64.0})):
        opts = from_mapping(cls, values, "test")
        got = []
        import typer

        app = typer.Typer()
        app.command()(cli_command(cls, got.append))
        out = CliRunner().invoke(app, to_cli_args(opts))
        assert out.exit_code == 0, out.output
        assert got == [opts]


def test_eyas_run_trains_in_two_gloo_processes(tmp_path, smollm2_dir):
    """`train: {nproc: 2}`: `eyas run` starts the stage under torchrun (gloo on this CPU) and goes on."""
    cfg = {"target": "smollm2", "workdir": str(tmp_path / "run"),
           "prepare": {"inputs": ["dummy"], "max_samples": 24, "max_length": 96},
           "extract": {"dtype": "float32"},
           "train": {"nproc": 2, "device": "cpu", "ttt_steps": 2, "draft_vocab_size": 2000, "max_steps": 2,
                     "token_budget": 512, "num_workers": 0, "lr": 0.001},
           "eval": {"prompts": "mtbench", "max_prompts": 1, "max_turns": 1, "max_new_tokens": 4, "chain": "2",
                    "tree": "none"}}
    path = write(tmp_path, cfg)
    run_pipeline(load_config(path), path)
    manifest = read_json(tmp_path / "run" / "train" / "manifest.json")
    assert manifest["options"]["world"] == 2 and manifest["complete"] and manifest["steps"] == 2


def test_eval_batch_sizes_add_their_passes_to_the_plan(tmp_path):
    """Each batch size above 1 decodes every prompt again: the plan counts it, and says so."""
    def eval_block(batch_sizes):
        cfg = {"target": "smollm2", "workdir": str(tmp_path / "w"),
               "eval": {"backend": "vllm", "batch_sizes": batch_sizes, "chain": "3", "tree": "none"}}
        return plan_text(write(tmp_path, cfg), "--card", "H100").split("eval:")[1]

    def tokens(block):
        return int(block.split("Tokens: ")[1].split()[0].replace(",", ""))

    one, three = eval_block([1]), eval_block([1, 4, 16])
    assert "again at batch size 4, 16" in three and "again at batch size" not in one
    assert tokens(three) == 3 * tokens(one) and one.split("Time: ")[1] != three.split("Time: ")[1]
