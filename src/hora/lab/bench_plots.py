"""The scaling lab's PNG plots, drawn with matplotlib's Agg canvas (no display needed).

- ``scaling_<model>.png``: throughput and speedup against the number of processes, one line per
  backend (and per processes-per-server count for runs across servers), with ideal linear
  scaling dashed;
- ``breakdown.png``: each configuration's mean step split into compute (forward, backward and
  update), communication wait and data loading, one panel per model, the wait share on top,
  one legend for all panels;
- ``comparison.png`` (``hora bench report A B``): B's throughput over A's per configuration.

Pure functions of their arguments that write one file each; thread-safe (own Figure objects).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hora.lab.bench_results import Row, ScalingResult, config_key, derive

COLORS = {"native": "tab:blue", "gloo": "tab:orange", "mpi": "tab:green", "nccl": "tab:red",
          "ddp": "tab:purple"}
PHASE_COLORS = {"compute": "tab:blue", "comm wait": "tab:red", "data": "tab:gray"}


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _series(rows: Sequence[Row]) -> dict[tuple[str, str], list[Row]]:
    """(backend, label) -> rows by process count: one server, then across servers per count."""
    out: dict[tuple[str, str], list[Row]] = {}
    spread = {(r["backend"], r["per_server"]) for r in rows if r["servers"] > 1}
    for r in rows:
        if r["servers"] == 1:
            label = r["backend"] + (", one server" if spread else "")
            out.setdefault((r["backend"], label), []).append(r)
    for r in rows:
        if (r["backend"], r["per_server"]) in spread:
            label = f"{r['backend']}, {r['per_server']}/server across servers"
            out.setdefault((r["backend"], label), []).append(r)
    return {k: sorted(v, key=lambda r: r["np"]) for k, v in out.items()}


def plot_scaling(result: ScalingResult, model: str, path: str | Path) -> None:
    rows = [r for r in derive(result.rows) if r["model"] == model]
    if not rows:
        raise ValueError(f"no results for model {model!r} to plot")
    fig = _figure(11, 5.6)
    thr, spd = fig.subplots(1, 2)
    counts = sorted({r["np"] for r in rows})
    for (backend, label), mine in _series(rows).items():
        across = label.endswith("across servers")
        style, marker = (":", "s") if across else ("-", "o")
        color = COLORS.get(backend)
        x = [r["np"] for r in mine]
        thr.plot(x, [r["throughput"] for r in mine], style, marker=marker, color=color, label=label)
        if all(r["speedup"] is not None for r in mine):
            spd.plot(
                x, [r["speedup"] for r in mine], style, marker=marker, color=color, label=label
            )
        base = next((r["throughput"] for r in mine if r["np"] == 1), None)
        if base is not None and not across:
            thr.plot(
                counts,
                [base * n for n in counts],
                "--",
                color=color,
                alpha=0.45,
                linewidth=1,
                label=f"{backend}, ideal (linear)",
            )
    spd.plot(counts, counts, "--", color="black", alpha=0.5, linewidth=1, label="ideal (linear)")
    batches = result.meta.get("batch_sizes", {}).get(model, "?")
    thr.set_title(f"{model}: throughput ({batches} samples per process per step)")
    thr.set_ylabel("throughput (samples/s)")
    spd.set_title(f"{model}: speedup over one process")
    spd.set_ylabel("speedup (x, throughput / one process)")
    for ax in (thr, spd):
        ax.set_xlabel("processes (total)")
        ax.set_xticks(counts)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png")


def plot_breakdown(result: ScalingResult, path: str | Path) -> None:
    models = result.models()
    if not models:
        raise ValueError("no results to plot")
    cols = 2 if len(models) in (2, 4) else min(3, len(models))
    rows_n = (len(models) + cols - 1) // cols
    fig = _figure(max(6.0, 4.6 * cols), 4.4 * rows_n)
    axes = fig.subplots(rows_n, cols, squeeze=False).ravel()
    order = {b: i for i, b in enumerate(result.meta.get("backends", []))}
    for ax, model in zip(axes, models):
        mine = sorted(
            (r for r in result.rows if r["model"] == model),
            key=lambda r: (order.get(r["backend"], 99), r["servers"], r["per_server"]),
        )
        labels = [
            f"{r['backend']}\n{r['np']}p" + (f" {r['servers']}srv" if r["servers"] > 1 else "")
            for r in mine
        ]
        parts = {
            "compute": [(r["compute_s"] + r["update_s"]) * 1e3 for r in mine],
            "comm wait": [r["wait_s"] * 1e3 for r in mine],
            "data": [r["data_s"] * 1e3 for r in mine],
        }
        bottom = [0.0] * len(mine)
        for name, values in parts.items():
            ax.bar(labels, values, bottom=bottom, color=PHASE_COLORS[name], label=name)
            bottom = [b + v for b, v in zip(bottom, values)]
        for i, r in enumerate(mine):
            ax.annotate(
                "in backward" if r["comm_share"] is None else f"{100 * r['comm_share']:.0f}%",
                (i, bottom[i]),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
        ax.set_title(f"{model}: mean step by phase (label: comm wait share)", fontsize=10)
        ax.set_ylabel("time per step (ms)")
        several = any(r["servers"] > 1 for r in mine)
        ax.set_xlabel("backend, processes (p)" + (", servers (srv)" if several else ""))
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylim(0, max(bottom) * 1.15)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes[len(models) :]:
        ax.set_visible(False)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=9)
    fig.tight_layout(rect=(0, 0.45 / (4.4 * rows_n), 1, 1))
    fig.savefig(path, format="png")


def plot_compare(
    a: ScalingResult, b: ScalingResult, path: str | Path, names: Sequence[str] = ("A", "B")
) -> None:
    theirs = {config_key(r): r for r in b.rows}
    pairs = [(r, theirs[config_key(r)]) for r in a.rows if config_key(r) in theirs]
    if not pairs:
        raise ValueError("the two results have no configuration in common")
    fig = _figure(max(6.0, 0.7 * len(pairs) + 2), 4.6)
    ax = fig.subplots()
    labels = [f"{r['model']}\n{r['backend']}\n{r['np']}p" for r, _ in pairs]
    ratios = [o["throughput"] / r["throughput"] for r, o in pairs]
    ax.bar(labels, ratios, color=["tab:red" if x < 1 else "tab:green" for x in ratios])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="same throughput")
    ax.set_title(f"throughput of B ({names[-1]}) over A ({names[0]})", fontsize=10)
    ax.set_ylabel("B / A throughput (x)")
    ax.set_xlabel("model, backend, processes")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylim(0, max(1.2, max(ratios) * 1.1))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")


def plot_all(result: ScalingResult, folder: Path) -> list[Path]:
    """Every plot of ``result`` into ``folder``; the paths written."""
    written = []
    for model in result.models():
        written.append(folder / f"scaling_{model}.png")
        plot_scaling(result, model, written[-1])
    written.append(folder / "breakdown.png")
    plot_breakdown(result, written[-1])
    return written
