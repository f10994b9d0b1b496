"""Measure a draft: acceptance length (tau) and real speedup, for chains and EAGLE-2 trees, in one command.

The target and the draft decode every prompt with KV caches (speculative decoding, greedy or
sampled with lossless rejection sampling); the target alone decodes the same prompts in the same
run, for the speedup and, at temperature 0, to check the output is token-identical. Writes
report.json, report.md and PNG plots (acceptance by position, tau by prompt set, tau against K)
to --out; --compare overlays other reports. Example:

    eyas eval --draft runs/smollm2/draft --prompts mtbench --chain 3,5,7 --tree 60:7:10 --out runs/smollm2/eval
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from eyas.utils.io import EyasError, atomic_path, atomic_write_json, fingerprint_path, read_json, sha256_json

PARTIAL_SUFFIX = ".partial.jsonl"


def parse_chain(text: str | None) -> list[int]:
    if text is None or text.strip().lower() in ("", "none", "0"):
        return []
    try:
        ks = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as e:
        raise EyasError(f"--chain must be comma-separated integers like 3,5,7; got {text!r}") from e
    if any(k < 1 for k in ks):
        raise EyasError(f"--chain lengths must be >= 1; got {text!r}")
    return ks


def parse_trees(text: str | None) -> list[Any]:
    from eyas.eval.spec_decode import TreeSpec

    if text is None or text.strip().lower() in ("", "none"):
        return []
    try:
        return [TreeSpec.parse(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise EyasError(f"--tree: {e}") from e


def load_draft(draft: str, target_path: str, target_model: Any, device: Any, dtype: Any) -> Any:
    """A draft folder in any layout eyas imports, or `random` (an untrained draft: the 'before training' mark)."""
    import torch

    from eyas.engines.base import default_aux_layer_ids
    from eyas.model.config import DraftConfig
    from eyas.model.draft import Eagle3Draft
    from eyas.model.vocab import build_draft_vocab

    if draft == "random":
        cfg = target_model.config
        n = (cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg).num_hidden_layers
        dcfg = DraftConfig.from_target_config(cfg, default_aux_layer_ids(n), target=target_path)
        model = Eagle3Draft(dcfg)
        model.load_target_embedding(target_model.get_input_embeddings().weight.detach().float().cpu())
        model.set_vocab(*build_draft_vocab(torch.zeros(dcfg.vocab_size, dtype=torch.long), dcfg.draft_vocab_size))
        return model.to(device=device, dtype=dtype)
    path = Path(draft)
    if not path.is_dir():
        raise EyasError(f"--draft {draft}: not a folder. Give a draft checkpoint folder (config.json + "
                        "model.safetensors, from `eyas train` or any EAGLE-3 layout) or `random`.")
    try:
        from eyas.export.formats import import_draft
    except ImportError:
        model = Eagle3Draft.from_pretrained(path)
    else:
        model = import_draft(path, target=target_path)
    return model.to(device=device, dtype=dtype)


def run_eval(draft: str, model: str = "smollm2", prompts: str = "mtbench", chain: str = "3,5,7", tree: str = "60:7:10",
             temperature: float = 0.0, top_p: float = 1.0, max_new_tokens: int = 256, max_prompts: int | None = None,
             max_turns: int = 2, out: str | Path = "eval", engine: str = "hf", device: str = "auto", dtype: str = "auto",
             seed: int = 0, compare: list[str] | None = None, label: str | None = None, baseline: bool = True,
             force: bool = False, log=print) -> Path:
    """`eyas eval` as a function: returns the output folder (reused when up to date)."""

    from eyas.assets import resolve_model
    from eyas.eval.prompts import load_prompt_sets
    from eyas.eval.report import load_report, markdown_summary, write_report

    if engine not in ("hf", "vllm"):
        raise EyasError(f"--engine {engine!r}: choose hf or vllm")
    if temperature < 0 or not 0 < top_p <= 1:
        raise EyasError("--temperature must be >= 0 and --top-p in (0, 1]")
    chains, trees = parse_chain(chain), parse_trees(tree)
    if not chains and not trees:
        raise EyasError("nothing to measure: give --chain and/or --tree")
    if draft != "random" and not Path(draft).exists():
        raise EyasError(f"--draft {draft} does not exist: give the folder `eyas train` wrote (OUT/draft), an "
                        "exported draft folder, or `random` for an untrained one")
    out = Path(out)
    target_path = resolve_model(model)
    compared = [(_compare_label(p), load_report(p)) for p in (compare or [])]
    options = {"draft": draft if draft == "random" else fingerprint_path(draft), "model": target_path,
               "prompts": prompts, "prompt_files": _prompt_fingerprints(prompts),
               "chain": chains, "tree": [t.name for t in trees], "temperature": temperature, "top_p": top_p,
               "max_new_tokens": max_new_tokens, "max_prompts": max_prompts, "max_turns": max_turns, "engine": engine,
               "device": device, "dtype": dtype, "seed": seed, "baseline": baseline, "format": "eyas.eval/1"}
    options_sha256 = sha256_json(options)
    manifest = out / "manifest.json"
    if not force and manifest.is_file() and (out / "report.json").is_file():
        try:
            if read_json(manifest).get("options_sha256") == options_sha256:
                log(f"{out} is up to date (same draft, prompts and options); --force reruns it")
                if compared or label:  # only the presentation changed: redraw from the stored results
                    previous = read_json(out / "report.json")
                    write_report(load_report(out), out, label=label or previous.get("label", "this run"),
                                 compare=compared)
                    log(f"redrew {out}/report.md and plots" + (f" against {len(compared)} other run(s)" if compared else ""))
                return out
        except (OSError, ValueError):
            pass

    from eyas.utils.devices import resolve_device, resolve_dtype

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    sets = load_prompt_sets(prompts, max_prompts, max_turns)
    label = label or (Path(draft).name if draft != "random" else "untrained")
    if engine == "vllm":
        from eyas.eval.vllm_engine import evaluate_with_vllm

        result = evaluate_with_vllm(target_path, draft, sets, chains, temperature, top_p, max_new_tokens, seed, log)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from eyas.eval.runner import evaluate_draft

        tokenizer = AutoTokenizer.from_pretrained(target_path)
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dt, attn_implementation="sdpa").to(dev).eval()
        draft_model = load_draft(draft, target_path, target, dev, dt)
        partial = out.with_name(out.name + PARTIAL_SUFFIX)
        done = _read_partial(partial, options_sha256)
        if done:
            log(f"resuming: {len(done)} generations already measured in {partial}")
        with _PartialWriter(partial, options_sha256, fresh=not done) as sink:
            result = evaluate_draft(target, tokenizer, draft_model, sets, chain=chains, tree=trees,
                                    temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
                                    baseline=baseline, on_record=sink.write, done=done)
        del target
    result.meta.update({"draft": draft, "target": target_path, "prompts": prompts})
    with atomic_path(out) as tmp:
        write_report(result, tmp, label=label, compare=compared)
        atomic_write_json(tmp / "manifest.json", {"format": "eyas.eval/1", "options": options,
                                                  "options_sha256": options_sha256})
    if engine == "hf":
        out.with_name(out.name + PARTIAL_SUFFIX).unlink(missing_ok=True)
    log(markdown_summary(result, label, compared))
    log(f"wrote {out}/report.json, report.md and plots")
    return out


def _prompt_fingerprints(prompts: str) -> dict[str, str]:
    out = {}
    for part in prompts.split(","):
        path = Path(part.split("=", 1)[-1].strip()).expanduser()
        if part.strip() and path.exists():
            out[part.strip()] = fingerprint_path(path)
    return out


def _compare_label(path: str) -> str:
    p = Path(path)
    try:
        data = read_json(p / "report.json" if p.is_dir() else p)
        if data.get("label"):
            return str(data["label"])
    except (OSError, ValueError):
        pass
    return (p if p.is_dir() else p.parent).name or str(p)


def _read_partial(path: Path, options_sha256: str) -> dict[tuple, dict[str, Any]]:
    """Records of an interrupted run with the same options, keyed by (set, item, turn, method)."""
    if not path.is_file():
        return {}
    done: dict[tuple, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        header = f.readline()
        try:
            if json.loads(header).get("options_sha256") != options_sha256:
                return {}
        except json.JSONDecodeError:
            return {}
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut by a crash: everything before it is good
            done[(rec["set"], rec["item"], rec["turn"], rec["method"])] = rec
    return done


class _PartialWriter:
    """Appends each finished generation to a JSONL next to the output, so a killed run resumes."""

    def __init__(self, path: Path, options_sha256: str, fresh: bool) -> None:
        self.path, self.sha, self.fresh = path, options_sha256, fresh

    def __enter__(self) -> _PartialWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "w" if self.fresh else "a", encoding="utf-8")
        if self.fresh:
            self.f.write(json.dumps({"options_sha256": self.sha}) + "\n")
        return self

    def write(self, rec: dict[str, Any]) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def __exit__(self, *exc: Any) -> None:
        self.f.close()


def cli(
    draft: str = typer.Option(..., "--draft", help="Draft checkpoint folder (eyas, vLLM, speculators, SpecForge or "
                              "EAGLE layout; also a training checkpoint OUT/train_state/step-N while the run goes "
                              "on), or `random` for an untrained draft."),
    model: str = typer.Option("smollm2", "--model", help="Target: `smollm2` (embedded default), a local folder or an "
                              "HF id. Default: smollm2."),
    prompts: str = typer.Option("mtbench", "--prompts", help="Comma-separated prompt sets: mtbench (80 questions, both "
                                "turns), humaneval, sharegpt, dummy, a chat file `prepare` reads, or a prepared dataset "
                                "folder (its last samples); NAME=PATH names a file's set, e.g. mtbench=question.jsonl. "
                                "Default: mtbench."),
    chain: str = typer.Option("3,5,7", "--chain", help="Chain lengths K to measure, comma-separated; `none` for no "
                              "chain. Default: 3,5,7."),
    tree: str = typer.Option("60:7:10", "--tree", help="EAGLE-2 dynamic trees TOTAL:DEPTH:TOPK, comma-separated: TOTAL "
                             "draft tokens verified in one target forward (plus the root), DEPTH draft steps (the "
                             "longest path), TOPK children per expanded node; `none` for no tree. Default: 60:7:10."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples with lossless rejection "
                                      "sampling. Default: 0."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling for temperature > 0. Default: 1.0."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="New tokens per answer. Default: 256."),
    max_prompts: int = typer.Option(None, "--max-prompts", help="Prompts per set (conversations; MT-Bench has 80). "
                                    "Default: all (80 for files and prepared datasets)."),
    max_turns: int = typer.Option(2, "--max-turns", help="User turns per conversation. Default: 2."),
    out: Path = typer.Option(Path("eval"), "--out", help="Output folder for report.json, report.md and plots. "
                             "Default: ./eval."),
    engine: str = typer.Option("hf", "--engine", help="hf (transformers, tree + chain) or vllm (chains, through "
                               "vLLM's own EAGLE-3 decoding). Default: hf."),
    device: str = typer.Option("auto", "--device", help="auto (cuda when present), cuda, cuda:1, cpu. Default: auto."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32. "
                              "Default: auto."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed. Default: 0."),
    compare: list[str] = typer.Option(None, "--compare", help="Another run's report.json (or folder) to overlay in "
                                      "the tables and plots; repeatable."),
    label: str = typer.Option(None, "--label", help="Name of this run in reports. Default: the draft folder's name."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline", help="Also decode with the target alone (speedup "
                                  "and the greedy identity check). Default: on."),
    force: bool = typer.Option(False, "--force", help="Rerun even when --out is up to date. Default: off."),
) -> None:
    run_eval(draft, model, prompts, chain, tree, temperature, top_p, max_new_tokens, max_prompts, max_turns, out,
             engine, device, dtype, seed, compare, label, baseline, force, log=typer.echo)
