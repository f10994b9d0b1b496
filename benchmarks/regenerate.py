"""Why self-distillation of a small target is slow: transformers' `generate` is host-bound.

Decodes the first user turn of ShareGPT conversations with the target (greedy, a fixed number of new
tokens) at several batch sizes, side by side in one run, and prints the time per decode step and the
tokens/s against the smallest batch. When the step time stays flat as the batch grows, the GPU is
waiting on the host and bigger batches are free; `eyas regenerate` sizes its default batch from this.

    PYTHONPATH=. python3 benchmarks/regenerate.py                          # GPU: batches 64, 256, 1024
    PYTHONPATH=. python3 benchmarks/regenerate.py --batches 1,4 --new 8    # CPU smoke run

--random-weights builds the target from its config alone (same shapes, so the same step time): a GPU box
then needs only config.json and the tokenizer files.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from eyas.assets import resolve_model
from eyas.data.readers import read_conversations
from eyas.utils.devices import resolve_device, resolve_dtype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="target folder or alias")
    ap.add_argument("--random-weights", action="store_true", help="build the target from its config only")
    ap.add_argument("--data", default="sharegpt", help="chat data whose first user turns are the prompts")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--new", type=int, default=64, help="new tokens per row (every row decodes all of them)")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompts are cut to this many tokens")
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
    convs = read_conversations([args.data])[: max(batches)]
    prompts = [tok.apply_chat_template([next(m for m in c if m["role"] == "user")], tokenize=False,
                                       add_generation_prompt=True) for c in convs]
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    weights = "random weights" if args.random_weights else "real weights"
    print(f"{path} ({weights}), {model.dtype}, {name}, torch {torch.__version__}, greedy, {args.new} new tokens\n")
    print("| batch | prompt tokens | s | ms / decode step | tok/s | tok/s vs first row |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    first = None
    for b in batches:
        enc = tok(prompts[:b], return_tensors="pt", padding=True, add_special_tokens=False, truncation=True,
                  max_length=args.prompt_len).to(dev)
        with torch.inference_mode():
            model.generate(**enc, do_sample=False, max_new_tokens=2, pad_token_id=tok.eos_token_id)  # warm-up
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(**enc, do_sample=False, max_new_tokens=args.new, min_new_tokens=args.new,
                           pad_token_id=tok.eos_token_id)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        dt = time.perf_counter() - t
        rate = len(prompts[:b]) * args.new / dt
        first = first or rate
        print(f"| {b} | {enc['input_ids'].shape[1]} | {dt:.2f} | {dt / args.new * 1e3:.1f} | {rate:,.0f} | "
              f"{rate / first:.2f}x |")


if __name__ == "__main__":
    main()
