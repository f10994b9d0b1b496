"""Per-stage estimates of a planned `eyas run` (the stages of eyas.recipes.run.build_stages): samples and
tokens, disk (every file a stage writes), memory per rank, time, and whether it will be skipped.

Everything comes from configs, manifests already on disk and eyas.plan.rates; no weights are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from eyas.plan.rates import (
    CARDS,
    DUMMY_MEAN_TOKENS,
    DUMMY_SAMPLES,
    KNOWN_TARGETS,
    MEASURED_SHAPES,
    SHAREGPT_MEAN_TOKENS,
    SHAREGPT_SAMPLES,
    SHAREGPT_TURNS,
    Rate,
    TargetShape,
    mean_tokens,
    rate_for,
)
from eyas.utils.io import EyasError, read_json

SMALL = 4096  # a manifest, a record, a header
JSON_BYTES_PER_TOKEN = 4.9  # ShareGPT's JSON file: 125.5 MB for 25.47M SmolLM2 tokens
REPLY_SHARE = 0.8  # tokens under the loss: 3,703,471 of 4,647,862 of a ShareGPT sample
FILL = 0.97  # packed rows are ~97% full (tests/test_train.py checks > 95%)
TRAIN_START_S = 270  # torch.compile from a cold cache until the first step (209-271 s measured)
ACT_BYTES_PER_TOKEN = 1.32 * 2**20  # draft training peak, 2048 vs 8192 tokens (hidden 4096, TTT 7), per token


VLLM_SHARE = 0.9  # vLLM's default gpu_memory_utilization: the share of each card it may fill


@dataclass
class Estimate:
    """One stage's figures; `notes` say where each came from."""

    name: str
    processes: int = 1
    samples: int = 0
    tokens: float = 0.0
    disk: dict[str, float] = field(default_factory=dict)  # file or folder -> bytes
    memory: dict[str, float] = field(default_factory=dict)  # what -> bytes per rank
    usable: tuple[float, str] = (1.0, "")  # the share of a card the stage may fill, and who caps it there
    seconds: float = 0.0
    status: str = "will run"
    notes: list[str] = field(default_factory=list)


@dataclass
class Target:
    name: str
    shape: TargetShape
    config: Any  # what DraftConfig.from_target_config reads
    source: str


def read_target(name: str, trust_remote_code: bool = False) -> Target:
    """The target's shape from eyas.plan.rates' table of known targets, else its config (a local folder, a
    GGUF file's header or the hub cache): never a download, never a weight."""
    shape = KNOWN_TARGETS.get(name) or KNOWN_TARGETS.get(str(name).lower())
    if shape is not None:
        config = SimpleNamespace(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                                 num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                                 head_dim=shape.head_dim, vocab_size=shape.vocab, num_hidden_layers=shape.layers,
                                 max_position_embeddings=shape.max_positions, model_type="planned")
        return Target(name, shape, config, "its config.json, as eyas.plan.rates keeps it")
    from transformers import AutoConfig

    from eyas.assets import converted_folder, gguf_of, hub_snapshot

    path = Path(name).expanduser()
    gguf = gguf_of(path) if path.exists() else None
    try:
        if gguf is not None:  # its converted folder's config, else its header's: never a weight converted
            done = converted_folder(gguf)
            cfg = AutoConfig.from_pretrained(done) if done else AutoConfig.from_pretrained(gguf.parent,
                                                                                          gguf_file=gguf.name)
        else:
            folder = path if path.exists() else hub_snapshot(name, fetch=False)
            cfg = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise EyasError(f"eyas plan: cannot read the config of target '{name}' without downloading ({e}); give a "
                        f"local folder, or one of {sorted(KNOWN_TARGETS)}") from e
    return Target(name, shape_of(cfg), cfg, f"{gguf}'s header" if gguf is not None else f"{name}/config.json")


def shape_of(cfg: Any) -> TargetShape:
    """A transformers config's shape; parameters counted from it (dense, or MoE with active experts)."""
    from eyas.model.config import text_config

    c = text_config(cfg)
    h, layers, heads = int(c.hidden_size), int(c.num_hidden_layers), int(c.num_attention_heads)
    kv, hd = int(getattr(c, "num_key_value_heads", None) or heads), int(getattr(c, "head_dim", None) or h // heads)
    inter, vocab = int(getattr(c, "intermediate_size", 4 * h)), int(c.vocab_size)
    tied = bool(getattr(c, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False)))
    experts, per_token = int(getattr(c, "num_experts", 0) or 0), int(getattr(c, "num_experts_per_tok", 0) or 0)
    moe_inter = int(getattr(c, "moe_intermediate_size", 0) or inter)
    attn = 2 * h * heads * hd + 2 * h * kv * hd
    mlp_total = 3 * h * (moe_inter * experts if experts else inter)
    mlp_active = 3 * h * (moe_inter * per_token if experts else inter)
    embed = vocab * h * (1 if tied else 2)
    params, active = layers * (attn + mlp_total) + embed, layers * (attn + mlp_active) + embed
    dtype = str(getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None) or "bfloat16")
    return TargetShape(layers, h, inter, heads, kv, hd, vocab, params, active,
                       params * (4 if "float32" in dtype else 2), tied,
                       int(getattr(c, "max_position_embeddings", 4096) or 4096))


# ---------------------------------------------------------------------------------------------
# work per token
# ---------------------------------------------------------------------------------------------


def target_flops(s: TargetShape, tokens: int) -> float:
    """A prefill's FLOPs per token up to the last decoder layer (no lm_head: extraction stops there);
    causal attention over `tokens`-long sequences."""
    body = s.active - s.vocab * s.hidden * (1 if s.tied else 2)
    return 2 * body + 2 * s.layers * s.heads * s.head_dim * tokens


def draft_flops(s: TargetShape, draft_vocab: int, ttt: int, tokens: int, intermediate: int = 0) -> float:
    """One training token of an EAGLE-3 draft of the target's width: TTT steps of the layer and the draft
    lm_head (backward 2x), fc once, and the target's head for the labels (forward only)."""
    h, d_attn, d_kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer = 2 * h * d_attn + 2 * (2 * h * d_kv) + d_attn * h + 3 * h * (intermediate or s.intermediate)
    step = 2 * (layer + h * draft_vocab) + 2 * d_attn * tokens
    return 3 * (ttt * step + 2 * 3 * h * h) + 2 * h * s.vocab


def row_flops(r: Rate) -> float:
    s = MEASURED_SHAPES[r.model]
    if r.stage == "extract":
        return target_flops(s, r.tokens)
    if r.stage == "train":
        return draft_flops(s, r.draft_vocab, r.ttt_steps, r.tokens, r.draft_intermediate)
    if r.stage == "train-online":  # the quality recipe's samples: ~1,000 tokens
        return target_flops(s, 1024) + draft_flops(s, r.draft_vocab, r.ttt_steps, r.tokens, r.draft_intermediate)
    if r.stage == "eval":
        return s.layers  # one token per step, launch-bound: the work is a kernel chain per decoder layer
    if r.stage == "regenerate":
        return 2 * s.active
    return 1.0  # prepare: tokenizing, whatever the target


def rate(stage: str, engine: str, card: str, flops: float) -> tuple[float, str]:
    return rate_for(stage, engine, card, flops, row_flops)


# ---------------------------------------------------------------------------------------------
# the data
# ---------------------------------------------------------------------------------------------


def data_counts(inputs: list[str], max_length: int, max_samples: int | None,
                prepared: Path) -> tuple[int, float, str]:
    """(samples, tokens, how): the prepared dataset's manifest when it exists, else the embedded data's
    measured token counts at this max_length (anything else is counted as ShareGPT)."""
    if (prepared / "manifest.json").is_file():
        m = read_json(prepared / "manifest.json")
        return int(m["num_samples"]), float(m["num_tokens"]), f"from {prepared}/manifest.json"
    samples, tokens, guessed = 0, 0.0, []
    for name in inputs:
        n, table = (DUMMY_SAMPLES, DUMMY_MEAN_TOKENS) if name == "dummy" else (SHAREGPT_SAMPLES,
                                                                             SHAREGPT_MEAN_TOKENS)
        if name not in ("sharegpt", "dummy"):
            guessed.append(name)
        samples += n
        tokens += n * mean_tokens(table, max_length)
    if max_samples and samples > max_samples:
        tokens, samples = tokens * max_samples / samples, max_samples
    how = f"estimated at max_length {max_length} (SmolLM2's tokenizer; others differ by +-20%)"
    if guessed:
        how += f"; {', '.join(map(str, guessed))} counted as ShareGPT"
    return samples, tokens, how


def card_name(card: str) -> str:
    if card not in CARDS:
        raise EyasError(f"--card {card}: not in eyas' table; choose one of {', '.join(CARDS)}")
    return card


# ---------------------------------------------------------------------------------------------
# the stages
# ---------------------------------------------------------------------------------------------


@dataclass
class Context:
    """What every stage's estimate reads: the run, the card, the target, the data's size."""

    card: str
    target: Target
    samples: int
    tokens: float
    counts: str
    draft_weights: float = 0.0  # bytes of the trained draft in bf16 (set by the train stage's estimate)

    @property
    def gpu(self) -> bool:
        return self.card != "cpu"

    def weights(self, gpus: int = 1) -> float:
        """The target's weights per GPU (the CPU computes in fp32: twice bf16's bytes)."""
        s = self.target.shape
        return (s.weight_bytes if self.gpu else 2 * s.weight_bytes) / max(1, gpus)


def estimate_regenerate(ctx: Context, opts: Any, nproc: int) -> Estimate:
    reply = min(REPLY_SHARE * ctx.tokens, ctx.samples * SHAREGPT_TURNS * opts.max_new_tokens)
    gpus = opts.tp if opts.engine == "vllm" else 1
    tok_s, how = rate("regenerate", opts.engine if opts.engine != "auto" else "static", ctx.card,
                      2 * ctx.target.shape.active)
    e = Estimate("regenerate", samples=ctx.samples, tokens=reply, seconds=reply / (tok_s * gpus))
    e.disk = {"conversations.jsonl (+ .partial while it runs)": ctx.tokens * JSON_BYTES_PER_TOKEN}
    e.memory = {"target": ctx.weights(gpus), "KV cache": 0.0}
    if opts.engine == "vllm":
        e.usable = (0.6, "vLLM (the gpu_memory_utilization regenerate gives it)")
    e.notes += [f"reply tokens: {REPLY_SHARE:.0%} of the prepared tokens (the share under the loss mask), at most "
                f"{SHAREGPT_TURNS:.2f} turns x max_new_tokens per conversation",
                "KV cache: what the generator is given (static: 60% of the free memory; vllm: 0.6 of each card)",
                f"time: {how}" + (f", x{gpus} GPUs" if gpus > 1 else "")]
    return e


def estimate_prepare(ctx: Context, opts: Any, nproc: int) -> Estimate:
    tok_s, how = rate("prepare", "tokenizer", "cpu", 1.0)
    e = Estimate("prepare", samples=ctx.samples, tokens=ctx.tokens, seconds=ctx.tokens / tok_s)
    shards = max(1, int(ctx.tokens // opts.shard_tokens) + 1)
    e.disk = {f"shard-*.safetensors ({shards}: input_ids, loss_mask, offsets)": 5 * ctx.tokens + 8 * ctx.samples +
              SMALL * shards, "token_counts.safetensors": 8 * ctx.target.shape.vocab + SMALL, "manifest.json": SMALL}
    e.notes += [f"samples and tokens {ctx.counts}", f"time: {how}, one worker (more with --num-workers on an idle "
                "machine)"]
    return e


def estimate_extract(ctx: Context, opts: Any, nproc: int) -> Estimate:
    import numpy as np

    from eyas.model.aux_layers import default_aux_layer_ids
    from eyas.store.writer import StoreMeta, split_shards, store_file_bytes

    s = ctx.target.shape
    samples = min(ctx.samples, opts.max_samples or ctx.samples)
    tokens = ctx.tokens * samples / max(1, ctx.samples)
    aux = list(opts.aux_layer_ids or default_aux_layer_ids(s.layers))
    meta = StoreMeta(target=ctx.target.name, target_config_sha256="", num_layers=s.layers, aux_layer_ids=aux,
                     hidden_size=s.hidden, vocab_size=s.vocab, dtype="float8_e4m3fn" if opts.fp8 else "bfloat16",
                     prepared="", prepared_sha256="", norm_eps=0.0, options_sha256="")
    lengths = np.full(samples, max(1, round(tokens / max(1, samples))), dtype=np.int64)
    files = store_file_bytes(meta, split_shards(lengths, meta.bytes_per_token(), int(opts.shard_mb * 2**20)))
    shard_files = [k for k in files if k.startswith("shard-")]
    e = Estimate("extract", processes=nproc, samples=samples, tokens=tokens, seconds=0.0)
    e.disk = {f"shard-*.safetensors ({len(shard_files)}, {meta.bytes_per_token():,} B/token, {meta.dtype})":
              sum(files[k] for k in shard_files), "target_head.safetensors": files["target_head.safetensors"],
              "manifest.json": files["manifest.json"]}
    gpus = opts.tp if opts.engine == "vllm" else nproc
    tok_s, how = rate("extract", opts.engine, ctx.card, target_flops(s, int(tokens / max(1, samples))))
    e.seconds = tokens / (tok_s * gpus)
    budget = opts.token_budget or (16384 if ctx.gpu else 4096)
    e.memory = {"target": ctx.weights(opts.tp if opts.engine == "vllm" else 1),
                "activations": budget * (4 * s.hidden + 2 * s.intermediate) * (2 if ctx.gpu else 4)}
    if opts.engine == "vllm":
        e.memory["activations"] = 0.0
        e.usable = (VLLM_SHARE, "vLLM (its default gpu_memory_utilization)")
        e.notes.append("vllm reserves 90% of each card (its gpu_memory_utilization) for weights, activations and "
                       "the KV blocks the states pass through")
    e.notes.append(f"time: {how}" + (f", x{gpus} GPUs (assumes linear scaling)" if gpus > 1 else ""))
    if s.active < s.params:
        e.notes.append("a mixture of experts runs below the dense row's FLOP efficiency: expect longer")
    return e


def draft_params(ctx: Context, o: Any) -> tuple[int, int]:
    """(trainable, frozen embedding) parameters of the draft these train options build (on the meta
    device: no memory)."""
    import torch

    from eyas.model.aux_layers import default_aux_layer_ids
    from eyas.model.config import DraftConfig, DraftOptions
    from eyas.model.families import build_draft
    from eyas.model.family_facts import family
    from eyas.utils.schema import subset

    aux = list(o.aux_layer_ids or default_aux_layer_ids(ctx.target.shape.layers))
    dcfg = DraftConfig.from_target_config(ctx.target.config, aux, options=subset(o, DraftOptions))
    if family(dcfg.family).mask_token and dcfg.mask_token_id < 0:  # train picks it; any id counts the same
        dcfg.mask_token_id = dcfg.vocab_size - 1
    with torch.device("meta"):
        draft = build_draft(dcfg)
    frozen = sum(p.numel() for n, p in draft.named_parameters() if n.startswith("embed_tokens"))
    return sum(p.numel() for p in draft.parameters()) - frozen, frozen


def train_rate(ctx: Context, o: Any, nproc: int, budget: int) -> tuple[float, str]:
    """Training tokens per second of the whole run: the draft's rate on `nproc` GPUs; online with the target
    on the trainers' GPUs, both one after the other; with the target on GPUs of its own, the slower of
    the two (the feed overlaps them)."""
    s = ctx.target.shape
    draft_f = draft_flops(s, min(o.draft_vocab_size, s.vocab), o.ttt_steps, budget, o.draft_intermediate_size)
    if not o.online:
        tok_s, how = rate("train", "eyas", ctx.card, draft_f)
        return tok_s * nproc, how
    mean_len = int(ctx.tokens / max(1, ctx.samples))
    target_f = target_flops(s, mean_len)
    own_gpus = len(o.target_gpus or []) or (o.tp if o.engine == "vllm" and ctx.gpu else 0)
    if not own_gpus:
        tok_s, how = rate("train-online", "hf", ctx.card, target_f + draft_f)
        return tok_s * nproc, how
    d_rate, d_how = rate("train", "eyas", ctx.card, draft_f)
    t_rate, t_how = rate("extract", o.engine, ctx.card, target_f)
    total = min(d_rate * nproc, t_rate * own_gpus)
    return total, f"the slower of the draft ({d_how}, x{nproc}) and the target on {own_gpus} GPUs ({t_how})"


def estimate_schedule(ctx: Context, o: Any, nproc: int) -> Estimate:
    s = ctx.target.shape
    bf16 = o.dtype in ("bf16", "bfloat16") or (o.dtype == "auto" and ctx.gpu)
    budget = o.token_budget or (16384 if ctx.gpu else 1024)
    train_tokens = ctx.tokens * (ctx.samples - o.val_samples) / max(1, ctx.samples)
    per_step = nproc * o.grad_accum * budget * FILL
    steps = o.max_steps or o.epochs * int(train_tokens // per_step)
    tok_s, how = train_rate(ctx, o, nproc, budget)
    start = TRAIN_START_S if ctx.gpu and o.compile is not False else 0
    e = Estimate("train", processes=nproc, samples=ctx.samples, tokens=steps * per_step,
                 seconds=steps * per_step / tok_s + start)
    trainable, frozen = draft_params(ctx, o)
    shard = nproc if o.fsdp and nproc > 1 else 1
    w = 2 if bf16 else 4
    e.memory = {"draft (weights, fp32 master, gradients)": trainable * (w + 4 + (4 if bf16 else 0)) / shard,
                "optimizer (AdamW, fp32)": 8 * trainable / shard,
                "target head (lm_head on the device)": s.vocab * s.hidden * w,
                "activations": ACT_BYTES_PER_TOKEN * s.hidden / 4096 * o.ttt_steps / 7 * budget}
    if not ctx.gpu:
        e.memory["frozen embedding"] = frozen * w
    if o.online and not (o.target_gpus or o.engine == "vllm"):
        e.memory["target (in this process)"] = ctx.weights()
    weights = (trainable + frozen) * w
    ctx.draft_weights = (trainable + frozen) * 2
    e.disk = {f"train_state ({o.keep_checkpoints} checkpoints: fp32 draft + optimizer)":
              o.keep_checkpoints * ((trainable + frozen) * 4 + 8 * trainable) if o.save_every else 0.0,
              "draft": weights, "metrics.jsonl, manifest.json": 512 * steps / o.log_every + SMALL}
    if o.val_samples:
        e.disk["draft-best"] = weights
    if start:
        e.disk["train_state/compile-cache.bin"] = 43 * 2**20
    e.notes += [f"{steps:,} steps of {nproc} x {o.grad_accum} x {budget:,} tokens (~{FILL:.0%} full); draft: "
                f"{trainable / 1e6:,.1f}M trainable + {frozen / 1e6:,.1f}M frozen embedding parameters",
                f"time: {how}" + (f"; + {start} s of torch.compile before the first step (5 s with a warm cache)"
                                  if start else "")]
    if o.online and (o.target_gpus or o.engine == "vllm") and ctx.gpu:
        e.notes.append(f"target on its own {len(o.target_gpus or []) or o.tp} GPU(s): "
                       f"{ctx.weights(o.tp) / 2**30:,.1f} GiB of weights each, vLLM reserving 90% of each card")
    return e


def estimate_train(ctx: Context, schedules: Any, nproc: int) -> Estimate:
    """All schedules of the train stage, one after the other."""
    parts = [estimate_schedule(ctx, o, nproc) for o in (schedules if isinstance(schedules, list) else [schedules])]
    e = parts[0]
    for p in parts[1:]:
        e.tokens += p.tokens
        e.seconds += p.seconds - (TRAIN_START_S - 5 if ctx.gpu else 0)  # compiled once: a warm cache after
        e.disk = {k: e.disk.get(k, 0.0) + v for k, v in p.disk.items()}
        e.notes += p.notes
    return e


def estimate_export(ctx: Context, opts: Any, nproc: int) -> Estimate:
    size = ctx.draft_weights
    e = Estimate("export", seconds=1 + 3 * size / 1e9)
    e.disk = {"vllm/, sglang/, speculators/ (bf16 weights each)": 3 * size}
    e.notes.append("time: ~1 s plus writing at 1 GB/s")
    return e


PROMPT_SETS = {"mtbench": (80, 2), "humaneval": (164, 1)}


def estimate_eval(ctx: Context, opts: Any, nproc: int) -> Estimate:
    convs, turns = 0, 0
    for name in str(opts.prompts).split(","):
        n, t = PROMPT_SETS.get(name.strip(), (80, 1))
        convs += min(n, opts.max_prompts or n)
        turns = max(turns, min(t, opts.max_turns))
    methods = sum(len([x for x in str(spec).split(",") if x.strip() and x.strip() != "none"])
                  for spec in (opts.chain, opts.tree))
    drafts = 2 if opts.compare else 1  # with compare_untrained: the untrained draft, then the trained one
    decodes = convs * turns * (drafts * methods + int(opts.baseline))
    tokens = decodes * opts.max_new_tokens
    tok_s, how = rate("eval", opts.engine, ctx.card, ctx.target.shape.layers)
    batched = [b for b in opts.batch_sizes if b > 1]  # each decodes every prompt again, batched: no slower
    e = Estimate("eval", samples=convs, tokens=tokens * (1 + len(batched)), seconds=tokens / tok_s * (1 + len(batched)))
    e.memory = {"target": ctx.weights(opts.tp if opts.engine == "vllm" else 1), "draft": ctx.draft_weights}
    if opts.engine == "vllm":
        e.usable = (VLLM_SHARE, "vLLM (its default gpu_memory_utilization)")
    e.disk = {"reports and plots": drafts * 2**20, **({"draft-untrained": ctx.draft_weights} if drafts == 2 else {})}
    e.notes += [f"{decodes:,} decodes of up to {opts.max_new_tokens} tokens ({methods} methods x {drafts} draft(s)"
                f"{' + the target alone' if opts.baseline else ''}), one at a time"
                + (f"; again at batch size {', '.join(map(str, batched))}, counted at no faster than one at a time"
                   if batched else ""),
                f"time: {how}; decoding is launch-bound, so the work scales with decoder layers, not FLOPs"]
    return e


ESTIMATORS = {"regenerate": estimate_regenerate, "prepare": estimate_prepare, "extract": estimate_extract,
              "train": estimate_train, "export": estimate_export, "eval": estimate_eval, "serving": estimate_eval}


def estimate_run(cfg: Any, stages: list[Any], keys: list[str], card: str, config_path: Path
                 ) -> tuple[Target, list[Estimate]]:
    """The run's target and every stage's estimate, with what will be skipped (`keys`: each stage's key in
    the run's ledger, up to date there) or resumed."""
    from eyas.utils.resume import up_to_date

    by = {st.name: st for st in stages}
    prep = by["prepare"].options
    regen = by.get("regenerate")
    inputs = list(regen.options.inputs) if regen else list(prep.inputs)
    max_samples = (regen.options.max_samples if regen else 0) or prep.max_samples
    trust = any(getattr(o, "trust_remote_code", False) for st in stages
                for o in (st.options if isinstance(st.options, list) else [st.options]))
    ctx = Context(card_name(card), read_target(cfg.target, trust),
                  *data_counts(inputs, prep.max_length, max_samples, Path(prep.out)))
    ledger = Path(cfg.workdir or Path("runs") / config_path.stem) / "run_state.json"
    out = []
    for st, key in zip(stages, keys, strict=True):
        e = ESTIMATORS[st.name](ctx, st.options, max(1, st.nproc))  # 0: fsdp on a machine without GPUs
        e.name, e.processes = st.name, st.nproc  # the serving stage is estimated as an eval
        if up_to_date(ledger, key, *st.outputs, entry=st.name):
            e.status = "up to date: skipped"
        elif (note := resumable(st)) is not None:
            e.status = note
        out.append(e)
    return ctx.target, out


def resumable(st: Any) -> str | None:
    """What a stage left to resume from, if anything."""
    from eyas.store.writer import partial_dir

    opts = st.options[-1] if isinstance(st.options, list) else st.options
    if st.name == "extract" and partial_dir(opts.out).is_dir():
        done = len(list(partial_dir(opts.out).glob("shard-*.safetensors")))
        return f"will resume ({done} shard(s) already in {partial_dir(opts.out)})"
    if st.name == "train" and any((Path(opts.out) / "train_state").glob("step-*")):
        return f"will resume from the last checkpoint in {Path(opts.out) / 'train_state'}"
    return None
