"""Where in a reply does the draft agree with the target? Teacher-forced draft accuracy by position.

    python3 benchmarks/acceptance_by_position.py --draft DRAFT --data regen.jsonl --samples 12
    python3 benchmarks/acceptance_by_position.py --smoke     # CPU: untrained draft, 2 conversations

Training reports one accuracy per TTT step, averaged over every assistant token of every turn. A
decoding benchmark like MT-Bench at 192 new tokens only sees the start of each reply. This script
runs the target over real conversations (their replies as written, e.g. the target's own rewrite),
then the draft unrolled exactly as in training (eyas.train.ttt: TTT attention, the step's own
previous output fed back), and splits the draft's agreement with the target's argmax by the
predicted token's position inside its reply. The last column compares each band with all tokens:
if the figures fall well below 1 early in a reply, training accuracy overstates what a short
decoding benchmark will see (and where the draft needs more or better data).

A second table splits step 0 by how sure the target itself was of the predicted token (its top-1
probability there), in the first band and over all reply tokens: if the draft's misses sit where
the target nearly tied between tokens, a better draft of the same kind gains little at
temperature 0, and trees (which verify several candidates) are the lever.

Several `--draft` options measure the drafts on the same tokens and end with a side-by-side table
of step 0, each draft against the first, e.g. two trainings that differ in one option:

    python3 benchmarks/acceptance_by_position.py --draft soft/draft --draft hard/draft --data regen.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.assets import resolve_model  # noqa: E402
from eyas.data.chat import ChatEncoder  # noqa: E402
from eyas.data.readers import BadRow, SkipLog, read_conversations  # noqa: E402
from eyas.eval.target import HFTarget  # noqa: E402
from eyas.generate import load_generator  # noqa: E402
from eyas.model.attention import TTTAttention  # noqa: E402
from eyas.recipes.evaluate import load_draft  # noqa: E402
from eyas.train.ttt import shift_left  # noqa: E402
from eyas.utils.io import EyasError  # noqa: E402


def encode_turns(encoder: ChatEncoder, convs: list[list[dict]], turns: int, where: str, log: SkipLog) -> list:
    """The first `turns` user/assistant pairs of each conversation, encoded as `prepare` does; a
    conversation that cannot be used goes to `log`, and none usable is an error naming `where`."""
    encoded = []
    for i, messages in enumerate(convs):
        keep, seen = [], 0
        for m in messages:
            seen += m["role"] == "user"
            if seen > turns:
                break
            keep.append(m)
        try:
            encoded.append(encoder.encode(keep))
        except BadRow as e:
            log.add(e.reason, f"{where}: conversation {i + 1}", e.detail)
    if not encoded:
        raise EyasError(f"{where}: no conversation with an assistant reply to measure; give chat data with "
                        "replies (e.g. `eyas regenerate` output)" + ("; skipped: " + "; ".join(log.lines())
                                                                     if log.total else ""))
    return encoded


def reply_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[T] 0/1 -> [T]: index of each assistant token inside its reply (a run of ones), -1 elsewhere."""
    pos = torch.full_like(loss_mask, -1, dtype=torch.long)
    run = -1
    for t, m in enumerate(loss_mask.tolist()):
        run = run + 1 if m else -1
        pos[t] = run
    return pos


CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.9)  # bins of the target's top-1 probability: < 0.3, ..., >= 0.9


@torch.inference_mode()
def measure(draft, target: HFTarget, encoded: list, steps: int, band: int, bands: int) -> tuple[torch.Tensor, ...]:
    """-> correct and count [bands + 2, steps] (rows: the bands, the open last band, all tokens),
    [2]: reply tokens that are the target's own argmax, reply tokens, and step 0's correct and count
    [2, len(CONFIDENCE_EDGES) + 1] (rows: the first band, all tokens; columns: confidence bins)."""
    d2t_ids = draft.d2t + torch.arange(draft.d2t.numel(), device=draft.d2t.device)
    correct, count = torch.zeros(bands + 2, steps), torch.zeros(bands + 2, steps)
    nbins = len(CONFIDENCE_EDGES) + 1
    by_conf, n_conf = torch.zeros(2, nbins), torch.zeros(2, nbins)
    edges = torch.tensor(CONFIDENCE_EDGES)
    agree = torch.zeros(2)
    dev = target.device
    for enc in encoded:
        ids = torch.as_tensor(enc.input_ids, dtype=torch.long, device=dev)[None]  # [1, T]
        T = ids.shape[1]
        logits, aux = target.forward(ids, torch.arange(T, device=dev)[None], target.new_cache())
        tgt = logits.argmax(-1).cpu()  # [T]: the target's next token after position t
        top1 = torch.softmax(logits.float(), -1).amax(-1).cpu()  # [T]: the target's probability of it
        mask = torch.as_tensor(enc.loss_mask, dtype=torch.long)
        where = reply_positions(mask)
        agree += torch.tensor([float((tgt[:-1] == ids[0, 1:].cpu())[mask[1:] == 1].sum()), float(mask[1:].sum())])
        hidden = draft.fuse(aux[None])
        attend = TTTAttention("math")
        positions = torch.arange(T, device=dev)[None]
        for j in range(steps):
            hidden = draft(shift_left(ids, 1 + j), hidden, positions + j, attend)  # row t predicts token t+2+j
            pred = d2t_ids[draft.logits(hidden)[0].argmax(-1)].cpu()
            rows = torch.arange(T - 2 - j)
            tok = rows + 2 + j  # the predicted token's index
            ok = mask[tok] == 1
            rows, tok = rows[ok], tok[ok]
            hit = (pred[rows] == tgt[rows + 1 + j]).float()
            b = (where[tok] // band).clamp(max=bands)
            correct[:, j] += torch.zeros(bands + 2).index_add_(0, b, hit)
            count[:, j] += torch.bincount(b, minlength=bands + 2).float()
            if j == 0:
                conf = torch.bucketize(top1[rows + 1], edges, right=True)  # [n] bin of each prediction
                for r, keep in enumerate((b == 0, torch.ones_like(b, dtype=torch.bool))):
                    by_conf[r] += torch.zeros(nbins).index_add_(0, conf[keep], hit[keep])
                    n_conf[r] += torch.bincount(conf[keep], minlength=nbins).float()
    correct[-1], count[-1] = correct[:-1].sum(0), count[:-1].sum(0)
    return correct, count, agree, by_conf, n_conf


def print_tables(name: str, n_conv: int, skipped: int, steps: int, band: int, bands: int, correct, count, agree,
                 by_conf, n_conf) -> None:
    acc = correct / count.clamp_min(1)
    print(f"{n_conv} conversations, {int(count[-1, 0]):,} reply tokens; draft {name}; "
          f"the data's token is the target's argmax for {agree[0] / max(agree[1], 1):.1%} of them"
          + (f"; {skipped} conversations skipped" if skipped else ""))
    head = " | ".join(f"step {j}" for j in range(steps))
    print(f"| reply tokens | tokens | {head} | step 0 vs all |")
    print("|" + " --- |" * 2 + " ---: |" * (steps + 1))
    for b, label in enumerate(band_names(band, bands)):
        cells = " | ".join(f"{a:.2f}" for a in acc[b].tolist())
        print(f"| {label} | {int(count[b, 0]):,} | {cells} | {acc[b, 0] / acc[-1, 0].clamp_min(1e-9):.2f}x |")
    print()
    print("Step 0 by the target's top-1 probability at the predicted token: share of tokens, agreement, share "
          "of all misses")
    print("| tokens | " + " | ".join(confidence_names()) + " |")
    print("|" + " --- |" * (len(CONFIDENCE_EDGES) + 2))
    for r, label in enumerate((f"reply tokens 0-{band - 1}", "all reply tokens")):
        n, hit = n_conf[r], by_conf[r]
        miss = n - hit
        cells = (f"{n[i] / n.sum().clamp_min(1):.2f} / {hit[i] / n[i].clamp_min(1):.2f} / "
                 f"{miss[i] / miss.sum().clamp_min(1):.2f}" for i in range(len(CONFIDENCE_EDGES) + 1))
        print(f"| {label} | " + " | ".join(cells) + " |")
    print()


def band_names(band: int, bands: int) -> list[str]:
    return [*(f"{b * band}-{(b + 1) * band - 1}" for b in range(bands)), f">= {bands * band}", "all"]


def confidence_names() -> list[str]:
    lo = ("0", *(f"{e:g}" for e in CONFIDENCE_EDGES))
    hi = (*(f"{e:g}" for e in CONFIDENCE_EDGES), "1")
    return [f"p {a}-{b}" for a, b in zip(lo, hi, strict=True)]


def step0_row(correct, count, by_conf, n_conf) -> torch.Tensor:
    """Step-0 agreement: the reply-position bands (first band, all tokens) then the confidence bins of
    the first band: the figures the side-by-side table compares."""
    bands = correct[:, 0] / count[:, 0].clamp_min(1)
    return torch.cat([bands[[0, -1]], by_conf[0] / n_conf[0].clamp_min(1)])


def print_comparison(names: list[str], rows: list[torch.Tensor], band: int) -> None:
    cols = [f"0-{band - 1}", "all", *(f"0-{band - 1}, {c}" for c in confidence_names())]
    print("Step 0 agreement side by side (reply tokens; the first band split by the target's top-1 probability), "
          f"and each draft against the first ({names[0]})")
    print("| draft | " + " | ".join(cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    for name, row in zip(names, rows, strict=True):
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in row.tolist()) + " |")
    for name, row in zip(names[1:], rows[1:], strict=True):
        ratio = row / rows[0].clamp_min(1e-9)
        print(f"| {name} / first | " + " | ".join(f"{v:.2f}x" for v in ratio.tolist()) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", action="append", help="draft folder, or `random` (untrained); repeat to compare "
                    "drafts on the same tokens [random]")
    ap.add_argument("--model", default="smollm2", help="target folder or alias [smollm2]")
    ap.add_argument("--data", help="chat file with assistant replies (ShareGPT / messages JSONL, as prepare reads)")
    ap.add_argument("--samples", type=int, default=12, help="conversations to use (the first N) [12]")
    ap.add_argument("--turns", type=int, default=1, help="user/assistant turn pairs kept per conversation [1]")
    ap.add_argument("--steps", type=int, default=7, help="TTT steps to unroll [7]")
    ap.add_argument("--band", type=int, default=64, help="reply tokens per band [64]")
    ap.add_argument("--bands", type=int, default=3, help="bands before the last, open one [3]")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", help="float32 (exact, CPU) or bfloat16")
    ap.add_argument("--smoke", action="store_true", help="untrained draft on 2 made-up conversations")
    args = ap.parse_args()
    drafts = args.draft or ["random"]

    log = SkipLog()
    if args.smoke:
        convs = [[{"role": "user", "content": "Name three colors."},
                  {"role": "assistant", "content": "Red, green and blue. " * 12}],
                 [{"role": "user", "content": "Count to ten."},
                  {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 10"}]]
        drafts, args.band, args.bands = ["random"], 16, 2
    elif not args.data:
        ap.error("--data is required (or --smoke)")
    else:
        convs = read_conversations([args.data], log)[: args.samples]
    target_path = resolve_model(args.model)
    model, tokenizer = load_generator(target_path, args.dtype)
    try:
        encoded = encode_turns(ChatEncoder(tokenizer, max_length=args.max_length), convs, args.turns,
                               args.data or "--smoke", log)
    except EyasError as e:
        sys.exit(f"error: {e}")
    rows = []
    for name in drafts:
        draft = load_draft(name, target_path, model, model.device, model.dtype).eval()
        target = HFTarget(model, list(draft.config.aux_layer_ids))
        try:
            correct, count, agree, by_conf, n_conf = measure(draft, target, encoded, args.steps, args.band,
                                                             args.bands)
        finally:
            target.close()
        print_tables(name, len(encoded), log.total, args.steps, args.band, args.bands, correct, count, agree,
                     by_conf, n_conf)
        rows.append(step0_row(correct, count, by_conf, n_conf))
    if len(drafts) > 1:
        print_comparison(drafts, rows, args.band)


if __name__ == "__main__":
    main()
