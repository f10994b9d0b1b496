"""Preflight: a few samples through the user's own target before hours of `extract`, online `train` or
`regenerate`, checked against facts a wrong engine cannot fake.

Peers shipped hidden-state bugs that train a draft on wrong states without any error: the final state
taken after the norm (vLLM #46788, TorchSpec #87), samples mixed at batch > 1 (speculators #279), a
tensor-parallel worker's reply taken for rank 0's. Each shows on a handful of samples, so the long
stages run these checks first (on by default, `--no-preflight` skips them) and stop naming the fault:

- `nonfinite`:        a state is NaN or inf;
- `aux_layer_shift`:  aux id k's state is transformers' `hidden_states[k±1]`, not `hidden_states[k]`;
- `aux_state`:        aux id k's state matches no layer of the reference;
- `final_post_norm`:  the final state is the final norm's output, not its input;
- `final_head`:       the target's own head (norm + lm_head) on the final state does not give the
                      model's own greedy next token, or gives logits that are not finite;
- `head_weights`:     the final norm or lm_head is all zeros or holds NaN/inf (a damaged checkpoint);
- `batch`:            a sample's states change when it shares a ragged batch with others;
- `tp_rank`:          at tensor parallel > 1, states that disagree with the facts no rank can change
                      (the reference forward, the head's argmax): a worker's reply taken for rank 0's.

Samples with images go through with their images (the engine's vision tower and the reference's), whole.
Weights a checkpoint lacks are refused when the target loads (`eyas.engines.hf.load_hf_model`), so the
reference is the checkpoint, not what transformers filled in.

The engine runs the samples as one ragged batch, as the stages run it (and each alone too when that
batch fails, to tell a batch fault from a fault of the states, or when there is no reference). The
reference is a plain transformers forward with `output_hidden_states`, one sample at a time: the hf
engine's own module, or for other engines a float32 copy loaded on the CPU when the weights take at most
`REFERENCE_MAX_BYTES` (bigger targets skip the checks that need it, and the log says so; their final
state is then checked against the engine's own greedy token, `TargetEngine.last_greedy`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eyas.data.media import SampleMedia
from eyas.engines.base import Capture, TargetEngine
from eyas.engines.decoder import find_text_decoder
from eyas.engines.head import TargetHead
from eyas.utils.io import EyasError, human_bytes

REFERENCE_MAX_BYTES = 2 << 30  # a CPU reference of ~1B parameters loads and runs well within the 60 s budget
SAMPLE_TOKENS = (64, 47, 33, 20)  # the samples are cut to these lengths: a ragged batch of at most 164 tokens
MAX_DISAGREE = 0.1  # fraction of positions where the head may miss the reference's argmax (near-ties)


@dataclass(frozen=True)
class Tolerance:
    """How far two computations of the same state may differ, by the precision they ran in."""

    states: float  # mean per-token relative error
    tie: float  # a token whose reference logit is within tie * std(logits) of the best counts as the argmax


EXACT = Tolerance(states=1e-3, tie=1e-2)  # float32 on both sides
HALF = Tolerance(states=0.1, tie=0.1)  # bf16/fp16 somewhere: bf16 rounding compounds over the layers


@dataclass
class Fault:
    kind: str
    message: str


class PreflightError(EyasError):
    """The preflight found faults; `.faults` names each (`Fault.kind`)."""

    def __init__(self, what: str, faults: list[Fault]) -> None:
        self.faults = faults
        lines = "\n".join(f"  - [{f.kind}] {f.message}" for f in faults)
        super().__init__(f"preflight of {what} failed:\n{lines}\nA draft trained on these states would learn the "
                         "wrong target, so the stage stops before the long run. --no-preflight skips this check "
                         "(not advised).")

    @property
    def kinds(self) -> list[str]:
        return [f.kind for f in self.faults]


# ---------------------------------------------------------------------------------------------
# samples and the reference forward
# ---------------------------------------------------------------------------------------------


def preflight_samples(dataset: Any) -> list[torch.Tensor]:
    """The first four non-empty samples of `dataset` (items with `input_ids`), cut to distinct lengths."""
    return preflight_inputs(dataset)[0]


def preflight_inputs(dataset: Any) -> tuple[list[torch.Tensor], list[SampleMedia | None] | None]:
    """(the first four non-empty samples of `dataset`, text cut to distinct lengths; their images, or None
    for a dataset without any). A sample with images is kept whole: a cut could split an image's tokens."""
    with_media = bool(getattr(dataset, "has_media", False))
    seqs: list[torch.Tensor] = []
    media: list[SampleMedia | None] = []
    for i in range(len(dataset)):
        ids = torch.as_tensor(dataset[i]["input_ids"]).long()
        if ids.numel():
            m = dataset.media(i) if with_media else None
            media.append(m)
            seqs.append(ids if m is not None else ids[:SAMPLE_TOKENS[len(seqs)]])
        if len(seqs) == len(SAMPLE_TOKENS):
            break
    if len(seqs) == 1 and seqs[0].numel() >= 2 and media[0] is None:  # one sample: batch it with its first half
        seqs.append(seqs[0][: seqs[0].numel() // 2])
        media.append(None)
    if len(seqs) > 1 and len({s.numel() for s in seqs}) == 1 and seqs[-1].numel() >= 2 and media[-1] is None:
        seqs[-1] = seqs[-1][:-1]  # a ragged batch, so padding is exercised
    return seqs, (media if any(m is not None for m in media) else None)


@dataclass
class Reference:
    """A plain transformers forward of each sample alone."""

    layers: list[dict[int, torch.Tensor]]  # per sample: id -> [T, H]; id < N: hidden_states[id]; N: the norm's input
    post_norm: list[torch.Tensor | None]  # per sample [T, H]: the final norm's output
    logits: list[torch.Tensor]  # per sample [T, V]: the model's own logits
    exact: bool  # ran in float32


def reference_model(engine: TargetEngine, trust_remote_code: bool = False,
                    allow_missing_weights: bool = False) -> tuple[nn.Module | None, str]:
    """The module the reference runs: the hf engine's own; for other engines a float32 CPU copy of a target
    small enough to load next to it. (None, why) when there is none."""
    own = getattr(engine, "model", None)
    if isinstance(own, nn.Module):
        return own, ""
    folder = getattr(engine, "model_dir", None)
    if folder is None:
        return None, f"the {engine.name} engine names no model folder"
    return load_reference_copy(folder, trust_remote_code, allow_missing_weights)


def load_reference_copy(folder: str | Path, trust_remote_code: bool = False,
                        allow_missing_weights: bool = False) -> tuple[nn.Module | None, str]:
    """A float32 CPU transformers copy of the target in `folder`, or (None, why) when it is too big or fails.
    A checkpoint that lacks weights is an error (MissingWeightsError), unless `allow_missing_weights`."""
    d = Path(folder)
    if not d.is_dir():
        return None, f"{folder} is not a local folder"
    size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    if size > REFERENCE_MAX_BYTES:
        return None, (f"its weights ({human_bytes(size)}) are more than the {human_bytes(REFERENCE_MAX_BYTES)} a "
                      "CPU reference loads within the preflight's time")
    from eyas.engines.hf import load_hf_model
    from eyas.engines.weights import MissingWeightsError

    try:
        return load_hf_model(str(d), torch.float32, torch.device("cpu"), trust_remote_code=trust_remote_code,
                             allow_missing_weights=allow_missing_weights).eval(), ""
    except MissingWeightsError:
        raise
    except Exception as e:  # noqa: BLE001 - the reference is optional: its checks are skipped and the log says why
        return None, f"transformers cannot load it on the CPU ({type(e).__name__}: {str(e)[:200]})"


@torch.inference_mode()
def reference_forward(model: nn.Module, seqs: list[torch.Tensor], layer_ids: set[int], num_layers: int,
                      media: list[SampleMedia | None] | None = None) -> Reference:
    """hidden_states[k] for `layer_ids` below `num_layers`, the final norm's input (as id `num_layers`) and
    output, and the logits, each sample run alone (with its images: `media[i]`)."""
    _, _, norm = find_text_decoder(model)
    seen: dict[str, torch.Tensor] = {}
    hooks = [] if norm is None else [
        norm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("pre", args[0])),
        norm.register_forward_hook(lambda _m, _args, out: seen.__setitem__("post", out))]
    device = model.get_input_embeddings().weight.device
    dtype = next(model.parameters()).dtype
    ref = Reference([], [], [], exact=dtype == torch.float32)
    try:
        for s, m in zip(seqs, media or [None] * len(seqs), strict=True):
            seen.clear()
            images = {} if m is None else m.model_inputs(dtype, device)
            out = model(input_ids=s[None].to(device), output_hidden_states=True, use_cache=False, **images)
            layers = {k: out.hidden_states[k][0].float().cpu() for k in layer_ids if k < num_layers}
            if "pre" in seen:
                layers[num_layers] = seen["pre"].reshape(-1, seen["pre"].shape[-1]).float().cpu()
            ref.layers.append(layers)
            post = seen.get("post")
            ref.post_norm.append(None if post is None else post.reshape(-1, post.shape[-1]).float().cpu())
            ref.logits.append(out.logits[0].float().cpu())
    finally:
        for h in hooks:
            h.remove()
    return ref


# ---------------------------------------------------------------------------------------------
# the checks: each returns the faults it found
# ---------------------------------------------------------------------------------------------


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean over tokens of |got_t - want_t| / |want_t|."""
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-12)).mean())


def _layer_name(k: int, num_layers: int) -> str:
    return f"hidden_states[{k}]" if k < num_layers else "the last decoder layer's output"


def check_finite(caps: list[Capture], aux_layer_ids: list[int], where: str) -> list[Fault]:
    """Every value of every state is finite."""
    hidden = caps[0].final.shape[-1]
    for i, c in enumerate(caps):
        for name, t in (("aux", c.aux), ("final", c.final)):
            bad = (~torch.isfinite(t)).nonzero()
            if len(bad):
                row, col = bad[0].tolist()
                what = "the final state" if name == "final" else f"aux layer {aux_layer_ids[col // hidden]}'s state"
                return [Fault("nonfinite", f"{what} of sample {i} ({where}) holds {len(bad)} NaN/inf value(s), the "
                              f"first at token {row}: the target overflows in this dtype, or the engine reads "
                              "memory it did not write")]
    return []


def check_aux(caps: list[Capture], ref: Reference, aux_layer_ids: list[int], num_layers: int, tol: Tolerance
              ) -> list[Fault]:
    """Aux id k's state is transformers' hidden_states[k]; a state that is k±1's is named a shift."""
    hidden, faults = caps[0].final.shape[-1], []
    for j, k in enumerate(aux_layer_ids):
        got = [c.aux[:, j * hidden:(j + 1) * hidden] for c in caps]
        err = {m: sum(_rel(g, r[m]) for g, r in zip(got, ref.layers, strict=True)) / len(got)
               for m in (k - 1, k, k + 1) if m in ref.layers[0]}
        best = min(err, key=err.get)
        if best != k and err[best] <= tol.states and err[best] < 0.5 * err[k]:
            faults.append(Fault("aux_layer_shift", f"aux layer id {k}: the engine's state is "
                                f"{_layer_name(best, num_layers)} (rel err {err[best]:.1e}), not hidden_states[{k}] "
                                f"(rel err {err[k]:.1e}): the layer ids are off by {best - k:+d}. Id k must be the "
                                "INPUT of decoder layer k (transformers' hidden_states[k], the embeddings are id 0)"))
        elif err[k] > tol.states:
            faults.append(Fault("aux_state", f"aux layer id {k}: the engine's state matches no layer of the reference "
                                f"(rel err {err[k]:.1e} against hidden_states[{k}], tolerance {tol.states:.0e})"))
    return faults


def _looks_normalized(finals: list[torch.Tensor], head: TargetHead) -> bool:
    """Without a reference: every token's state divided by the norm's weight has rms 1, as a normed state does."""
    w = head.norm_weight.float() + head.norm_offset
    keep = w.abs() > 1e-3 * w.abs().max()
    rms = torch.cat([(f[:, keep] / w[keep]).pow(2).mean(-1).sqrt() for f in finals])
    return bool((rms - 1).abs().median() < 0.02)


def misses_argmax(logits: torch.Tensor, tokens: torch.Tensor, tie: float) -> torch.Tensor:
    """[n] True where `tokens` is not the argmax of `logits` [n, V], near-ties (within tie * std) forgiven."""
    best = logits.max(-1).values
    return logits.gather(-1, tokens[:, None].to(logits.device))[:, 0] < best - tie * logits.std(-1)


def check_head(head: TargetHead) -> list[Fault]:
    """The final norm's effective weight and the lm_head are finite and not all zeros: a head that is would
    give NaN or constant logits, whose argmax agrees with anything."""
    faults = []
    norm = head.norm_weight.float() + head.norm_offset
    for name, w in (("the final norm's weight", norm), ("lm_head", head.lm_head)):
        parts = w.reshape(-1, w.shape[-1]).split(4096)  # a 160k x 7k head is checked without a float32 copy
        bad = sum(int((~torch.isfinite(p)).sum()) for p in parts)
        if bad:
            faults.append(Fault("head_weights", f"{name} holds {bad} NaN/inf value(s): the checkpoint is damaged, "
                                "and every logit of the target (and of a draft trained on it) would be NaN"))
        elif not any(bool(p.any()) for p in parts):
            faults.append(Fault("head_weights", f"{name} is all zeros: every logit would be the same, so the target "
                                "has no next token to teach; the checkpoint is damaged or was saved without it"))
    return faults


def check_final(caps: list[Capture], ref: Reference | None, head: TargetHead, greedy: list[int | None],
                num_layers: int, tol: Tolerance) -> list[Fault]:
    """The final state is the norm's input, and the target's head on it gives the model's own next token."""
    finals = [c.final for c in caps]
    if ref is not None and ref.post_norm[0] is not None and num_layers in ref.layers[0]:
        e_pre = sum(_rel(f, r[num_layers]) for f, r in zip(finals, ref.layers, strict=True)) / len(finals)
        e_post = sum(_rel(f, p) for f, p in zip(finals, ref.post_norm, strict=True)) / len(finals)
        post_norm = e_post <= tol.states and e_post < 0.5 * e_pre
    else:
        post_norm = _looks_normalized(finals, head)
    if post_norm:
        return [Fault("final_post_norm", "the final state is the final norm's OUTPUT; it must be the last decoder "
                      "layer's output BEFORE the norm (the trainer applies the target's norm and lm_head itself)")]
    head = head.to("cpu", torch.float32)
    if ref is not None:
        logits = [head.logits(f) for f in finals]
        for name, rows in (("the target's head on the final states", logits), ("the model's own forward", ref.logits)):
            if not all(bool(torch.isfinite(x).all()) for x in rows):
                return [Fault("final_head", f"{name} gives logits that are not finite (NaN/inf) from finite states")]
        picks = [x.argmax(-1) for x in logits]
        misses = torch.cat([misses_argmax(r, p, tol.tie) for r, p in zip(ref.logits, picks, strict=True)])
        source = "the model's own logits (plain transformers forward)"
    else:  # the engine's own greedy token after each sequence
        rows = [(f[-1:], g) for f, g in zip(finals, greedy, strict=True) if g is not None]
        if not rows:
            return []
        last = head.logits(torch.cat([r for r, _ in rows]))
        if not bool(torch.isfinite(last).all()):
            return [Fault("final_head", "the target's head on the final states gives logits that are not finite "
                          "(NaN/inf) from finite states")]
        misses = misses_argmax(last, torch.tensor([g for _, g in rows]), tol.tie)
        source = "the engine's own greedy next token"
    if misses.float().mean() > MAX_DISAGREE:
        return [Fault("final_head", f"the target's head (norm + lm_head) on the final state picks the token of "
                      f"{source} at only {int((~misses).sum())} of {misses.numel()} positions: the final state "
                      "is not the last decoder layer's pre-norm output")]
    return []


def check_batch(alone: list[Capture], batched: list[Capture], tol: Tolerance) -> list[Fault]:
    """Each sample's states in a ragged batch equal its states alone."""
    errs = [max(_rel(b.aux, a.aux), _rel(b.final, a.final)) for a, b in zip(alone, batched, strict=True)]
    worst = max(range(len(errs)), key=errs.__getitem__)
    if errs[worst] <= tol.states:
        return []
    lengths = [a.final.shape[0] for a in alone]
    return [Fault("batch", f"sample {worst}'s states change when it shares a ragged batch (lengths {lengths}) with "
                  f"others (rel err {errs[worst]:.1e} against the same sample alone): samples are mixed across the "
                  "batch (padding, row offsets or request order)")]


def _as_tp_fault(faults: list[Fault], tp: int) -> list[Fault]:
    """At tp > 1, states that match nothing the reference has are one fault: a rank's reply taken for rank 0's."""
    odd = [f for f in faults if f.kind in ("aux_state", "final_head")]
    if tp <= 1 or not odd:
        return faults
    what = "; ".join(f.message for f in odd)
    return [f for f in faults if f not in odd] + [Fault("tp_rank", (
        f"at tensor parallel {tp} the states disagree with what no rank can change ({what}): a tensor-parallel "
        "worker's reply is taken for rank 0's, or a rank's partial (not all-reduced) tensor is read. Compare with "
        "--tp 1 on a smaller target of the same family"))]


# ---------------------------------------------------------------------------------------------
# the engine's preflight
# ---------------------------------------------------------------------------------------------


def _capture(engine: TargetEngine, seqs: list[torch.Tensor], media: list[SampleMedia | None] | None
             ) -> tuple[list[Capture], list[int | None], torch.dtype]:
    """The states on the CPU in float32, the engine's own greedy next token after each sequence, its dtype."""
    flat = engine.capture_flat(seqs) if media is None else engine.capture_flat(seqs, media)
    caps = [Capture(c.aux.float().cpu(), c.final.float().cpu()) for c in flat.split()]
    greedy = list(engine.last_greedy) if engine.last_greedy is not None else [None] * len(seqs)
    return caps, greedy, flat.final.dtype


def _capture_alone(engine: TargetEngine, seqs: list[torch.Tensor], media: list[SampleMedia | None] | None
                   ) -> tuple[list[Capture], list[int | None]]:
    caps, greedy = [], []
    for i, s in enumerate(seqs):
        c, g, _ = _capture(engine, [s], None if media is None else [media[i]])
        caps += c
        greedy += g
    return caps, greedy


def _state_faults(caps: list[Capture], greedy: list[int | None], engine: TargetEngine, ref: Reference | None,
                  tol: Tolerance, where: str) -> list[Fault]:
    """Every check of the states themselves (not of the batch), tensor-parallel mismatches named as such."""
    faults = check_finite(caps, engine.aux_layer_ids, where)
    if faults:
        return faults
    head = engine.target_head()
    faults = check_head(head)
    if faults:
        return faults
    if ref is not None:
        faults = check_aux(caps, ref, engine.aux_layer_ids, engine.num_layers, tol)
    faults += check_final(caps, ref, head, greedy, engine.num_layers, tol)
    return _as_tp_fault(faults, engine.tp)


def preflight_engine(engine: TargetEngine, seqs: list[torch.Tensor], *, media: list[SampleMedia | None] | None = None,
                     trust_remote_code: bool = False, allow_missing_weights: bool = False,
                     log: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Run `seqs` (with their images, `media[i]`) through `engine` as one ragged batch (as the stages do) and
    check the states against the reference, each sample run alone; raise PreflightError naming every
    fault, else log one line.

    Samples are also captured alone by the engine when the batch fails (to tell a batch fault from a
    fault of the states themselves) or when there is no reference (then batch invariance is checked
    engine against engine)."""
    if not seqs:
        raise EyasError("preflight: no non-empty sample to run; the dataset is empty")
    t0, what = time.perf_counter(), f"the {engine.name} engine's states"
    batched, greedy, dtype = _capture(engine, seqs, media)
    nonfinite = check_finite(batched, engine.aux_layer_ids, "in a batch")
    if nonfinite:
        raise PreflightError(what, nonfinite)
    model, why = reference_model(engine, trust_remote_code, allow_missing_weights)
    near = {m for k in engine.aux_layer_ids for m in (k - 1, k, k + 1) if m >= 0}  # each id and its neighbours
    ref = None if model is None else reference_forward(model, seqs, near, engine.num_layers, media)
    del model  # a CPU copy is freed before the long run
    tol = EXACT if dtype == torch.float32 and (ref is None or ref.exact) else HALF
    faults = _state_faults(batched, greedy, engine, ref, tol, "in a batch")
    if (faults or ref is None) and len(seqs) > 1:
        alone, greedy_alone = _capture_alone(engine, seqs, media)
        batch = check_batch(alone, batched, tol)
        if batch:  # the batch explains the batched states' faults, unless the states alone have them too
            faults = _state_faults(alone, greedy_alone, engine, ref, tol, "alone") + batch
    if faults:
        raise PreflightError(what, faults)
    skipped = [] if ref is not None else [f"aux ids against transformers (no reference: {why})"]
    seconds = time.perf_counter() - t0
    if log is not None:
        log(f"preflight: {len(seqs)} samples ({sum(len(s) for s in seqs)} tokens) through the {engine.name} engine "
            f"in {seconds:.1f}s" + (f" ({sum(m is not None for m in media)} with images)" if media else "") +
            f": aux ids {engine.aux_layer_ids}, pre-norm final state, greedy head, head weights, batch "
            "invariance and finite values checked" + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    return {"seconds": seconds, "reference": ref is not None, "skipped": skipped}
