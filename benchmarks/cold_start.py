"""Time to the first optimizer step of online training on a fresh machine, and the steady rate after it.

    PYTHONPATH=. python3 benchmarks/cold_start.py                  # one GPU: SmolLM2's online recipe shapes
    PYTHONPATH=. python3 benchmarks/cold_start.py --tiny           # CPU, tiny shapes: the script runs

Each draw is a process of its own with empty compile caches (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR
point at new temporary folders), as on a machine that never compiled eyas' draft. It does what `eyas train
--online` does from its start: loads a random-weight target of SmolLM2-135M's shape (30 layers, hidden 576,
vocabulary 49,152; bf16: speed only) into the hf engine, builds the trainer of the quality recipe's draft
(EAGLE-3.1, MLP 6,144, draft vocabulary 32,000, TTT 7), feeds it packed rows of --tokens through
eyas.train.online.TargetFeed, and times:

- first step: seconds from the process' start to the end of its first optimizer step, split into target
  load, trainer build, first batch (the target's first capture) and the first step itself, with the
  seconds torch.compile spent in them;
- full speed: seconds until the compiled draft runs and the step is a replayed CUDA graph;
- tok/s: --steps optimizer steps after --warmup more, at full speed.

Modes (--modes), all with the defaults of one GPU otherwise: `background` (the default) runs the first steps
eagerly while a thread compiles the draft (eyas.train.compiling); `upfront` compiles before the first step
(--no-compile-in-background, the former behaviour); `eager` trains without torch.compile or CUDA graphs.
Every mode is drawn --repeats times, interleaved (benchmarks/common.py); a figure is the median of its draws
and their range. With --detail, each draw also writes torch's compile times and recompile reasons to --log-dir.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleaved, random_llama, random_prepared, spread, sync  # noqa: E402

from eyas.engines.hf import HFEngine  # noqa: E402
from eyas.model.config import DraftConfig, DraftOptions  # noqa: E402
from eyas.model.eagle3 import Eagle3Draft  # noqa: E402
from eyas.model.vocab import build_draft_vocab  # noqa: E402
from eyas.train import startup  # noqa: E402
from eyas.train.config import TrainConfig  # noqa: E402
from eyas.train.data import PackSchedule, SampleSource  # noqa: E402
from eyas.train.distributed import DistInfo  # noqa: E402
from eyas.train.online import Layout, StateSpec, TargetFeed  # noqa: E402
from eyas.train.trainer import Trainer  # noqa: E402

# hidden, FFN, layers, heads, kv heads, vocab, draft vocab, draft FFN
SHAPES = {"smollm2": (576, 1536, 30, 9, 3, 49152, 32000, 6144), "tiny": (64, 128, 4, 4, 2, 512, 256, 256)}
# mode -> (TrainConfig.compile, .compile_in_background); compile None: the device's default
MODES = {"background": (None, True), "upfront": (None, False), "eager": (False, False)}


def make_prepared(folder: Path, tokens: int, steps: int, vocab: int) -> Path:
    """Random conversations of about tokens/8 tokens each, enough for `steps` packed rows: several documents a
    row, as ShareGPT packs."""
    mean = max(8, tokens // 8)
    lengths = np.random.default_rng(1).integers(mean // 2, 3 * mean // 2, 12 * steps).tolist()
    return random_prepared(folder, lengths, vocab, tokens, f"cold-start-{tokens}-{steps}")


def make_target(shape: str, dev: torch.device, dtype: torch.dtype, tokens: int) -> torch.nn.Module:
    """A random-weight Llama of `shape`, built in `dtype` on `dev`."""
    return random_llama(SHAPES[shape][:6], tokens, dev, dtype, rope_theta=100000.0, tie=True)


def make_trainer(engine: HFEngine, shape: str, dev: torch.device, tokens: int, mode: str) -> Trainer:
    """The quality recipe's draft and trainer on this device (TrainConfig's defaults but `mode`'s compile)."""
    *_, vocab, draft_vocab, draft_ffn = SHAPES[shape]
    head = engine.target_head()
    options = DraftOptions(draft_vocab_size=draft_vocab, draft_intermediate_size=draft_ffn, fc_norm=True,
                           norm_output=True)
    dcfg = DraftConfig.from_target_config(engine.config, engine.aux_layer_ids, options=options)
    torch.manual_seed(0)
    draft = Eagle3Draft(dcfg)
    draft.set_vocab(*build_draft_vocab(torch.ones(vocab, dtype=torch.int64), dcfg.draft_vocab_size))
    draft.load_target_embedding(head.embed_tokens, head.embed_scale)
    compile_, background = MODES[mode]
    compile_ = compile_ if dev.type == "cuda" or compile_ is False else True  # CPU: compile when asked
    cfg = TrainConfig(ttt_steps=7, token_budget=tokens, compile=compile_, compile_in_background=background, lr=5e-4)
    return Trainer(cfg, draft, head, DistInfo(device=dev), total_steps=10**6)


def draw(args: argparse.Namespace) -> dict:
    """One cold run of `args.child` (this process): the first step's clock and parts, then the steady tok/s."""
    dev = torch.device("cpu" if args.tiny else "cuda")
    shape, dtype = ("tiny", torch.float32) if args.tiny else ("smollm2", torch.bfloat16)
    parts = {}
    t = time.perf_counter()
    with startup.timed("target load"):
        engine = HFEngine(make_target(shape, dev, dtype, args.tokens), dtype=dtype, device=dev)
        spec = StateSpec.probe(engine)
    t, parts["target load"] = time.perf_counter(), time.perf_counter() - t
    trainer = make_trainer(engine, shape, dev, args.tokens, args.child)
    t, parts["trainer build"] = time.perf_counter(), time.perf_counter() - t
    startup.take()
    prepared = SampleSource(Path(args.prepared), "prepared")
    from eyas.data.prepared import PreparedDataset

    plan = PackSchedule(PreparedDataset(prepared.path).lengths, args.tokens, seed=0, world=1, grad_accum=1)
    feed = TargetFeed(engine, Layout(0, 0, [0]), spec, dev, depth=2)
    batches = feed.batches(prepared, plan, 0, 0, 10**9, num_workers=args.workers, pin=dev.type == "cuda",
                           pad_to=args.tokens, embed_table=trainer.embed_table)
    compile0, graphs0 = startup.compile_seconds(), startup.compiled_graphs()
    try:
        micro = next(batches)[2]
        t, parts["first batch"] = time.perf_counter(), time.perf_counter() - t
        trainer.train_step(micro)
        sync(dev)
        done = time.perf_counter()
        parts["first step"] = done - t
        first = {"first_s": done - PROCESS_START, "compile_s": startup.compile_seconds() - compile0,
                 "graphs": startup.compiled_graphs() - graphs0, "parts": parts}
        steps = 1
        graphed = trainer.graphed
        while not trainer.compile_ready() or (graphed is not None and graphed.graph is None and not graphed.failed):
            trainer.train_step(next(batches)[2])  # eager steps while the draft compiles, then the graph capture
            steps += 1
        sync(dev)
        first["full_speed_s"], first["steps_before_full_speed"] = time.perf_counter() - PROCESS_START, steps
        for _ in range(args.warmup):
            trainer.train_step(next(batches)[2])
        sync(dev)
        t = time.perf_counter()
        for _ in range(args.steps):
            stats = trainer.train_step(next(batches)[2])
        sync(dev)
        rate = args.tokens * args.steps / (time.perf_counter() - t)
    finally:
        feed.close()
    return {**first, "tok_s": rate, "finite": bool(torch.isfinite(stats).all()),
            "capture_s": graphed.capture_s if graphed is not None else 0.0,
            "replayed": graphed is not None and graphed.graph is not None,
            "all_compile_s": startup.compile_seconds(), "all_graphs": startup.compiled_graphs()}


def run_child(mode: str, prepared: Path, args: argparse.Namespace, round_: int) -> dict:
    """One draw in a fresh process with empty compile caches."""
    with tempfile.TemporaryDirectory(prefix="eyas-cold-") as caches:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor", "TRITON_CACHE_DIR": f"{caches}/triton"}
        if args.detail:
            env["TORCH_LOGS"] = "recompiles,graph_breaks"
        cmd = [sys.executable, __file__, "--child", mode, "--prepared", str(prepared), "--tokens", str(args.tokens),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--workers", str(args.workers),
               *(["--tiny"] if args.tiny else []), *(["--detail"] if args.detail else [])]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if args.detail:
        log = Path(args.log_dir) / f"{mode}-{round_}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(done.stdout + done.stderr)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def show(mode: str, r: dict) -> str:
    if "error" in r:
        return f"  {mode}: failed: {r['error']}"
    p = r["parts"]
    return (f"  {mode}: first step after {r['first_s']:.1f}s (target load {p['target load']:.1f}s, trainer build "
            f"{p['trainer build']:.1f}s, first batch {p['first batch']:.1f}s, first step {p['first step']:.1f}s; "
            f"torch.compile {r['compile_s']:.1f}s over {r['graphs']} graphs); full speed after "
            f"{r['full_speed_s']:.1f}s "
            f"(step {r['steps_before_full_speed']}; torch.compile {r['all_compile_s']:.1f}s over {r['all_graphs']} "
            f"graphs in all, CUDA graph capture {r['capture_s']:.1f}s), then {r['tok_s']:,.0f} tok/s"
            + ("" if r["finite"] else ", NOT FINITE"))


def table(modes: list[str], draws: list[list[dict]]) -> None:
    print("\n| mode | first step s | target load s | first batch s | first step itself s | torch.compile s in it "
          "| full speed after s | graph capture s | tok/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode, rows in zip(modes, draws, strict=True):
        ok = [r for r in rows if "error" not in r]
        if not ok:
            print(f"| {mode} | failed: {rows[0]['error']} | | | | | | | |")
            continue

        def cell(get, fmt=".1f", ok=ok):
            return spread([get(r) for r in ok]).show(fmt)

        print(f"| {mode} | {cell(lambda r: r['first_s'])} | {cell(lambda r: r['parts']['target load'])} | "
              f"{cell(lambda r: r['parts']['first batch'])} | {cell(lambda r: r['parts']['first step'])} | "
              f"{cell(lambda r: r['compile_s'])} | {cell(lambda r: r['full_speed_s'])} | "
              f"{cell(lambda r: r['capture_s'])} | {cell(lambda r: r['tok_s'], ',.0f')} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny shapes, fp32: check that the script runs")
    ap.add_argument("--modes", default="background,upfront", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per packed row = per optimizer step")
    ap.add_argument("--steps", type=int, default=30, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps once at full speed (compiled, captured)")
    ap.add_argument("--workers", type=int, default=6, help="DataLoader workers of the feed (the recipe's)")
    ap.add_argument("--repeats", type=int, default=3, help="cold draws of every mode, interleaved")
    ap.add_argument("--detail", action="store_true", help="also log torch's compile times and recompile reasons")
    ap.add_argument("--log-dir", default="cold-start-logs", help="where --detail's logs go")
    ap.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--prepared", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args.tokens, args.steps, args.warmup, args.workers = min(args.tokens, 128), min(args.steps, 10), 1, 0
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        if args.detail:
            torch._logging.set_logs(recompiles=True, graph_breaks=True)
        print(json.dumps(draw(args)), flush=True)
        if args.detail:
            from torch._dynamo.utils import compile_times

            print(compile_times(), file=sys.stderr)
        return
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny on CPU")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        sys.exit(f"unknown mode(s) {unknown}: pick from {sorted(MODES)}")
    card = "CPU" if args.tiny else torch.cuda.get_device_name(0)
    print(f"cold start: {'tiny' if args.tiny else 'SmolLM2-135M-shaped'} online training on {card}, torch "
          f"{torch.__version__}, {args.tokens} tokens a step; {args.repeats} cold draws of {', '.join(modes)}, "
          "each a fresh process with empty compile caches", flush=True)
    vocab = SHAPES["tiny" if args.tiny else "smollm2"][5]
    with tempfile.TemporaryDirectory() as tmp:
        rows = max(64 if args.tiny else 512, args.warmup + args.steps)  # an epoch outlasts the eager steps
        prepared = make_prepared(Path(tmp) / "prepared", args.tokens, rows, vocab)
        rounds = iter(range(10**9))

        def case(mode: str):
            def one() -> dict:
                r = run_child(mode, prepared, args, next(rounds))
                print(show(mode, r), flush=True)
                return r
            return one

        draws = interleaved([case(m) for m in modes], args.repeats)
    table(modes, draws)


if __name__ == "__main__":
    main()
