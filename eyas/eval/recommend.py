"""What to serve at which concurrency: the fastest method at each batch size measured, the target alone included.

Serving engines take one speculation setting for every load, and the same draft that doubles batch-1 speed can
slow a full batch down. From the serving rows (eyas.eval.serving) this picks, per batch size, the fastest of
the target alone and every method whose speedup the timing could give (eyas.eval.timing); "don't speculate"
(the target alone) wins wherever no method beat it. It says from which concurrency on speculation stops
paying, and prints the engines' serve commands for the concurrency the user serves at, through the export
writers' own printers (eyas.export), so a recommendation serves exactly what an export would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eyas.eval.metrics import BASELINE
from eyas.eval.proposer_base import ChainSpec, TreeSpec
from eyas.eval.serving import batch_sizes_of
from eyas.export.families import family_writer, serve_command_in
from eyas.export.writers import sglang_eagle_flags
from eyas.model.config import DraftConfig
from eyas.utils.io import EyasError


@dataclass(frozen=True)
class Choice:
    """The fastest way to decode at one batch size: a method, the target alone (BASELINE), or None where the
    timing was too noisy to tell (then `note` says why)."""

    batch_size: int
    method: str | None
    speedup: float | None
    note: str | None = None


def choose(rows: Sequence[dict[str, Any]]) -> list[Choice]:
    """One Choice per batch size that measured the target alone."""
    out = []
    for b in batch_sizes_of(rows):
        at = [r for r in rows if r["batch_size"] == b]
        if not any(r["method"] == BASELINE and r.get("tokens_per_s") for r in at):
            continue
        timed = [r for r in at if r["method"] != BASELINE and r["speedup"] is not None]
        best = max(timed, key=lambda r: r["speedup"]) if timed else None
        noisy = [r for r in at if r.get("speedup_note")]
        if best is not None and best["speedup"] > 1.0:
            out.append(Choice(b, best["method"], float(best["speedup"])))
        elif noisy:  # a method whose timing is unknown might have beaten the target alone
            out.append(Choice(b, None, None, f"{noisy[0]['method']}: {noisy[0]['speedup_note']}"))
        else:
            out.append(Choice(b, BASELINE, 1.0))
    return out


def stops_paying(choices: Sequence[Choice]) -> int | None:
    """The smallest batch size from which on the target alone was fastest at every size measured (None when a
    method paid at the largest, or the timing there was too noisy)."""
    at = None
    for c in sorted(choices, key=lambda c: c.batch_size, reverse=True):
        if c.method != BASELINE:
            break
        at = c.batch_size
    return at


def choice_at(choices: Sequence[Choice], serve_at: int | None) -> Choice | None:
    """The choice for serving at `serve_at` requests in flight: the largest batch size measured at or below it
    (the smallest measured when it is below them all; the largest measured when None)."""
    if not choices:
        return None
    ordered = sorted(choices, key=lambda c: c.batch_size)
    if serve_at is None:
        return ordered[-1]
    below = [c for c in ordered if c.batch_size <= serve_at]
    return below[-1] if below else ordered[0]


def method_of(name: str) -> ChainSpec | TreeSpec | None:
    """'chain-3' -> ChainSpec(3), 'tree-60:7:10' -> TreeSpec(60, 7, 10), the target alone -> None."""
    if name.startswith("chain-"):
        return ChainSpec(int(name.removeprefix("chain-")))
    if name.startswith("tree-"):
        return TreeSpec.parse(name.removeprefix("tree-"))
    return None


def serve_lines(cfg: DraftConfig | None, folders: dict[str, Path], target: str, method: str,
                rows: Sequence[dict[str, Any]] = (), batch_size: int | None = None) -> list[str]:
    """The serve commands of `method` for each engine the draft's family exports to (`folders`: format -> the
    draft folder that engine loads). vLLM drafts chains only: for a tree it takes the fastest chain measured at
    `batch_size` in `rows`. The target alone: the engines' commands without a draft."""
    if method == BASELINE:
        return [f"vllm serve {target}", f"python -m sglang.launch_server --model-path {target}"]
    spec = method_of(method)
    if cfg is None or spec is None:
        return []
    writer = family_writer(cfg)
    lines = []
    for fmt in ("vllm", "sglang"):
        if fmt not in writer.configs or fmt not in folders:
            continue
        tree_on_vllm = fmt == "vllm" and isinstance(spec, TreeSpec)
        chain = _best_chain(rows, batch_size) if tree_on_vllm else spec if isinstance(spec, ChainSpec) else None
        if tree_on_vllm and chain is None:
            continue
        k = chain.k if chain is not None else spec.depth
        try:
            writer.check(cfg, fmt, k)
        except EyasError:
            continue  # this engine cannot serve this draft (the export says why)
        command = serve_command_in(writer.readme(fmt, folders[fmt], cfg, target, k))
        if command and isinstance(spec, TreeSpec) and fmt == "sglang":
            command = command.replace(sglang_eagle_flags(k, 1, k + 1),
                                      sglang_eagle_flags(spec.depth, spec.top_k, spec.total + 1))
        if command:
            lines.append(command + (f"  # vLLM drafts chains: the fastest chain here, {chain.name}" if tree_on_vllm
                                    else ""))
    return lines


def _best_chain(rows: Sequence[dict[str, Any]], batch_size: int | None) -> ChainSpec | None:
    chains = [r for r in rows if r["batch_size"] == batch_size and r["method"].startswith("chain-")
              and r["speedup"] is not None]
    return method_of(max(chains, key=lambda r: r["speedup"])["method"]) if chains else None  # type: ignore[return-value]


def recommendation(rows: Sequence[dict[str, Any]], serve_at: int | None, cfg: DraftConfig | None,
                   folders: dict[str, Path], target: str) -> dict[str, Any] | None:
    """report.json's `recommendation`: the choice per batch size, where speculation stops paying, and the serve
    commands for `serve_at` (None: the largest batch size measured)."""
    choices = choose(rows)
    pick = choice_at(choices, serve_at)
    if pick is None:
        return None
    serve = serve_lines(cfg, folders, target, pick.method, rows, pick.batch_size) if pick.method else []
    return {"choices": [asdict(c) for c in choices], "stops_paying_at": stops_paying(choices),
            "serve_at": serve_at if serve_at is not None else pick.batch_size, "measured_at": pick.batch_size,
            "method": pick.method, "speedup": pick.speedup, "serve": serve}


def in_words(rec: dict[str, Any]) -> list[str]:
    """The recommendation as sentences (report.md and `eyas run`'s closing words)."""
    choices = [Choice(**c) for c in rec["choices"]]
    lines = []
    for c in choices:
        if c.method is None:
            lines.append(f"At batch size {c.batch_size} the timing was too noisy to give a speedup: {c.note}.")
    paid = [c for c in choices if c.method not in (None, BASELINE)]
    stop = rec.get("stops_paying_at")
    if stop is not None and paid:
        lines.append(f"Speculation stops paying at {stop} requests in flight: from there on the target alone "
                     "decoded fastest.")
    elif stop is not None and stop == min(c.batch_size for c in choices):
        lines.append("Speculation did not pay at any batch size measured: serve the target alone.")
    at, measured = rec["serve_at"], rec["measured_at"]
    where = (f"{at} request{'s' * (at != 1)} in flight" + (f" (measured at {measured})" if measured != at else "")
             + (f" on {rec['device']}" if rec.get("device") else ""))
    if rec["method"] is None:
        lines.append(f"No recommendation for {where}: its timing was too noisy.")
    elif rec["method"] == BASELINE:
        lines.append(f"For {where}, serve without a draft:")
    else:
        lines.append(f"For {where}, serve {rec['method']} ({rec['speedup']:.2f}x the target alone):")
    return lines + [f"  {s}" for s in rec["serve"]]
