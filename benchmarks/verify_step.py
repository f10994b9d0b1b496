"""Where the time of one speculative-decoding step goes, and the acceptance a speedup needs.

Decodes MT-Bench first turns with the target alone and with a draft (greedy chains of K), in eyas' own
decoder (what `eyas eval --backend hf` runs), timing each part of every verify step:
  target verify   the target's forward over the K drafted tokens plus the newest one (aux states captured)
  draft           the draft's forwards (the pending entries, then K - 1 chained steps)
  rest            acceptance, cache trimming, bookkeeping
and prints them beside the target alone's time per token. Break-even tokens per target forward = the
step's time over the target alone's per-token time: below it, speculative decoding is slower.

    PYTHONPATH=. python3 benchmarks/verify_step.py --draft runs/smollm2-quickstart/export/vllm --chain 1,3
"""

from __future__ import annotations

import argparse
import time

import torch


def timed(fn, calls: list[tuple[int, float]], size):
    """fn, recording (size(args), seconds) of every call."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        calls.append((size(*args), time.perf_counter() - t0))
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
    from eyas.eval.prompts import mtbench_set, render_prompt
    from eyas.eval.proposer_base import ChainSpec
    from eyas.eval.spec_decode import SpeculativeDecoder, target_generate
    from eyas.eval.target import HFTarget, stop_token_ids
    from eyas.recipes.evaluate import load_draft

    path = resolve_model(args.model)
    dev, dt = torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda"), torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    model = load_hf_model(path, dt, dev).eval()
    draft = load_draft(args.draft, path, model, dev, dt)
    target = HFTarget(model, list(draft.config.aux_layer_ids))
    decoder = SpeculativeDecoder(target, draft, stop_token_ids(model, tok))
    prompts = [render_prompt(tok, [{"role": "user", "content": it.turns[0]}])
               for it in mtbench_set(args.prompts, 1).items]
    verify_calls: list[tuple[int, float]] = []
    draft_calls: list[tuple[int, float]] = []
    target.forward = timed(target.forward, verify_calls, lambda ids, *a: ids.shape[1])
    decoder.proposer.chain = timed(decoder.proposer.chain, draft_calls, lambda *a: 0)

    with torch.inference_mode():
        target_generate(target, prompts[0], 8)  # warm-up
        alone_s, alone_tokens = 0.0, 0
        for p in prompts:
            g = target_generate(target, p, args.max_new_tokens, stop_ids=decoder.stop_ids)
            alone_s, alone_tokens = alone_s + g.seconds, alone_tokens + len(g.tokens)
        per_token = alone_s / alone_tokens  # the prompt's forward included, as in eyas eval
        print(f"{args.model}, {dev.type}, {torch.get_num_threads()} threads, {len(prompts)} MT-Bench first turns, "
              f"{args.max_new_tokens} new tokens; times in ms per verify step")
        print(f"target alone: {1e3 * per_token:.1f} ms a token ({1 / per_token:.1f} tok/s)\n")
        print("| method | target verify | draft | rest | step | tokens / target forward | break-even | speedup |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for k in map(int, args.chain.split(",")):
            verify_calls.clear(), draft_calls.clear()
            total, forwards, tokens = 0.0, 0, 0
            for p in prompts:
                g = decoder.generate(p, ChainSpec(k), args.max_new_tokens)
                total, forwards, tokens = total + g.seconds, forwards + g.target_forwards, tokens + len(g.tokens)
            verify = [s for n, s in verify_calls if n == k + 1]
            prefill = sum(s for n, s in verify_calls if n != k + 1)
            steps = len(verify)
            step = 1e3 * (total - prefill) / steps
            v, d = 1e3 * sum(verify) / steps, 1e3 * sum(s for _, s in draft_calls) / steps
            print(f"| chain-{k} | {v:.1f} | {d:.1f} | {step - v - d:.1f} | {step:.1f} | {tokens / forwards:.2f} "
                  f"| {step / (1e3 * per_token):.2f} | {tokens / total * per_token:.2f}x |")


if __name__ == "__main__":
    main()
