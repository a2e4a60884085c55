"""Scaling-lab results shown: the lab's tables, its files, and ``hora bench report DIR [DIR2]``.

The rows, one per configuration, come from :mod:`hora.lab.bench_results` (:func:`summarize`,
:func:`derive`). The tables are ``(headers, body)`` pairs rendered as aligned text for the
terminal (:func:`hora.lab.report.format_table`) or as Markdown. :func:`save` writes a result
folder (``results.json``, ``results.csv``, ``tables.md``, PNG plots), :func:`load` reads it
back, and :func:`compare_table` puts two results side by side with their throughput ratios.

Pure functions apart from file I/O; thread-safe.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hora.lab import bench_plots, envreport, report
from hora.lab.bench_results import Row, ScalingResult, config_key, derive
from hora.lab.gpu_sampler import MIN_SAMPLES
from hora.lab.netns import parse_rate

Table = tuple[list[str], list[list[str]]]
RESULTS = "results.json"
EXAMPLES = """examples:
  hora bench report results/                   print the tables, redraw the plots
  hora bench report before/ after/             side by side: comparison.md and .png with --out
  hora bench report before/ after/ --fail-below 0.9
                                               exit 1 if a configuration lost over 10%"""
CSV_COLUMNS = [
    "model", "backend", "servers", "per_server", "np", "hosts", "batch_size", "steps", "warmup",
    "step_mean_s", "step_std_s", "step_p50_s", "step_p90_s", "data_s", "compute_s", "wait_s",
    "update_s", "comm_share", "throughput", "speedup", "efficiency", "params", "grad_bytes",
    "wall_s",
]  # fmt: skip
# added to the CSV and the lab's tables only when a configuration ran across namespace hosts
# (--netns): what the hosts' links sent per step, warm-up and timed steps alike
LINK_COLUMNS = ["link_bytes_per_step"]
LINK_HEADER = "MB/step on the links"
# beside it: the step those bytes allow at --link-rate (link_bound_s)
BOUND_HEADER = "link-bound step (ms)"
# added to the CSV and the lab's tables only when a configuration's GPUs were sampled
GPU_COLUMNS = ["device", "gpu_util_mean_pct", "gpu_util_max_pct", "gpu_mem_max_mib", "gpu_samples",
               "gpu_sampled"]


def _ratio(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _step(r: Row) -> str:
    return f"{r['step_mean_s'] * 1e3:.1f} ± {r['step_std_s'] * 1e3:.1f}"


LAB_HEADERS = [
    "backend", "servers", "processes/server", "avg step time (ms)",
    "avg throughput (samples/s)", "speedup", "efficiency", "comm wait",
]  # fmt: skip


def _sampled(rows: Sequence[Row]) -> bool:
    """Whether any configuration of ``rows`` has GPU utilisation (gpu_sampler)."""
    return any("gpu_util_mean_pct" in r for r in rows)


def _gpu_cells(r: Row) -> list[str]:
    if "gpu_util_mean_pct" not in r:
        return ["-", "-", "-"]
    return [
        f"{r['gpu_util_mean_pct']:.0f}% / {r['gpu_util_max_pct']:.0f}%",
        _gpu_samples(r),
        f"{r['gpu_mem_max_mib']:.0f}",
    ]


def _gpu_samples(r: Row) -> str:
    """How many readings the utilisation rests on, and whether that is too few, or the whole
    run's (the timed steps gave none)."""
    n = r.get("gpu_samples")
    if n is None:
        return "-"
    notes = (["whole run"] if r.get("gpu_sampled") == "whole run" else []) + (
        ["too few"] if n < MIN_SAMPLES else [])  # fmt: skip
    return f"{n}" + (f" ({', '.join(notes)})" if notes else "")


def _linked(rows: Sequence[Row]) -> bool:
    """Whether any configuration of ``rows`` counted its hosts' link bytes (--netns)."""
    return any("link_bytes_per_step" in r for r in rows)


def link_cell(r: Row) -> str:
    """A row's link bytes per step in MB (``-`` where it did not count them)."""
    sent = r.get("link_bytes_per_step")
    return "-" if sent is None else f"{sent / 1e6:.2f}"


def link_bound_s(r: Row) -> float | None:
    """A row's step if its hosts' links carried the bytes they sent at the link's rate with
    nothing else in the way: compute, data and update as measured, plus one host's share of
    the links' bytes per step at ``link_rate``. None where the row did not count them, or where
    its communication ran inside its compute (DDP's backward: no wait phase of its own)."""
    sent, rate = r.get("link_bytes_per_step"), r.get("link_rate")
    if sent is None or rate is None or r.get("comm_share") is None:
        return None
    on_one_link = sent / r["servers"] * 8 / parse_rate(rate)
    return float(r["compute_s"] + r["data_s"] + r["update_s"] + on_one_link)


def _bound_cell(r: Row) -> str:
    bound = link_bound_s(r)
    return "-" if bound is None else f"{bound * 1e3:.1f}"


def _lab_table(rows: Sequence[Row]) -> Table:
    """The lab's headers and one line per row; the links' bytes per step and the step they
    bound when a row counted them, GPU columns when a row was sampled."""
    linked, sampled = _linked(rows), _sampled(rows)
    headers = [*LAB_HEADERS, *([LINK_HEADER, BOUND_HEADER] if linked else []), *(
        ["GPU util mean / max", "GPU util samples", "GPU memory max (MiB)"] if sampled else [])]
    body = [_lab_row(r) + ([link_cell(r), _bound_cell(r)] if linked else [])
            + (_gpu_cells(r) if sampled else []) for r in rows]  # fmt: skip
    return headers, body


def _backend(r: Row) -> str:
    """A row's backend, with the one torch's DDP ran on: ``ddp (nccl)``."""
    return f"{r['backend']} ({r['ddp_backend']})" if r.get("ddp_backend") else str(r["backend"])


def _lab_row(r: Row) -> list[str]:
    return [
        _backend(r),
        str(r["servers"]),
        str(r["per_server"]),
        _step(r),
        f"{r['throughput']:.1f}",
        _ratio(r["speedup"]),
        _percent(r["efficiency"]),
        _percent(r["comm_share"]),
    ]


def _order(rows: Sequence[Row], backends: Sequence[str]) -> list[Row]:
    rank = {b: i for i, b in enumerate(backends)}
    return sorted(rows, key=lambda r: (rank.get(r["backend"], 99), r["servers"], r["per_server"]))


def intra_table(rows: Sequence[Row], model: str, backends: Sequence[str] = ()) -> Table:
    """Speedup inside one server: every one-server configuration of ``model``."""
    mine = [r for r in derive(rows) if r["model"] == model and r["servers"] == 1]
    return _lab_table(_order(mine, backends))


def inter_table(rows: Sequence[Row], model: str, backends: Sequence[str] = ()) -> Table:
    """Speedup across servers: for each backend and processes-per-server count that ran on
    several servers, its runs from one server up."""
    mine = [r for r in derive(rows) if r["model"] == model]
    spread = {(r["backend"], r["per_server"]) for r in mine if r["servers"] > 1}
    chosen = [r for r in mine if (r["backend"], r["per_server"]) in spread]
    rank = {b: i for i, b in enumerate(backends)}
    chosen.sort(key=lambda r: (rank.get(r["backend"], 99), r["per_server"], r["servers"]))
    return _lab_table(chosen)


def model_table(rows: Sequence[Row], backends: Sequence[str] = ()) -> Table:
    """Compute against communication per model, at each model's largest process count (every
    placement of it: one server, several)."""
    derived = derive(rows)
    headers = [
        "model", "parameters (M)", "gradients (MB)", "backend", "servers x processes",
        "compute (ms)", "comm wait (ms)", "data (ms)", "comm wait share", "speedup", "efficiency",
    ]  # fmt: skip
    body = []
    for model in dict.fromkeys(r["model"] for r in derived):
        mine = [r for r in derived if r["model"] == model]
        top = max(r["np"] for r in mine)
        for r in _order([r for r in mine if r["np"] == top], backends):
            body.append([
                model, f"{r['params'] / 1e6:.2f}", f"{r['grad_bytes'] / 1e6:.1f}", _backend(r),
                f"{r['servers']}x{r['per_server']}",
                f"{(r['compute_s'] + r['update_s']) * 1e3:.1f}", f"{r['wait_s'] * 1e3:.1f}",
                f"{r['data_s'] * 1e3:.1f}", _percent(r["comm_share"]), _ratio(r["speedup"]),
                _percent(r["efficiency"]),
            ])  # fmt: skip
    return headers, body


def compare_table(a: ScalingResult, b: ScalingResult, fail_below: float = 0.0) -> tuple[Table, int]:
    """Configurations present in both results side by side; the second's throughput over the
    first's. Also returns how many ratios fell below ``fail_below``."""
    theirs = {config_key(r): r for r in b.rows}
    headers = [
        "model", "backend", "servers", "processes/server", "A step (ms)", "B step (ms)",
        "A samples/s", "B samples/s", "B/A throughput", "",
    ]  # fmt: skip
    body, below = [], 0
    for r in a.rows:
        o = theirs.get(config_key(r))
        if o is None:
            continue
        ratio = o["throughput"] / r["throughput"]
        slow = ratio < fail_below
        below += slow
        body.append([
            r["model"], _backend(r), str(r["servers"]), str(r["per_server"]), _step(r), _step(o),
            f"{r['throughput']:.1f}", f"{o['throughput']:.1f}", f"{ratio:.3f}",
            "REGRESSION" if slow else "",
        ])  # fmt: skip
    return (headers, body), below


def markdown(table: Table) -> str:
    headers, body = table
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    return "\n".join(lines)


def _text(table: Table, left: int) -> str:
    return report.format_table(*table, left=left) if table[1] else "(no configurations)"


def sections(result: ScalingResult) -> list[tuple[str, Table, int]]:
    """(title, table, left-aligned columns) in the order both renderers show them."""
    backends = result.meta.get("backends", [])
    out = []
    for model in result.models():
        intra = intra_table(result.rows, model, backends)
        out.append((f"Speedup inside one server: {model}", intra, 1))
        if any(r["servers"] > 1 for r in result.rows if r["model"] == model):
            inter = inter_table(result.rows, model, backends)
            out.append((f"Speedup across servers: {model}", inter, 1))
    if len(result.models()) > 1:
        out.append(("Compute and communication by model", model_table(result.rows, backends), 1))
    if result.environment:
        env = envreport.environment_table(result.environment)
        out.append(("Environment", env, len(env[0])))
    return out


def _notes(result: ScalingResult) -> list[str]:
    lines = [f"skipped {b}: {why}" for b, why in result.skipped.items()]
    lines += [
        f"failed {f['model']} {f['backend']} {f['servers']}x{f['per_server']}"
        + (f" (round {f['round']})" if result.meta.get("repeat", 1) > 1 else "")
        + f": {f['reason']}"
        for f in result.failed
    ]
    above = [r for r in derive(result.rows) if r["efficiency"] and r["efficiency"] > 1.05]
    if above:
        lines.append(
            f"{len(above)} configuration(s) scale better than linearly: their one-process run "
            "was slowed by other work on the machine (see the load average); rerun with "
            "--repeat 3 or on a quiet machine"
        )
    if _linked(result.rows):
        lines.append(f"{LINK_HEADER}: what the namespace hosts' links sent, averaged over the "
                     "warm-up and timed steps (the start's broadcast of the parameters included)")
    if not any(r["servers"] > 1 for r in result.rows):
        lines.append("no run across servers: give -H host1:N,host2:N or --hostfile for that table")
    return lines


def headline(meta: dict[str, Any]) -> str:
    batches = ", ".join(f"{m} {b}" for m, b in meta.get("batch_sizes", {}).items())
    return (
        f"hora bench scaling ({meta.get('date', '')}): batch per process {batches}; "
        f"{meta.get('steps')} timed steps after {meta.get('warmup')} warm-up"
        + (f", best of {meta['repeat']} rounds; " if meta.get("repeat", 1) > 1 else "; ")
        + f"{meta.get('threads')} torch thread(s) per process"
        + (f"; on CUDA ({meta.get('gpu')})" if meta.get("device") == "cuda" else "")
        + ". Step time: mean ± standard "
        "deviation over steps (a step: the mean over ranks of their step, the wall time per step "
        "of ranks that wait for one another); comm wait: share of a "
        "step spent in optimizer.synchronize() after backward"
        + ("; ddp: torch DistributedDataParallel on the same model and batch (its wait is "
           "inside backward: no share of its own)" if "ddp" in meta.get("backends", ()) else "")
        + _gpu_note(meta) + _load_note(meta)
    )


def _gpu_note(meta: dict[str, Any]) -> str:
    if meta.get("device") != "cuda":
        return ""
    return (
        "; GPU util: this host's GPUs' utilisation (NVML every 50 ms, or nvidia-smi every "
        "0.2 s) during the timed steps, mean / max, and how many readings it rests on "
        f"(under {MIN_SAMPLES}: too few, run more --steps); GPU memory: the most one GPU held"
    )


def _load_note(meta: dict[str, Any]) -> str:
    before, after = meta.get("load_before"), meta.get("load_after")
    if not before or not after:
        return ""
    return f". Load average (1 min) of this host: {before[0]:g} before, {after[0]:g} after"


def render_text(result: ScalingResult) -> str:
    parts = [headline(result.meta)]
    for title, table, left in sections(result):
        parts += ["", title, _text(table, left)]
    notes = _notes(result)
    return "\n".join(parts + ([""] + notes if notes else [])) + "\n"


def render_markdown(result: ScalingResult) -> str:
    parts = [f"# {result.meta.get('title', 'Scaling lab')}", "", headline(result.meta)]
    for title, table, _ in sections(result):
        parts += ["", f"## {title}", "", markdown(table) if table[1] else "(no configurations)"]
    notes = _notes(result)
    return "\n".join(parts + (["", *(f"- {n}" for n in notes)] if notes else [])) + "\n"


def to_csv(rows: Sequence[Row]) -> str:
    buf = io.StringIO()
    columns = (CSV_COLUMNS + (LINK_COLUMNS if _linked(rows) else [])
               + (GPU_COLUMNS if _sampled(rows) else []))  # fmt: skip
    writer = csv.DictWriter(buf, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in derive(rows):
        writer.writerow({**r, "hosts": "+".join(r["hosts"])})
    return buf.getvalue()


def save(result: ScalingResult, folder: str | Path, plots: bool = True) -> list[Path]:
    """Write results.json, results.csv, tables.md and (``plots``) the PNGs; the paths written."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / RESULTS, out / "results.csv", out / "tables.md"]
    stored = ScalingResult(**{**asdict(result), "rows": derive(result.rows)})
    written[0].write_text(json.dumps(asdict(stored), indent=1) + "\n")
    written[1].write_text(to_csv(result.rows))
    written[2].write_text(render_markdown(result))
    if plots and result.rows:
        written += bench_plots.plot_all(result, out)
    return written


def load(folder: str | Path) -> ScalingResult:
    path = Path(folder) / RESULTS
    try:
        data = json.loads(path.read_text())
        return ScalingResult(**data)
    except FileNotFoundError as e:
        raise ValueError(
            f"{path} not found: give a folder written by hora bench scaling --out"
        ) from e
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{path} is not a hora bench scaling result: {e}") from e


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``hora bench report``'s arguments to ``parser``."""
    parser.add_argument(
        "dirs",
        nargs="+",
        metavar="DIR",
        help="result folder(s) of hora bench scaling --out; two to compare (A then B)",
    )
    parser.add_argument(
        "--out",
        help="write tables and plots here (default: the folder itself; with two "
        "folders: comparison.md and comparison.png, only when given)",
    )
    parser.add_argument(
        "--fail-below",
        type=float,
        default=0.0,
        metavar="RATIO",
        help="with two folders: exit "
        "1 if any configuration's B/A throughput ratio is below RATIO, e.g. 0.9",
    )


def command(args: argparse.Namespace) -> int:
    """Print the tables again (one folder) or the comparison (two); 2 for bad input."""
    try:
        if len(args.dirs) > 2:
            raise ValueError(f"give one or two result folders, not {len(args.dirs)}")
        results = [load(d) for d in args.dirs]
    except ValueError as e:
        print(f"hora bench report: error: {e}", file=sys.stderr)
        return 2
    if len(results) == 1:
        sys.stdout.write(render_text(results[0]))
        for path in save(results[0], args.out or args.dirs[0]):
            print(f"wrote {path}", file=sys.stderr)
        return 0
    a, b = results
    table, below = compare_table(a, b, args.fail_below)
    lines = [f"A = {args.dirs[0]}", f"B = {args.dirs[1]}", "", _text(table, 2)]
    if args.fail_below:
        lines.append(f"\n{below} configuration(s) below {args.fail_below:g} x A's throughput")
    sys.stdout.write("\n".join(lines) + "\n")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.md").write_text(markdown(table) + "\n")
        bench_plots.plot_compare(a, b, out / "comparison.png", args.dirs)
    return 1 if below else 0
