"""Where the time of one speculative-decoding step goes, and the acceptance a speedup needs.

Decodes MT-Bench first turns with the target alone and with a draft (greedy chains of K), one prompt at a
time in eyas' own decoder (what `eyas eval --backend hf` runs, here with graphs off so each part can be
timed), timing each part of every verify step:
  target verify   the target's forward over the K drafted tokens plus the newest one (aux states captured)
  draft           the draft's forwards (the pending entries, then K - 1 chained steps)
  rest            acceptance, moving the accepted tokens into place, bookkeeping
and prints them beside the target alone's time per token. Break-even tokens per target forward = the
step's time over the target alone's per-token time: below it, speculative decoding is slower.

    PYTHONPATH=. python3 benchmarks/verify_step.py --draft runs/smollm2-quickstart/export/vllm --chain 1,3
"""

from __future__ import annotations

import argparse
import time

import torch


def timed_calls(module, calls: list[tuple[int, float]]):
    """Record (input tokens, seconds) of every call of `module` (forward hooks; synchronised on a GPU)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    start: list[float] = []

    def before(mod, args, kwargs):
        sync()
        start.append(time.perf_counter())

    def after(mod, args, kwargs, out):
        sync()
        calls.append((kwargs["input_ids"].shape[1], time.perf_counter() - start.pop()))

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True)


def timed(fn, calls: list[tuple[int, float]]):
    """fn, recording (0, seconds) of every call."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        calls.append((0, time.perf_counter() - t0))
        return out
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--chain", default="1,3")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from eyas.assets import resolve_model
    from eyas.engines.hf import load_hf_model
    from eyas.eval.batch_decode import BatchDecoder
    from eyas.eval.prompts import mtbench_set, render_prompt
    from eyas.eval.proposer_base import ChainSpec
    from eyas.eval.proposers import make_proposer
    from eyas.eval.target import HFTarget, stop_token_ids
    from eyas.recipes.evaluate import load_draft

    path = resolve_model(args.model)
    dev, dt = torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda"), torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    model = load_hf_model(path, dt, dev).eval()
    draft = load_draft(args.draft, path, model, dev, dt)
    target = HFTarget(model, list(draft.config.aux_layer_ids))
    stops = sorted(stop_token_ids(model, tok))
    prompts = [render_prompt(tok, [{"role": "user", "content": it.turns[0]}])
               for it in mtbench_set(args.prompts, 1).items]
    proposer = make_proposer(draft)
    verify_calls: list[tuple[int, float]] = []
    draft_calls: list[tuple[int, float]] = []
    timed_calls(model, verify_calls)
    proposer.chain = timed(proposer.chain, draft_calls)

    prefill_calls: list[tuple[int, float]] = []

    def decode(method, prompt_list):
        """-> the generations and the seconds they took, their prefills excluded."""
        length = max(map(len, prompt_list)) + args.max_new_tokens + BatchDecoder.margin(method)
        dec = BatchDecoder(target, proposer if method else None, method, 1, length, args.max_new_tokens, stops,
                           graphs=False)
        dec._admit = timed(dec._admit, prefill_calls)
        prefill_calls.clear()
        t0 = time.perf_counter()
        gens = dec.run(prompt_list)
        return gens, time.perf_counter() - t0 - sum(s for _, s in prefill_calls)

    with torch.inference_mode():
        decode(None, prompts[:1])  # warm-up
        gens, alone_s = decode(None, prompts)
        per_token = alone_s / sum(len(g.tokens) for g in gens)
        print(f"{args.model}, {dev.type}, {torch.get_num_threads()} threads, {len(prompts)} MT-Bench first turns, "
              f"{args.max_new_tokens} new tokens; times in ms per verify step")
        print(f"target alone: {1e3 * per_token:.1f} ms a token ({1 / per_token:.1f} tok/s)\n")
        print("| method | target verify | draft | rest | step | tokens / target forward | break-even | speedup |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for k in map(int, args.chain.split(",")):
            verify_calls.clear(), draft_calls.clear()
            gens, total = decode(ChainSpec(k), prompts)
            forwards, tokens = sum(g.target_forwards for g in gens), sum(len(g.tokens) for g in gens)
            verify = [s for n, s in verify_calls if n == k + 1]
            steps = len(verify)
            step = 1e3 * total / steps
            v, d = 1e3 * sum(verify) / steps, 1e3 * sum(s for _, s in draft_calls) / steps
            print(f"| chain-{k} | {v:.1f} | {d:.1f} | {step - v - d:.1f} | {step:.1f} | {tokens / forwards:.2f} "
                  f"| {step / (1e3 * per_token):.2f} | {tokens / total * per_token:.2f}x |")


if __name__ == "__main__":
    main()
