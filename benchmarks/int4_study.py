"""Drafting for an INT4 target: does a draft need states from the quantized target, and what does it buy?

SmolLM2 (--model, bf16) is quantized W4A16 with compressed-tensors (`pack-quantized`: int4 weights, symmetric,
groups of --group-size, bf16 scales) on every decoder linear, attention included; the embedding and lm_head
stay bf16. Then 2 x 2, on the same prepared data and the same training wall-clock (`eyas train --online
--max-time`, start-up included): a draft trained on the states of the bf16 or of the INT4 target, each verified
by the bf16 or the INT4 target in the same `eyas eval` options (temperature 0, chain 7 and one EAGLE-2 tree,
the target alone beside it for the speedup). One table: tau and speedup per cell.

    python benchmarks/int4_study.py --out OUT --budget-s 900 --max-prompts 10
    python benchmarks/int4_study.py --out OUT --eval-args "--engine vllm"   # verified by vLLM's INT4 kernels

A killed run resumes: the quantized folder, trainings and evals are kept under OUT.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyas.assets import resolve_model

LINEAR = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
SOURCES = ("bf16", "int4")  # the target whose states train the draft, and the one that verifies
CELLS = "bf16>bf16,bf16>int4,int4>bf16,int4>int4"  # STATES>VERIFIER


def eyas(*args: str) -> None:
    print("+ eyas " + shlex.join(args), flush=True)
    subprocess.run([sys.executable, "-m", "eyas.cli", *args], check=True)


def quantize_w4a16(src: Path, out: Path, group: int) -> Path:
    """`src` (a transformers folder, one model.safetensors) with every decoder linear packed to int4 -> `out`."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    if (out / "config.json").is_file():
        return out
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group,
                            dynamic=False, observer="minmax")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    packed = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not LINEAR.search(name):
            packed[name] = w.to(torch.bfloat16) if w.is_floating_point() else w
            continue
        if w.shape[1] % group:
            raise SystemExit(f"{name}: {w.shape[1]} input channels are not a multiple of --group-size {group}")
        groups = w.float().reshape(w.shape[0], -1, group)
        scale = calculate_qparams(groups.amin(-1), groups.amax(-1), args)[0].to(torch.bfloat16)
        compressed = PackedQuantizationCompressor.compress({"weight": w.to(torch.bfloat16), "weight_scale": scale},
                                                           scheme)
        packed.update({name[: -len("weight")] + k: t.contiguous() for k, t in compressed.items()})
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(src, partial, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json"))
    save_file(packed, str(partial / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((partial / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(mode="json"),
                                      "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None}
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    partial.rename(out)
    return out


def train(args: argparse.Namespace, source: str, target: str) -> Path:
    """The draft trained on `target`'s states for the budget, unless done."""
    out = args.out / f"states-{source}"
    if not (out / "draft" / "config.json").is_file():
        eyas("train", "--online", "--prepared", str(args.out / "prepared"), "--model", target, "--out", str(out),
             "--max-time", f"{args.budget_s:g}", "--epochs", str(args.epochs), "--save-every", "0",
             *shlex.split(args.train_args))
    return out / "draft"


def evaluate(args: argparse.Namespace, draft: Path, verifier: str, target: str) -> dict[str, dict]:
    """tau and speedup of chain-7 and the tree, `draft` verified by `target`."""
    out = draft.parent / f"eval-verified-{verifier}"
    if not (out / "report.json").is_file():
        eyas("eval", "--draft", str(draft), "--model", target, "--prompts", args.prompts, "--max-prompts",
             str(args.max_prompts), "--chain", "7", "--tree", args.tree, "--max-new-tokens", str(args.max_new_tokens),
             "--out", str(out), *shlex.split(args.eval_args))
    results = json.loads((out / "report.json").read_text())["results"]["all"]
    return {m: results[m] for m in ("chain-7", f"tree-{args.tree}")}


def print_table(args: argparse.Namespace, cells: dict[tuple[str, str], dict[str, dict]]) -> None:
    print(f"\n{args.model} bf16 and W4A16 (groups of {args.group_size}, attention included); {args.budget_s:g}s of "
          f"training per draft; {args.prompts}: first {args.max_prompts}, temperature 0, {args.max_new_tokens} new "
          "tokens; speedup against the verifying target alone")
    print("| states from | verified by | method | tau | speedup |")
    print("| --- | --- | --- | --- | --- |")
    for (source, verifier), methods in cells.items():
        for name, r in methods.items():
            speedup = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"
            print(f"| {source} | {verifier} | {name} | {r['tau']:.2f} | {speedup} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2", help="the bf16 target")
    ap.add_argument("--group-size", type=int, default=32, help="int4 group size (SmolLM2's 576 channels: 32 or 64)")
    ap.add_argument("--data", default="sharegpt", help="chat data for eyas prepare")
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--budget-s", type=float, default=900, help="training wall-clock per draft, seconds")
    ap.add_argument("--epochs", type=int, default=1, help="each schedule's length; a run ends there or at the budget")
    ap.add_argument("--train-args", default="", help="more eyas train options for both drafts")
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--max-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--tree", default="60:7:10")
    ap.add_argument("--eval-args", default="", help="more eyas eval options for every cell")
    ap.add_argument("--cells", default=CELLS, help="STATES>VERIFIER pairs to measure (all four by default)")
    args = ap.parse_args()
    cells_asked = [tuple(c.split(">")) for c in args.cells.split(",")]
    if any(len(c) != 2 or not set(c) <= set(SOURCES) for c in cells_asked):
        ap.error(f"--cells {args.cells}: STATES>VERIFIER pairs of {' and '.join(SOURCES)}, e.g. {CELLS}")
    bf16 = resolve_model(args.model)
    targets = {"bf16": bf16, "int4": str(quantize_w4a16(Path(bf16), args.out / "int4-target", args.group_size))}
    if not (args.out / "prepared" / "manifest.json").is_file():
        eyas("prepare", args.data, "--model", bf16, "--out", str(args.out / "prepared"), "--max-samples",
             str(args.samples), "--max-length", str(args.max_length))
    cells = {}
    for source, verifier in cells_asked:
        draft = train(args, source, targets[source])
        cells[(source, verifier)] = evaluate(args, draft, verifier, targets[verifier])
    print_table(args, cells)


if __name__ == "__main__":
    main()
