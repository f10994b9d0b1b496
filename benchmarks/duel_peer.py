"""SpecForge's side of benchmarks/quality_duel.py: one run of its EAGLE-3 training from its own source tree, on
the samples of an eyas store, for a wall-clock budget counted from this process's start (its start-up spends
the budget too), then its draft saved as its own export writes it (`save_pretrained` of its draft with the
full state its backend gathers) plus `eagle_config` naming the store's aux layers, so `eyas eval` reads it.

    python benchmarks/duel_peer.py --peer-src PATH --store STORE --model TARGET --out DIR --budget-s 300 --seed 0

How, with its defaults (specforge/config/schema.py TrainingConfig): its draft (AutoDraftModel.from_config of a
one-layer LlamaConfig of the target's width, the target's embedding frozen), its OnlineEagle3Model (TTT 7),
its TrainerCore over its FSDP backend (one-process group on CUDA, as its trainer runs on one GPU) with its
BF16Optimizer (AdamW 1e-4, warm-up 1.5%, cosine over --epochs at batch size 1; the run ends there or at
the budget), its attention backend
flex_attention (sdpa on CPU), rows cut to its max_length 2048, in a seeded order per epoch, read ahead by its
default 4 DataLoader workers. Batches are its offline
form (normalize_offline_sample) of the store's rows: aux states as stored, the target's final state after the
target's norm (its TargetHead applies the lm_head alone). Both sides draft over the same vocabulary: the most
frequent trained tokens of the store (eyas.model.vocab), as both pick theirs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from specforge_peer import PeerInputs, SpecForge, draft_config, eager_on_cpu, one_process_group  # noqa: E402

from eyas.assets import resolve_model  # noqa: E402
from eyas.model.vocab import build_draft_vocab  # noqa: E402
from eyas.store.reader import HiddenStore  # noqa: E402
from eyas.train.data import token_counts  # noqa: E402

MAX_LENGTH = 2048  # its default max_length
TTT = 7  # its default ttt_length
WORKERS = 4  # its EAGLE-3 default dataloader_num_workers (on CUDA; in-process on CPU)


class StoreRows(torch.utils.data.Dataset):
    """The store's rows in one epoch's order, the final state normed: its DataLoader workers' share."""

    def __init__(self, store: HiddenStore, head: object, order: list[int]) -> None:
        self.store, self.head, self.order = store, head, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        row = self.store[self.order[i]]
        row["final_hidden"] = self.head.norm(row["final_hidden"].float()).to(row["final_hidden"].dtype)
        return row


def epochs_of_rows(store: HiddenStore, head: object, args: argparse.Namespace, cuda: bool):
    """Rows for --epochs, each epoch in its own seeded order, read ahead by workers and pinned on CUDA."""
    for epoch in range(args.epochs):
        order = torch.randperm(len(store), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        yield from torch.utils.data.DataLoader(StoreRows(store, head, order), batch_size=None,
                                               num_workers=WORKERS if cuda else 0, pin_memory=cuda,
                                               prefetch_factor=4 if cuda else None)


def peer_draft_config(target: str, vocab: int, draft_vocab: int) -> object:
    """Its draft's LlamaConfig: one layer of the target's width and heads."""
    c = AutoConfig.from_pretrained(target)
    theta = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 1e4)))
    shape = SimpleNamespace(hidden=c.hidden_size, inter=c.intermediate_size, heads=c.num_attention_heads,
                            kv_heads=c.num_key_value_heads,
                            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                            vocab=vocab, draft_vocab=draft_vocab, rope_theta=theta)
    config = draft_config(shape)
    config.max_position_embeddings, config.rms_norm_eps = max(c.max_position_embeddings, MAX_LENGTH), c.rms_norm_eps
    return config


def train(args: argparse.Namespace, started: float) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    store = HiddenStore(args.store)
    head = store.target_head()
    vocab = head.vocab_size
    d2t, t2d = build_draft_vocab(token_counts(args.store, "store", vocab), min(args.draft_vocab, vocab))
    config = peer_draft_config(resolve_model(args.model), vocab, int(d2t.numel()))
    peer, dtype = SpecForge(str(args.peer_src)), torch.bfloat16 if dev.type == "cuda" else torch.float32
    attention = "flex_attention" if dev.type == "cuda" else "sdpa"
    group = one_process_group() if dev.type == "cuda" else contextlib.nullcontext()
    with group, peer.imported(dev):
        if peer.legacy:
            raise SystemExit(f"{args.peer_src}: a tree up to the v0.2.0 tag; the duel drives the current layout")
        inputs = PeerInputs([], head.lm_head.float(), d2t, t2d)
        total = args.epochs * len(store)
        draft, core = peer.build_trainer(config, inputs, dev, TTT, attention, compact=False, fsdp=dev.type == "cuda",
                                         total_steps=total, embedding=head.embed_tokens.float())
        steps, loss = 0, float("nan")
        # the budget is looked at after each step, as eyas' is: one step at least
        for row in epochs_of_rows(store, head, args, dev.type == "cuda"):
            with eager_on_cpu(dev):
                loss = core.train_step(peer.batch(row, dtype, pin=False, max_len=MAX_LENGTH)).loss
            steps += 1
            if time.perf_counter() - started >= args.budget_s:
                break
        seconds = time.perf_counter() - started
        if not math.isfinite(loss):
            raise SystemExit(f"the peer's loss is {loss} after {steps} steps: no draft to evaluate")
        state = {k.removeprefix("draft_model."): v for k, v in core.backend.state_dict()["model"].items()
                 if k.startswith("draft_model.")}
        if not state:
            raise SystemExit("the peer's backend gathered no draft_model.* weights: its layout changed")
        draft.save_pretrained(args.out, state_dict=state)
    saved = json.loads((args.out / "config.json").read_text())
    saved["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in store.aux_layer_ids],
                             "use_aux_hidden_state": True}  # SGLang's ids: eyas' minus one (eyas/model/layouts.py)
    (args.out / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    return {"steps": steps, "seconds": seconds, "loss": loss, "version": peer.version()}


def main() -> None:
    started = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer-src", type=Path, required=True, help="a SpecForge tree holding the specforge package")
    ap.add_argument("--store", type=Path, required=True, help="the eyas store both sides train on")
    ap.add_argument("--model", default="smollm2", help="the target (its config shapes the draft)")
    ap.add_argument("--out", type=Path, required=True, help="where its draft is written")
    ap.add_argument("--budget-s", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1, help="its schedule's length (its default num_epochs: 1)")
    ap.add_argument("--draft-vocab", type=int, default=32000, help="its default draft_vocab_size")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    done = train(args, started)
    (args.out / "peer_run.json").write_text(json.dumps(done) + "\n")
    print(f"peer: SpecForge {done['version']}, {done['steps']} steps in {done['seconds']:.1f}s, last loss "
          f"{done['loss']:.3f}; draft in {args.out}", flush=True)


if __name__ == "__main__":
    main()
