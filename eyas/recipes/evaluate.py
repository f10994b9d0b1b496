"""Measure a draft: acceptance length (tau) and real speedup, for chains and EAGLE-2 trees, in one command.

The target and the draft decode every prompt with KV caches (speculative decoding, greedy or
sampled with lossless rejection sampling); the target alone decodes the same prompts in the same
run, for the speedup and, at temperature 0, to check the output is token-identical. Writes
report.json, report.md and PNG plots (acceptance by position, tau by prompt set, tau against K)
to --out; --compare overlays other reports. A killed run resumes from OUT.partial.jsonl. Several
--batch-size values sweep chains and trees per batch size and recommend what to serve at --serve-at
(the fastest method, or the target alone), with the vLLM and SGLang commands. Example:

    eyas eval --draft runs/smollm2/draft --prompts mtbench --chain 3,5,7 --tree 60:7:10 --out runs/smollm2/eval
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eyas.assets import TARGET_FORMS
from eyas.utils.io import (
    EyasError,
    atomic_path,
    atomic_write_json,
    check_output,
    fingerprint_path,
    has_manifest,
    read_json,
    sha256_json,
    writer_lock,
)
from eyas.utils.resume import PartialLog, up_to_date
from eyas.utils.schema import cli_command, option

PARTIAL_SUFFIX = ".partial.jsonl"
DEFAULT_TREE = "60:7:10"
FORMAT = "eyas.eval/1"


@dataclass(kw_only=True)
class EvalOptions:
    """`eyas eval`'s options: the command line and the `eval:` section of an `eyas run` config."""

    draft: str = option(help="Draft checkpoint folder (eyas, vLLM, speculators, SpecForge or EAGLE layout; also a "
                        "training checkpoint OUT/train_state/step-N while the run goes on), or `random` for an "
                        "untrained draft.")
    model: str = option("smollm2", help=f"Target: {TARGET_FORMS}.")
    prompts: str = option("mtbench", help="Comma-separated prompt sets: mtbench (80 questions, both turns), "
                          "humaneval, sharegpt, dummy, a chat file `prepare` reads, or a prepared dataset folder (its "
                          "last samples); NAME=PATH names a file's set, e.g. mtbench=question.jsonl.")
    chain: str = option("3,5,7", help="Chain lengths K to measure, comma-separated; `none` for no chain.")
    tree: str = option(DEFAULT_TREE, help="EAGLE-2 dynamic trees TOTAL:DEPTH:TOPK, comma-separated: TOTAL draft tokens "
                       "verified in one target forward (plus the root), DEPTH draft steps (the longest path), TOPK "
                       "children per expanded node; `none` for no tree. The default applies to families that draft "
                       "trees (EAGLE-3); the others are measured on chains.")
    temperature: float = option(0.0, help="0 = greedy; > 0 samples with lossless rejection sampling.")
    top_p: float = option(1.0, help="Nucleus sampling for temperature > 0.")
    max_new_tokens: int = option(256, help="New tokens per answer.")
    max_prompts: int | None = option(None, help="Prompts per set (conversations; MT-Bench has 80).",
                                     show_default="all")
    max_turns: int = option(2, help="User turns per conversation.")
    batch_sizes: list[int] = option(default_factory=lambda: [1], comma=True, flag="--batch-size",
                                    help="Requests decoded together, comma-separated: each batch size measures "
                                    "every method and the target alone on the same prompts, and several give the "
                                    "serving curve (tokens/s and speedup against batch size). engine vllm: "
                                    "requests in flight in vLLM's scheduler; engine hf: prompts decoded together "
                                    "over static KV caches (greedy or sampled).")
    sweep: bool = option(True, help="With several --batch-size (engine hf): at each batch size, also measure the "
                         "chains of 1, 2, 3, 5 and 7 and the trees whose verify tokens fit --verify-budget, and report "
                         "the fastest way to decode at each (the target alone included).")
    verify_budget: int = option(1024, help="--sweep: verify tokens per round shared by the rows: at batch size B a "
                                "candidate's verify tokens per row (K + 1 for a chain, TOTAL + 1 for a tree) must fit "
                                "budget / B. It bounds what is tried; the sweep measures what wins.")
    serve_at: int | None = option(None, help="Requests in flight the recommended serve command is for.",
                                  show_default="the largest batch size measured")
    out: Path = option(Path("eval"), short="-o", help="Output folder for report.json, report.md and plots.")
    engine: Literal["hf", "vllm"] = option("hf", old_name="backend", help="What runs the target and decodes: hf "
                                           "(transformers in this process, chains and trees) or vllm (vLLM's own "
                                           "speculative decoding, chains).")
    tp: int = option(1, help="engine vllm: tensor-parallel GPUs of the target (a target larger than one card).")
    trust_remote_code: bool = option(False, help="engine vllm: let vLLM run the target repository's code.")
    device: str = option("auto", help="auto (cuda when present), cuda, cuda:1, cpu.")
    dtype: str = option("auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32.")
    seed: int = option(0, help="Sampling seed.")
    compare: list[str] = option(default_factory=list, show_default="none",
                                help="Another run's report.json (or folder) to overlay in the tables and plots; "
                                     "repeatable.")
    label: str | None = option(None, help="Name of this run in reports.", show_default="the draft folder's name")
    family: str = option("eagle3", help="--draft random: the family of the untrained draft (a draft folder says "
                         "its own).")
    baseline: bool = option(True, help="Also decode with the target alone (speedup and the greedy identity check).")
    force: bool = option(False, help="Rerun even when --out is up to date.")

    def __post_init__(self) -> None:
        from eyas.eval.serving import MAX_BATCH_SIZE, parse_batch_sizes
        from eyas.model.family_facts import family

        if self.engine not in ("hf", "vllm"):
            raise EyasError(f"--engine {self.engine!r}: choose hf or vllm")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise EyasError("--temperature must be >= 0 and --top-p in (0, 1]")
        if self.max_new_tokens < 1 or self.max_turns < 1 or (self.max_prompts is not None and self.max_prompts < 1):
            raise EyasError("--max-new-tokens, --max-turns and --max-prompts must be >= 1")
        if not parse_chain(self.chain) and not parse_trees(self.tree):
            raise EyasError("nothing to measure: give --chain and/or --tree")
        self.batch_sizes = parse_batch_sizes(self.batch_sizes)
        family(self.family)  # an unknown family is refused here
        if self.verify_budget < 2:
            raise EyasError(f"--verify-budget {self.verify_budget}: a round verifies at least 2 tokens a row (a chain "
                            "of 1); give e.g. 1024")
        if self.serve_at is not None and not 1 <= self.serve_at <= MAX_BATCH_SIZE:
            raise EyasError(f"--serve-at {self.serve_at}: requests in flight, between 1 and {MAX_BATCH_SIZE}")
        if self.tp < 1 or (self.tp > 1 and self.engine != "vllm"):
            raise EyasError(f"--tp {self.tp}: tensor parallelism is vLLM's (--engine vllm); the hf engine runs the "
                            "target on one device")


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
    from eyas.eval.proposer_base import TreeSpec

    if text is None or text.strip().lower() in ("", "none"):
        return []
    try:
        return [TreeSpec.parse(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise EyasError(f"--tree: {e}") from e


def load_draft(draft: str, target_path: str, target_model: Any, device: Any, dtype: Any, family: str = "eagle3"
               ) -> Any:
    """A draft folder in any layout eyas imports, or `random`: an untrained draft of `family` (the 'before
    training' mark), with the target's embedding, and its head where the family reads it frozen."""
    from eyas.model.checkpoints import import_draft

    if draft == "random":
        return random_draft(target_path, target_model, family).to(device=device, dtype=dtype)
    path = Path(draft)
    if not path.is_dir():
        raise EyasError(f"--draft {draft}: not a folder. Give a draft checkpoint folder (config.json + "
                        "model.safetensors, from `eyas train` or any EAGLE-3 layout) or `random`.")
    return import_draft(path, target=target_path).to(device=device, dtype=dtype)


def random_draft(target_path: str, target_model: Any, family: str) -> Any:
    """An untrained draft of `family` for the target: a draft vocabulary of the first ids, the mask token
    (families that have one) the target's pad token, else its last id."""
    import torch

    from eyas.model.aux_layers import default_aux_layer_ids
    from eyas.model.config import DraftConfig, DraftOptions, text_config
    from eyas.model.families import build_draft
    from eyas.model.family_facts import FAMILIES
    from eyas.model.vocab import build_draft_vocab

    text = text_config(target_model.config)
    pad = getattr(text, "pad_token_id", None)
    mask = pad if FAMILIES[family].mask_token and pad is not None else int(text.vocab_size) - 1
    options = DraftOptions(family=family, mask_token_id=mask if FAMILIES[family].mask_token else -1)
    dcfg = DraftConfig.from_target_config(target_model.config, default_aux_layer_ids(int(text.num_hidden_layers)),
                                          target=target_path, options=options)
    model = build_draft(dcfg)
    model.load_target_embedding(target_model.get_input_embeddings().weight.detach().float().cpu())
    model.set_vocab(*build_draft_vocab(torch.zeros(dcfg.vocab_size, dtype=torch.long), dcfg.draft_vocab_size))
    if model.head_from_target:
        head = target_model.get_output_embeddings().weight
        model.init_lm_head_from_target(head, torch.ones(head.shape[1]))
    return model


def run_eval(opts: EvalOptions, log: Any = print) -> Path:
    """`eyas eval` as a function: returns the output folder (reused when up to date). One writer per output
    folder: a second one gets an error naming this one."""
    if opts.draft != "random" and not Path(opts.draft).exists():
        raise EyasError(f"--draft {opts.draft} does not exist: give the folder `eyas train` wrote (OUT/draft), an "
                        "exported draft folder, or `random` for an untrained one")
    out = check_output(opts.out, "eval", lambda p: has_manifest(p / "manifest.json", FORMAT))
    with writer_lock(out, "eval"):
        return _run_eval(opts, out, log)


def _run_eval(opts: EvalOptions, out: Path, log: Any) -> Path:
    from eyas.assets import resolve_model

    target_path = resolve_model(opts.model)
    check_prepared_prompts(opts.prompts, target_path, opts.trust_remote_code)
    compared = [(_compare_label(p), _load_report(p)) for p in opts.compare]
    options = fingerprint(opts, target_path)
    options_sha256 = sha256_json(options)
    if not opts.force and up_to_date(out / "manifest.json", options_sha256, out / "report.json"):
        log(f"{out} is up to date (same draft, prompts and options); --force reruns it")
        out.with_name(out.name + PARTIAL_SUFFIX).unlink(missing_ok=True)  # a run killed just after writing OUT
        if compared or opts.label:  # only the presentation changed: redraw from the stored results
            redraw(out, opts.label, compared, log)
        return out
    label = opts.label or (Path(opts.draft).name if opts.draft != "random" else "untrained")
    partial = PartialLog(out.with_name(out.name + PARTIAL_SUFFIX), options_sha256)
    result = measure(opts, target_path, partial, log)
    finish(result, out, label, compared, {"format": FORMAT, "options": options, "options_sha256": options_sha256}, log)
    partial.remove()
    return out


def check_prepared_prompts(spec: str, target_path: str, trust_remote_code: bool) -> None:
    """Prepared datasets among --prompts must be the target's (tokenizer, vocabulary), before any work."""
    from eyas.data.target_match import check_prepared_matches_target

    for part in (p.split("=", 1)[-1].strip() for p in spec.split(",")):
        manifest = Path(part).expanduser() / "manifest.json"
        if part and manifest.is_file() and str(read_json(manifest).get("format", "")).startswith("eyas.prepared"):
            check_prepared_matches_target(read_json(manifest), part, target_path, trust_remote_code)


def fingerprint(opts: EvalOptions, target_path: str) -> dict[str, Any]:
    """What the results depend on: the draft's and prompt files' content, the target and the settings."""
    return {"draft": opts.draft if opts.draft == "random" else fingerprint_path(opts.draft), "model": target_path,
            "prompts": opts.prompts, "prompt_files": _prompt_fingerprints(opts.prompts),
            "chain": parse_chain(opts.chain), "tree": [t.name for t in parse_trees(opts.tree)],
            "temperature": opts.temperature, "top_p": opts.top_p, "max_new_tokens": opts.max_new_tokens,
            "max_prompts": opts.max_prompts, "max_turns": opts.max_turns, "backend": opts.engine,
            "device": opts.device, "dtype": opts.dtype, "seed": opts.seed, "baseline": opts.baseline,
            "format": FORMAT, **({"batch_sizes": opts.batch_sizes} if opts.batch_sizes != [1] else {}),
            **({"verify_budget": opts.verify_budget} if sweeping(opts) else {}),
            **({"serve_at": opts.serve_at} if opts.serve_at is not None else {})}


def sweeping(opts: EvalOptions) -> bool:
    """Whether the run sweeps chains and trees per batch size (eyas.eval.budget): several batch sizes, engine hf."""
    return opts.sweep and opts.engine == "hf" and len(opts.batch_sizes) > 1


def measure(opts: EvalOptions, target_path: str, partial: PartialLog, log: Any) -> Any:
    """Decode every prompt with each method and the target alone; returns an EvalResult."""
    from eyas.eval.prompts import load_prompt_sets
    from eyas.utils.devices import matmul_precision, resolve_device, resolve_dtype

    sets = load_prompt_sets(opts.prompts, opts.max_prompts, opts.max_turns)
    chains, trees = parse_chain(opts.chain), parse_trees(opts.tree)
    turns = sum(s.num_turns for s in sets)
    if max(opts.batch_sizes) > turns:
        raise EyasError(f"--batch-size {max(opts.batch_sizes)}: the prompts give {turns} requests, too few to keep "
                        f"that many in flight; raise --max-prompts or lower --batch-size")
    if opts.engine == "vllm":
        from eyas.engines.vllm.images import check_config_for_a_draft
        from eyas.eval.vllm_backend import evaluate_with_vllm

        config = Path(target_path) / "config.json"
        if config.is_file():
            check_config_for_a_draft(read_json(config), target_path)

        result = evaluate_with_vllm(target_path, opts.draft, sets, chains, opts.temperature, opts.top_p,
                                    opts.max_new_tokens, opts.seed, log,
                                    {"tensor_parallel_size": opts.tp, "trust_remote_code": opts.trust_remote_code},
                                    batch_sizes=opts.batch_sizes)
    else:
        import torch
        from transformers import AutoTokenizer

        from eyas.engines.hf import load_hf_model
        from eyas.eval.runner import evaluate_draft

        dev = resolve_device(opts.device)
        dt = resolve_dtype(opts.dtype, dev)
        tokenizer = AutoTokenizer.from_pretrained(target_path)
        target = load_hf_model(target_path, dt, dev).eval()  # a multimodal wrapper (Kimi-K2.5) runs its text
        draft_model = load_draft(opts.draft, target_path, target, dev, dt, opts.family)
        trees = trees_for(draft_model.config.family, trees, opts.tree, log)
        done = {(r["set"], r["item"], r["turn"], r["method"]): r for r in partial.records}
        if done:
            log(f"resuming: {len(done)} generations already measured in {partial.path}")
        with partial, matmul_precision(dt):
            result = evaluate_draft(target, tokenizer, draft_model, sets, chain=chains, tree=trees,
                                    temperature=opts.temperature, top_p=opts.top_p,
                                    max_new_tokens=opts.max_new_tokens, seed=opts.seed, baseline=opts.baseline,
                                    on_record=partial.append, done=done, batch_sizes=opts.batch_sizes,
                                    verify_budget=opts.verify_budget if sweeping(opts) else None)
            result.meta["tf32"] = torch.backends.cuda.matmul.allow_tf32  # float32 verified in TF32: not exact
        from eyas.eval.serving import runs_of, serving_rows

        result.serving = result.serving or serving_rows(1, runs_of(result.overall()))
    result.meta.update({"draft": opts.draft, "target": target_path, "prompts": opts.prompts})
    result.recommendation = recommend(result.serving, opts, target_path)
    if result.recommendation is not None:
        result.recommendation["device"] = result.meta.get("gpu") or result.meta.get("device")
    return result


def recommend(rows: list[dict[str, Any]], opts: EvalOptions, target_path: str) -> dict[str, Any] | None:
    """What to serve at --serve-at (eyas.eval.recommend), with the serve commands for the draft folder measured."""
    from eyas.eval.recommend import recommendation
    from eyas.model.config import DraftConfig

    config = Path(opts.draft) / "config.json"
    try:
        cfg = DraftConfig.load(config) if config.is_file() else None
    except EyasError:
        cfg = None  # another layout: the choices still stand, without serve commands
    folder = Path(opts.draft).absolute()
    return recommendation(rows, opts.serve_at, cfg, {"vllm": folder, "sglang": folder}, target_path)


def trees_for(family_name: str, trees: list[Any], asked: str, log: Any) -> list[Any]:
    """The trees to measure with a draft of `family_name`: none for a family that drafts none, unless the user
    asked for some (then a clear error), so a DFlash or DSpark run on the defaults measures its chains."""
    from eyas.model.family_facts import family

    if not trees or family(family_name).trees:
        return trees
    if asked != DEFAULT_TREE:
        raise EyasError(f"--tree {asked}: a {family_name} draft drafts chains only: measure it with --chain and "
                        "--tree none")
    log(f"a {family_name} draft drafts chains only: the default tree is left out")
    return []


def finish(result: Any, out: Path, label: str, compared: list, manifest: dict[str, Any], log: Any) -> None:
    """report.json, report.md, plots and the manifest, written together (atomically)."""
    from eyas.eval.report import markdown_summary, write_report

    with atomic_path(out) as tmp:
        write_report(result, tmp, label=label, compare=compared)
        atomic_write_json(tmp / "manifest.json", manifest)
    log(markdown_summary(result, label, compared))
    log(f"wrote {out}/report.json, report.md and plots")


def redraw(out: Path, label: str | None, compared: list, log: Any) -> None:
    from eyas.eval.report import load_report, write_report

    previous = read_json(out / "report.json")
    write_report(load_report(out), out, label=label or previous.get("label", "this run"), compare=compared)
    log(f"redrew {out}/report.md and plots" + (f" against {len(compared)} other run(s)" if compared else ""))


def _load_report(path: str) -> Any:
    from eyas.eval.report import load_report

    return load_report(path)


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


cli = cli_command(EvalOptions, lambda opts: run_eval(opts, log=_echo))


def _echo(msg: str) -> None:
    import typer

    typer.echo(msg)
