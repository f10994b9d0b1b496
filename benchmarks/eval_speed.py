"""How fast `eyas eval --engine hf` decodes, against the card's own limits, each table from one run.

(a) the target alone at batch 1 (eyas.eval.batch_decode: static caches, each round a CUDA graph, prompts
    prefilled as they come) against a bare forward loop over a static cache, captured whole as one
    CUDA graph and replayed: the physical baseline, nothing around the forwards. Same prompts.
(b) with a draft: wall-clock speedup of each method against the target alone at each batch size (the
    serving table of `eyas eval --batch-size`), MT-Bench first turns.
(c) the full quality eval (80 MT-Bench questions x 2 turns, 192 new tokens, chain-7 and the 60:7:10
    tree, float32), timed end to end, with the greedy identity check against the target.
(d) the recommendation against an exhaustive sweep, per batch size: the method `eyas eval --batch-size`'s sweep
    picks (eyas.eval.budget, eyas.eval.recommend; the target alone is a candidate), its speedup measured again
    in the exhaustive run of the same round (chains of 1-8 and every tree of the ladder at every batch size),
    and that run's best. Goals: the pick >= 1.0x at every batch size, >= 1.3x at batch 16, >= 0.95 of the
    exhaustive best; and the sweep's wall time against the default eval's (no sweep), goal <= ~2x.
Each measurement is repeated, the cases interleaved round by round (benchmarks/common.py); the tables give
the median and the spread (min-max), and a goal is met only by its whole range.

    PYTHONPATH=. python3 benchmarks/eval_speed.py --tables a
    PYTHONPATH=. python3 benchmarks/eval_speed.py --tables b --draft DRAFT --batch-sizes 1,16
    PYTHONPATH=. python3 benchmarks/eval_speed.py --tables c --draft DRAFT --quality-batch-sizes 16
    PYTHONPATH=. python3 benchmarks/eval_speed.py --tables d --draft DRAFT --prompts 64 --sweep-batch-sizes 1,4,16,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402


def spread(xs: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def bare_loop_tok_s(model, prompt: list[int], steps: int) -> float:
    """tokens/s of `steps` greedy forwards over a static cache, all of them one CUDA graph."""
    from eyas.generate.graph_decode import Lane, attention_of

    dev = next(model.parameters()).device
    n_layers = model.config.num_hidden_layers
    length = -(-(len(prompt) + steps + 1) // 64) * 64
    lane = Lane(n_layers, 1, length, steps, torch.tensor([-1], device=dev), 0)
    tok, pos = lane.tok, lane.pos  # the lane writes each new key at slot pos
    pos.fill_(len(prompt))
    slots = torch.arange(length, device=dev)

    def loop() -> None:
        for _ in range(steps):
            mask = (slots <= pos)[:, None, None, :]
            logits = model(input_ids=tok, position_ids=pos, attention_mask=mask, past_key_values=lane,
                           use_cache=True, logits_to_keep=1).logits[:, -1]
            tok.copy_(logits.argmax(-1, keepdim=True))
            pos.add_(1)

    with torch.inference_mode(), attention_of(model):
        lane.prefill_rows = torch.tensor([0], device=dev)
        model(input_ids=torch.tensor([prompt], device=dev), position_ids=torch.arange(len(prompt), device=dev)[None],
              past_key_values=lane, use_cache=True)
        lane.prefill_rows = None
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            loop()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        pos.fill_(len(prompt))
        with torch.cuda.graph(graph):
            loop()
        times = []
        for _ in range(3):
            pos.fill_(len(prompt))
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
    return steps / min(times)


def smollm2_shaped(dtype: torch.dtype):
    """A random model of SmolLM2-135M's exact shape: the same kernels, so the same time a token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(device="cuda", dtype=dtype).eval()


def table_a(model, tok, args) -> None:
    from eyas.eval.batch_decode import BatchDecoder
    from eyas.eval.prompts import mtbench_set, render_prompt
    from eyas.eval.target import HFTarget

    if tok is None:  # random prompts of MT-Bench first turns' lengths
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in range(40, 400, 360 // args.prompts)]
        prompts = prompts[:args.prompts]
    else:
        prompts = [render_prompt(tok, [{"role": "user", "content": it.turns[0]}])
                   for it in mtbench_set(args.prompts, 1).items]
    target = HFTarget(model, [1])
    dec = BatchDecoder(target, None, None, 1, -(-(max(map(len, prompts)) + args.new + 8) // 256) * 256, args.new,
                       [])  # no stop: every answer is `new` tokens, as in the bare loop
    dec.prepare()
    eyas_rates, bare_rates = [], []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gens = dec.run(prompts)
        torch.cuda.synchronize()
        eyas_rates.append(sum(g.new_tokens for g in gens) / (time.perf_counter() - t0))
        bare_rates.append(statistics.mean(bare_loop_tok_s(model, p, args.new) for p in prompts[:2]))
    ratios = [e / b for e, b in zip(eyas_rates, bare_rates, strict=True)]
    what = "prompts of random tokens" if tok is None else "MT-Bench first turns"
    print(f"\n(a) target alone, batch 1, {args.dtype}, {len(prompts)} {what} x {args.new} tokens, "
          f"{args.repeats} repeats")
    print("| decoder | tok/s | ms / token |\n| --- | ---: | ---: |")
    print(f"| bare forward loop, one CUDA graph | {spread(bare_rates)} | {1e3 / statistics.median(bare_rates):.2f} |")
    print(f"| eyas eval, target alone | {spread(eyas_rates)} | {1e3 / statistics.median(eyas_rates):.2f} |")
    print(f"ratio eyas / bare: {spread(ratios, '{:.2f}')} (goal >= 0.8)")
    target.close()


def table_bc(model, tok, args, which: str) -> None:
    from eyas.eval.prompts import mtbench_set
    from eyas.eval.runner import evaluate_draft
    from eyas.recipes.evaluate import load_draft

    draft = load_draft(args.draft, args.model_path, model, model.device, model.dtype)
    turns = 1 if which == "b" else 2
    sets = mtbench_set(args.prompts if which == "b" else None, turns)
    sizes = [int(b) for b in (args.batch_sizes if which == "b" else args.quality_batch_sizes).split(",")]
    rows: dict[tuple[int, str], list[dict]] = {}
    walls = []
    for _ in range(args.repeats if which == "b" else 1):
        t0 = time.perf_counter()
        res = evaluate_draft(model, tok, draft, sets, chain=[7], tree=["60:7:10"], max_new_tokens=args.new,
                             batch_sizes=sizes, progress=False)
        walls.append(time.perf_counter() - t0)
        for r in res.serving:
            rows.setdefault((r["batch_size"], r["method"]), []).append(r)
    print(f"\n({which}) {len(sets.items)} MT-Bench questions x {turns} turn(s), {args.new} new tokens, {args.dtype}, "
          f"greedy; draft {args.draft}; wall {spread(walls)} s per eval")
    print("| batch | method | tok/s | speedup | tokens / target forward | identical to the target |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for (batch, method), rs in sorted(rows.items()):
        speed = [r["speedup"] for r in rs if r["speedup"]]
        same = rs[0]["identical"]
        print(f"| {batch} | {method} | {spread([r['tokens_per_s'] for r in rs])} | "
              f"{spread(speed, '{:.2f}') + 'x' if speed else '-'} | {rs[0]['tokens_per_forward']:.2f} | "
              f"{'-' if same is None else f'{same:.2f}'} |")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"table": which, "walls": walls, "serving": {f"{b}/{m}": rs for (b, m), rs in
                                                                            rows.items()}}) + "\n")


def table_d(model, tok, args) -> None:
    """The sweep's pick at each batch size against an exhaustive sweep's best, round by round."""
    from eyas.eval.budget import TREE_LADDER
    from eyas.eval.metrics import BASELINE
    from eyas.eval.prompts import mtbench_set
    from eyas.eval.recommend import choose
    from eyas.eval.runner import evaluate_draft
    from eyas.recipes.evaluate import load_draft

    draft = load_draft(args.draft, args.model_path, model, model.device, model.dtype)
    sets = mtbench_set(args.prompts, 1)
    sizes = [int(b) for b in args.sweep_batch_sizes.split(",")]
    walls: dict[str, list[float]] = {"default": [], "sweep": [], "exhaustive": []}

    def timed(name, **kw):
        def case():
            t0 = time.perf_counter()
            res = evaluate_draft(model, tok, draft, sets, max_new_tokens=args.new, batch_sizes=sizes, progress=False,
                                 **kw)
            walls[name].append(time.perf_counter() - t0)
            return res.serving
        return case

    default = dict(chain=[3, 5, 7], tree=["60:7:10"])
    exhaustive = dict(chain=list(range(1, 9)), tree=[t.name.removeprefix("tree-") for t in TREE_LADDER])
    _, ours, full = common.interleaved([timed("default", **default),
                                        timed("sweep", **default, verify_budget=args.verify_budget),
                                        timed("exhaustive", **exhaustive)], args.repeats)
    print(f"\n(d) {len(sets.items)} MT-Bench first turns, {args.new} new tokens, {args.dtype}, greedy; draft "
          f"{args.draft}; verify budget {args.verify_budget}; {args.repeats} rounds")
    print("| batch | sweep's pick (rounds) | its speedup in the exhaustive run | exhaustive best (rounds) "
          "| its speedup | pick / best | goals |")
    print("| ---: | --- | ---: | --- | ---: | ---: | --- |")
    for b in sizes:
        picks, best_names, pick_s, best_s, ratios, noisy = Counter(), Counter(), [], [], [], 0
        for o_rows, f_rows in zip(ours, full, strict=True):
            pick = next(c for c in choose(o_rows) if c.batch_size == b)
            at = {r["method"]: r["speedup"] for r in f_rows if r["batch_size"] == b}
            top = max(((s, m) for m, s in at.items() if s is not None), default=(1.0, BASELINE))
            best_names[top[1]] += 1
            held = 1.0 if pick.method == BASELINE else at.get(pick.method) if pick.method else None
            if held is None:
                noisy += 1
                continue
            picks[pick.method] += 1
            pick_s.append(held)
            best_s.append(top[0])
            ratios.append(held / top[0])
        if not pick_s:
            print(f"| {b} | too noisy in every round | - | - | - | - | - |")
            continue
        pick_sp, ratio = common.spread(pick_s), common.spread(ratios)
        goals = [f">= 1.0x {common.verdict(pick_sp, 1.0)}", f">= 0.95 of best {common.verdict(ratio, 0.95)}"]
        if b == 16:
            goals.insert(1, f">= 1.3x {common.verdict(pick_sp, 1.3)}")
        names = ", ".join(f"{m} x{n}" for m, n in picks.most_common())
        print(f"| {b} | {names}{f' (noisy x{noisy})' if noisy else ''} | {pick_sp.show('.2f', 'x')} | "
              f"{', '.join(f'{m} x{n}' for m, n in best_names.most_common())} | "
              f"{common.spread(best_s).show('.2f', 'x')} | {ratio.show('.2f')} | {'; '.join(goals)} |")
    cost = common.paired_ratio(walls["sweep"], walls["default"])
    print(f"sweep wall time / default eval's: {cost.show('.2f', 'x')} (goal <= ~2x); default eval "
          f"{common.spread(walls['default']).show('.0f', ' s')}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"table": "d", "walls": walls, "sweep": ours, "exhaustive": full}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", default="a,b,c,d")
    ap.add_argument("--draft", help="a trained draft folder (tables b, c and d)")
    ap.add_argument("--model", default="smollm2", help="`smollm2-shaped`: (a) only, a random model of its shape")
    ap.add_argument("--prompts", type=int, default=16, help="MT-Bench questions for (a), (b) and (d)")
    ap.add_argument("--new", type=int, default=192, help="new tokens per answer")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--quality-batch-sizes", default="16", help="batch sizes of the full quality eval (c)")
    ap.add_argument("--sweep-batch-sizes", default="1,4,16,64", help="batch sizes of (d)")
    ap.add_argument("--verify-budget", type=int, default=1024, help="(d): the sweep's verify tokens per round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="append the raw serving rows here")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from eyas.assets import resolve_model
    from eyas.engines.hf import load_hf_model

    shaped = args.model == "smollm2-shaped"
    args.model_path = None if shaped else resolve_model(args.model)
    tok = None if shaped else AutoTokenizer.from_pretrained(args.model_path)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for which in args.tables.split(","):
        args.dtype = "float32" if which == "c" else "bfloat16"
        model = (smollm2_shaped(getattr(torch, args.dtype)) if shaped else
                 load_hf_model(args.model_path, getattr(torch, args.dtype), torch.device("cuda")).eval())
        if which == "a":
            table_a(model, tok, args)
        elif which == "d":
            table_d(model, tok, args)
        else:
            table_bc(model, tok, args, which)


if __name__ == "__main__":
    main()
