"""Self-distillation decoding speed: transformers' `generate` against eyas' static-cache generator.

Part 1 decodes the first user turn of ShareGPT conversations with the target (greedy, a fixed number of
new tokens, no early stop) at several batch sizes, both generators side by side in one run: time per
decode step, tokens/s, the ratio, and how many rows both generators decode to the same tokens (up to the
first end-of-turn; bf16 kernels may flip near-ties). `generate` launches each layer's kernels from
Python at every step, so on a GPU its step time stays flat as the batch grows (host-bound); the static
generator (`eyas regenerate --engine static`, eyas.generate.graph_decode) replays each step as one CUDA
graph. On a GPU the run also checks that the graph replay writes exactly what the same steps write eagerly.

Part 2 (--conversations N) rewrites whole multi-turn conversations as `eyas regenerate` does, on the
same decoder twice: in rounds (every conversation's next turn waits for the round's longest reply, the
scheme the static generator used before) and streamed (a row that frees up takes the next waiting turn).

    PYTHONPATH=. python3 benchmarks/regenerate.py                          # GPU: batches 64, 256, 1024
    PYTHONPATH=. python3 benchmarks/regenerate.py --batches 1,4 --new 8 --conversations 8 --max-length 256

--random-weights builds the target from its config alone (same shapes, so the same step time): a GPU node
then needs only config.json and the tokenizer files.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import sync
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from eyas.assets import resolve_model
from eyas.data.readers import read_conversations
from eyas.generate import Sampling
from eyas.generate.graph_decode import GraphDecoder
from eyas.generate.scheduler import run_in_rounds
from eyas.generate.static import StaticGenerator
from eyas.utils.devices import resolve_device, resolve_dtype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="target folder or alias")
    ap.add_argument("--random-weights", action="store_true", help="build the target from its config only")
    ap.add_argument("--data", default="sharegpt", help="chat data whose first user turns are the prompts")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--new", type=int, default=64, help="new tokens per row (every row decodes all of them)")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompts are cut to this many tokens")
    ap.add_argument("--conversations", type=int, default=0, help="part 2: rewrite this many whole conversations")
    ap.add_argument("--max-new", type=int, default=256, help="part 2: longest reply")
    ap.add_argument("--max-length", type=int, default=2048, help="part 2: prompt + reply limit")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    dev = resolve_device("auto")
    path, dtype = resolve_model(args.model), resolve_dtype("auto", dev)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side, tok.pad_token = "left", tok.eos_token
    if args.random_weights:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype,
                                                 attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model = model.to(dev).eval()
    convs = read_conversations([args.data])[: max(batches + [args.conversations])]
    prompts = [tok.apply_chat_template([next(m for m in c if m["role"] == "user")], tokenize=False,
                                       add_generation_prompt=True) for c in convs]
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    weights = "random weights" if args.random_weights else "real weights"
    print(f"{path} ({weights}), {model.dtype}, {name}, torch {torch.__version__}, greedy, {args.new} new tokens\n")
    stop = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
    print("| batch | prompt tokens | generate ms/step | static ms/step | generate tok/s | static tok/s | static vs "
          "generate | rows identical |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in batches:
        enc = tok(prompts[:b], return_tensors="pt", padding=True, add_special_tokens=False, truncation=True,
                  max_length=args.prompt_len).to(dev)
        rows = [r[m.bool()].tolist() for r, m in zip(enc["input_ids"].cpu(), enc["attention_mask"].cpu(),
                                                       strict=True)]
        length = enc["input_ids"].shape[1] + args.new
        decoder = GraphDecoder(model, length, args.new, [], tok.eos_token_id, lanes=[(length, len(rows))])
        with torch.inference_mode():
            model.generate(**enc, do_sample=False, max_new_tokens=2, pad_token_id=tok.eos_token_id)  # warm-up
            GraphDecoder(model, length, 4, [], tok.eos_token_id, lanes=[(length, len(rows))]).generate(rows)
            t_hf, ref = timed(dev, model.generate, **enc, do_sample=False, max_new_tokens=args.new,
                              min_new_tokens=args.new, pad_token_id=tok.eos_token_id)
            t_st, got = timed(dev, decoder.generate, rows)
        ref = ref[:, enc["input_ids"].shape[1]:].tolist()
        same = sum(until(r, stop) == until(g, stop) for r, g in zip(ref, got, strict=True))
        n = len(rows) * args.new
        print(f"| {len(rows)} | {enc['input_ids'].shape[1]} | {t_hf / args.new * 1e3:.1f} "
              f"| {t_st / args.new * 1e3:.1f} "
              f"| {n / t_hf:,.0f} | {n / t_st:,.0f} | {t_hf / t_st:.1f}x | {same}/{len(rows)} |")
    if dev.type == "cuda":  # the replayed graph against the same steps run one by one
        rows = rows[:64]
        eager = GraphDecoder(model, length, args.new, [], tok.eos_token_id, graphs=False).generate(rows)
        graph = GraphDecoder(model, length, args.new, [], tok.eos_token_id).generate(rows)
        print(f"\nCUDA graph replay vs eager steps, {len(rows)} rows x {args.new} tokens: "
              f"{sum(a == b for a, b in zip(eager, graph, strict=True))}/{len(rows)} rows identical")
    if args.conversations:
        multi_turn(dev, model, tok, convs[: args.conversations], args.max_new, args.max_length)


class InRounds(StaticGenerator):
    """The same decoder driven in rounds: each round's turns submitted together, the next round only
    after its longest reply ends (what `--engine static` did before it streamed)."""

    def run(self, convs, chunk, todo, seed, on_chunk) -> None:
        run_in_rounds(self.turns, self.decoder.generate, convs, chunk, todo, seed, on_chunk)


def multi_turn(dev: torch.device, model, tok, convs: list[list[dict]], max_new: int, max_length: int) -> None:
    sampling = Sampling(temperature=0, max_new_tokens=max_new)
    print(f"\nWhole conversations: {len(convs)}, greedy, --max-new-tokens {max_new} --max-length {max_length}\n")
    print("| scheme | turns | new tokens | s | tok/s | vs rounds | conversations identical |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    results = {}
    for name, scheme in (("rounds", InRounds), ("streamed", StaticGenerator)):
        regen = scheme(model, tok, sampling, max_length)
        got: dict = {}
        t, _ = timed(dev, regen.run, convs, len(convs), [0], 0, lambda b, new, st, got=got: got.update(new=new, st=st))
        results[name] = (t, got)
        rounds_t, rounds = results["rounds"]
        same = sum(a == b for a, b in zip(rounds["new"], got["new"], strict=True))
        print(f"| {name} | {got['st']['turns']:,} | {got['st']['tokens']:,} | {t:.1f} | {got['st']['tokens'] / t:,.0f} "
              f"| {rounds_t / t:.2f}x | {same}/{len(convs)} |")


def timed(dev: torch.device, fn, *args, **kwargs):
    sync(dev)
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    sync(dev)
    return time.perf_counter() - t, out


def until(tokens: list[int], stop: int) -> list[int]:
    """The reply as a user would get it: up to and including the first end-of-turn token."""
    return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens

if __name__ == "__main__":
    main()
