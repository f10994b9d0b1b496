"""Evaluation reports: JSON (everything), a Markdown summary and PNG plots, optionally against other runs.

    write_report(result, "eval/", label="my-draft", compare=[("baseline-draft", load_report("old/report.json"))])

Plots (matplotlib Agg, no display needed): acceptance by draft position, tau by prompt set,
tau and speedup against chain length K, and (when several batch sizes were measured) the serving
curve: tokens/s and speedup against batch size, and the fastest method at each batch size
(eyas.eval.recommend). Compared runs are drawn dashed / hatched on the same axes. A speedup the timing
could not have given (eyas.eval.timing) is printed as "too noisy", with the reason below its table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eyas.eval.metrics import BASELINE
from eyas.eval.recommend import Choice
from eyas.eval.recommend import in_words as recommendation_words
from eyas.eval.runner import EvalResult
from eyas.eval.serving import batch_sizes_of, is_curve
from eyas.utils.io import EyasError, atomic_path, atomic_write_json, atomic_write_text, read_json

Compared = Sequence[tuple[str, EvalResult]]


def load_report(path: str | Path) -> EvalResult:
    """A report.json, or the folder holding it."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    try:
        return EvalResult.from_dict(read_json(path))
    except (OSError, ValueError, KeyError) as e:
        raise EyasError(f"cannot read eval report {path}: {e}. Pass a report.json written by `eyas eval`.") from e


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def markdown_summary(result: EvalResult, label: str = "this run", compare: Compared = ()) -> str:
    meta = result.meta
    table = result.table()
    lines = [f"# eyas eval: {label}", ""]
    who = "".join(f"{k} `{meta[k]}`, " for k in ("target", "draft") if meta.get(k))
    lines.append(f"{who}temperature "
                 f"{meta.get('temperature')}, top-p {meta.get('top_p')}, max new tokens {meta.get('max_new_tokens')}, "
                 f"{meta.get('device')} {meta.get('gpu') or ''} {meta.get('dtype')}, "
                 f"backend {meta.get('backend', meta.get('engine', 'hf'))}.")  # reports before the rename: "engine"
    lines += ["", "tau counts the bonus token (EAGLE's acceptance length; vLLM's mean acceptance length). "
              "Speedup is against the target alone on the same prompts in the same run.", ""]
    others = [(name, other.table()) for name, other in compare]
    for set_name, stats in table.items():
        if set_name == "all" and len(table) == 2:
            continue  # one prompt set: "all" repeats it
        gens = stats.get(BASELINE, next(iter(stats.values())))["generations"] if stats else 0
        lines += [f"## {set_name} ({gens} generations)", ""]
        head = ("| method | tau | tokens / target forward | draft forwards / step | tok/s | speedup | "
                "identical to target |")
        sep = "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
        for name, _ in others:
            head += f" tau {name} | Δ tau |"
            sep += " ---: | ---: |"
        lines += [head, sep]
        for method, m in stats.items():
            ident = m["identical_to_target"]
            ident_s = "–" if ident is None else f"{ident:.0%} of {m['compared']}"
            row = (f"| {method} | {_fmt(m['tau'])} | {_fmt(m['tokens_per_target_forward'])} "
                   f"| {_fmt(m.get('draft_forwards_per_step'))} "
                   f"| {_fmt(m['tok_s'], '.1f')} | {_speedup(m)} | {ident_s} |")
            for _, otable in others:
                o = otable.get(set_name, {}).get(method)
                ot = o["tau"] if o else None
                dtau = m["tau"] - ot if (m["tau"] is not None and ot is not None) else None
                row += f" {_fmt(ot)} | {_fmt(dtau, '+.2f')} |"
            lines.append(row)
        lines.append("")
        lines += _noise_notes(stats.values())
    overall = table["all"]
    spec = [(k, v) for k, v in overall.items() if k != BASELINE and v["max_accept"]]
    if spec:
        width = max(v["max_accept"] for _, v in spec)
        lines += ["## Acceptance by draft position (all sets)", "",
                  "Share of verify steps that accepted at least j draft tokens (conditional rate in brackets).", "",
                  "| method | " + " | ".join(f"j={j}" for j in range(1, width + 1)) + " |",
                  "| --- |" + " ---: |" * width]
        for k, v in spec:
            cells = [f"{r:.2f} ({_fmt(c)})"
                     for r, c in zip(v["accept_rate_by_pos"], v["accept_cond_by_pos"], strict=False)]
            lines.append(f"| {k} | " + " | ".join(cells + [""] * (width - len(cells))) + " |")
        lines.append("")
    differs = [k for k, v in overall.items() if v["identical_to_target"] not in (None, 1.0)]
    if differs and meta.get("dtype") in ("bfloat16", "float16"):
        lines += [f"Note: some greedy outputs differ from the target's own ({', '.join(differs)}). In "
                  f"{meta['dtype']}, verifying several tokens in one forward rounds differently from decoding one "
                  "token at a time, and a near-tie argmax can flip even where no draft token is accepted. "
                  "Rerun with `--dtype float32` to check exactness.", ""]
    if is_curve(result.serving):
        lines += serving_table(result.serving)
    if result.recommendation:
        lines += recommendation_section(result.recommendation)
    lines += ["Plots: `acceptance_by_position.png`, `tau_by_prompt_set.png`, `tau_vs_k.png`"
              + (", `serving_curve.png`, `recommendation.png`" if is_curve(result.serving) else "") + ".", ""]
    return "\n".join(lines)


def _speedup(row: dict[str, Any], with_range: bool = False) -> str:
    """'1.39x', '1.39x (1.30-1.45)' with its rounds' range, or 'too noisy' where the timing cannot give one."""
    if row.get("speedup_note"):
        return "too noisy"
    s = row.get("speedup")
    if s is None:
        return "–"
    span = row.get("speedup_range") if with_range and row.get("rounds", 0) > 1 else None
    return f"{s:.2f}x" + (f" ({span[0]:.2f}-{span[1]:.2f})" if span else "")


def _noise_notes(rows: Any) -> list[str]:
    """Why each 'too noisy' above gives no speedup."""
    out = []
    for r in rows:
        if r.get("speedup_note"):
            at = f" at batch size {r['batch_size']}" if "batch_size" in r else ""
            out.append(f"- {r['method']}{at}: the timing was too noisy to give a speedup: {r['speedup_note']}.")
    return [*out, ""] if out else []


def recommendation_section(rec: dict[str, Any]) -> list[str]:
    """The fastest way to decode at each batch size, where speculation stops paying, and the serve commands."""
    lines = ["## Recommendation", "",
             "The fastest way to decode at each batch size measured, the target alone (no draft) included.", "",
             "| batch size | fastest | speedup |", "| ---: | --- | ---: |"]
    for c in (Choice(**c) for c in rec["choices"]):
        name = "target alone (no draft)" if c.method == BASELINE else c.method or "–"
        lines.append(f"| {c.batch_size} | {name} | {'too noisy' if c.method is None else f'{c.speedup:.2f}x'} |")
    words = recommendation_words(rec)
    commands = [w.strip() for w in words if w.startswith("  ")]
    lines += ["", *[w for w in words if not w.startswith("  ")]]
    if commands:
        lines += ["", "```bash", *commands, "```"]
    return [*lines, ""]


def serving_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The serving curve as Markdown: one row per batch size and method."""
    lines = ["## Serving curve (all sets)", "",
             "Every method and the target alone decode the same prompts with this many requests in flight, in "
             "timing rounds that take turns; tok/s counts all of them over the wall-clock time, and speedup is the "
             "median over the rounds of the method against the target alone at the same batch size.", "",
             "| batch size | method | tok/s | speedup (rounds' range) | tokens / target forward "
             "| identical to target |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for b in batch_sizes_of(rows):
        for r in (r for r in rows if r["batch_size"] == b):
            same = r.get("identical")
            lines.append(f"| {b} | {r['method']} | {_fmt(r['tokens_per_s'], '.1f')} | {_speedup(r, True)} | "
                         f"{_fmt(r['tokens_per_forward'])} | {'–' if same is None else format(same, '.0%')} |")
    return [*lines, "", *_noise_notes(rows)]


# -- plots ------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(names: Sequence[str]) -> dict[str, Any]:
    plt = _plt()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {n: cycle[i % len(cycle)] for i, n in enumerate(names)}


def _all_methods(result: EvalResult, compare: Compared) -> list[str]:
    """This run's methods, then any that only a compared run has."""
    out = list(result.methods)
    for _, other in compare:
        out += [m for m in other.methods if m not in out]
    return out


def plot_acceptance_by_position(result: EvalResult, path: Path, label: str, compare: Compared = ()) -> None:
    plt = _plt()
    runs = [(label, result.table()["all"], "-")] + [(n, o.table()["all"], "--") for n, o in compare]
    methods = _all_methods(result, compare)
    colors = _colors(methods)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for run_label, stats, style in runs:
        for m in methods:
            s = stats.get(m)
            if not s or not s["accept_rate_by_pos"]:
                continue
            xs = list(range(1, len(s["accept_rate_by_pos"]) + 1))
            tag = f"{m} ({run_label})" if compare else m
            axes[0].plot(xs, s["accept_rate_by_pos"], style, marker="o", color=colors[m], label=tag)
            # a conditional rate over a handful of steps is noise: drawn only with >= 5 steps behind it
            reach = [sum(s["accept_hist"][j:]) for j in range(len(s["accept_hist"]))]
            cond = [c if c is not None and reach[j] >= 5 else float("nan")
                    for j, c in enumerate(s["accept_cond_by_pos"])]
            axes[1].plot(xs, cond, style, marker="o", color=colors[m], label=tag)
    axes[0].set_title("Steps accepting at least j draft tokens")
    axes[1].set_title("Acceptance at position j, given j-1 accepted")
    for ax in axes:
        ax.set_xlabel("draft position j (tree: depth)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("share of verify steps")
    axes[1].legend(fontsize=8, loc="best")
    fig.suptitle("Acceptance by position" + (" — solid: " + label + ", dashed: compared" if compare else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_tau_by_prompt_set(result: EvalResult, path: Path, label: str, compare: Compared = ()) -> None:
    plt = _plt()
    table = result.table()
    set_names = [s for s in table if s != "all"] + (["all"] if len(table) > 2 else [])
    runs = [(label, table)] + [(n, o.table()) for n, o in compare]
    methods = _all_methods(result, compare)
    colors = _colors(methods)

    def tau(t: dict, s: str, m: str) -> float | None:
        v = t.get(s, {}).get(m)
        return v["tau"] if v else None

    # one bar slot per (method, run) that has a value somewhere; a compared run sits next to this one
    pairs = [(m, r) for m in methods for r in range(len(runs))
             if any(tau(runs[r][1], s, m) is not None for s in set_names)]
    width = 0.8 / max(len(pairs), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(set_names) * max(1.0, len(pairs) / 3)), 4.2))
    top = 1.0
    for slot, (m, r) in enumerate(pairs):
        run_label, t = runs[r]
        xs, ys = [], []
        for j, s in enumerate(set_names):
            if (v := tau(t, s, m)) is not None:
                xs.append(j - 0.4 + width * (slot + 0.5))
                ys.append(v)
        top = max([top, *ys])
        bars = ax.bar(xs, ys, width * 0.95, color=colors[m], alpha=1.0 if r == 0 else 0.45,
                      hatch=None if r == 0 else "//", label=f"{m} ({run_label})" if compare else m,
                      edgecolor="black", linewidth=0.4)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(range(len(set_names)), set_names)
    ax.set_ylim(0, top * 1.15)
    ax.set_ylabel("tau (accepted + bonus per verify)")
    ax.set_title("Acceptance length tau by prompt set" + (" (hatched: compared)" if compare else ""))
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle=":")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(4, max(len(pairs), 1)), loc="upper left", bbox_to_anchor=(0, -0.1))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_tau_vs_k(result: EvalResult, path: Path, label: str, compare: Compared = ()) -> None:
    plt = _plt()
    runs = [(label, result, "-")] + [(n, o, "--") for n, o in compare]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r, (run_label, res, style) in enumerate(runs):
        stats = res.table()["all"]
        chains = sorted((v["max_accept"], v) for k, v in stats.items() if k.startswith("chain-"))
        trees = [(k, v) for k, v in stats.items() if k.startswith("tree-")]
        color = cycle[r % len(cycle)]
        for ax, key in ((axes[0], "tau"), (axes[1], "speedup")):
            pts = [(k, v[key]) for k, v in chains if v[key] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=color,
                        label=f"chain ({run_label})")
                for x, y in pts:
                    ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
            for t_idx, (name, v) in enumerate(trees):
                if v[key] is not None:
                    ax.axhline(v[key], color=color, linestyle=[":", "-."][t_idx % 2], linewidth=1.2,
                               label=f"{name} ({run_label}): {v[key]:.2f}")
    axes[0].set_ylabel("tau")
    axes[0].set_title("Acceptance length against chain length K")
    axes[1].set_ylabel("speedup vs the target alone")
    axes[1].set_title("Speedup against chain length K")
    axes[1].axhline(1.0, color="gray", linewidth=0.8)
    for ax in axes:
        ax.set_xlabel("K (draft tokens per step)")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_serving_curve(result: EvalResult, path: Path, label: str, compare: Compared = ()) -> None:
    """Tokens/s and speedup against batch size, one line per method (the target alone dashed)."""
    plt = _plt()
    rows = result.serving
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colors = _colors(methods)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in methods:
        pts = sorted((r["batch_size"], r["tokens_per_s"], r["speedup"]) for r in rows if r["method"] == m)
        style = "--" if m == BASELINE else "-"
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=colors[m], label=m)
        sped = [(b, s) for b, _, s in pts if s is not None and m != BASELINE]
        if sped:
            axes[1].plot([p[0] for p in sped], [p[1] for p in sped], style, marker="o", color=colors[m], label=m)
            for x, y in sped:
                axes[1].annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center",
                                 fontsize=7)
    axes[0].set_ylabel("tokens/s (all requests)")
    axes[0].set_title("Throughput against batch size")
    axes[1].set_ylabel("speedup vs the target alone")
    axes[1].set_title("Speedup against batch size")
    axes[1].axhline(1.0, color="gray", linewidth=0.8)
    sizes = batch_sizes_of(rows)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size (requests in flight)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"Serving curve: {label}")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_recommendation(result: EvalResult, path: Path, label: str, compare: Compared = ()) -> None:
    """The fastest method's speedup at each batch size, named on its bar; 1.0 where the target alone was fastest,
    no bar but 'too noisy' where the timing could not tell."""
    plt = _plt()
    choices = [Choice(**c) for c in result.recommendation["choices"]]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(choices)), 4.2))
    xs = list(range(len(choices)))
    ys = [c.speedup or 0.0 for c in choices]
    bars = ax.bar(xs, ys, 0.6, color=["tab:gray" if c.method == BASELINE else "tab:blue" for c in choices],
                  edgecolor="black", linewidth=0.4)
    for x, c, bar in zip(xs, choices, bars, strict=True):
        text = ("too noisy" if c.method is None else "target alone" if c.method == BASELINE
                else f"{c.method}\n{c.speedup:.2f}x")
        ax.annotate(text, (x, bar.get_height()), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle=":")
    ax.set_xticks(xs, [str(c.batch_size) for c in choices])
    ax.set_xlabel("batch size (requests in flight)")
    ax.set_ylabel("speedup vs the target alone")
    ax.set_ylim(0, max([1.0, *ys]) * 1.25)
    ax.set_title(f"Fastest way to decode at each batch size: {label}")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_report(result: EvalResult, out_dir: str | Path, label: str = "this run", compare: Compared = (),
                 extra: dict[str, Any] | None = None) -> Path:
    """report.json, report.md and the PNG plots (three, four with a serving curve) into out_dir, each
    written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = result.to_dict()
    data["label"] = label
    if compare:
        data["compared"] = [{"label": n, "meta": o.meta, "results": o.table()} for n, o in compare]
    if extra:
        data.update(extra)
    atomic_write_json(out / "report.json", data)
    atomic_write_text(out / "report.md", markdown_summary(result, label, compare))
    try:
        _plt()
    except ImportError:  # matplotlib is a dependency, but a backend's own venv may lack it: JSON + Markdown still
        atomic_write_text(out / "report.md", markdown_summary(result, label, compare)
                          + "\n(no plots: matplotlib is not installed in this environment)\n")
        return out
    plots = [("acceptance_by_position.png", plot_acceptance_by_position),
             ("tau_by_prompt_set.png", plot_tau_by_prompt_set), ("tau_vs_k.png", plot_tau_vs_k)]
    if is_curve(result.serving):
        plots.append(("serving_curve.png", plot_serving_curve))
        if result.recommendation:
            plots.append(("recommendation.png", plot_recommendation))
    for name, fn in plots:
        with atomic_path(out / name) as tmp:
            fn(result, tmp.with_suffix(".png"), label, compare)
    return out
