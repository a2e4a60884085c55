"""Scaling-lab results as data: one row per configuration, and a whole run's result.

A row is one configuration (model x backend x servers x processes per server) as
:func:`summarize` makes it from every rank's phase times; :func:`derive` adds the speedup over
one process of the same model and backend (throughput ratio) and the scaling efficiency
(speedup / processes). The tables and files (:mod:`hora.lab.bench_report`) and the plots
(:mod:`hora.lab.bench_plots`) both read these.

Pure functions; thread-safe.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Row = dict[str, Any]
PHASES = ("data", "compute", "wait", "update")


@dataclass
class ScalingResult:
    """Everything one ``hora bench scaling`` run produced (what ``results.json`` holds)."""

    meta: dict[str, Any]
    environment: list[dict[str, str]]  # one envreport.collect() per server
    rows: list[Row]
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> why it did not run
    failed: list[dict[str, Any]] = field(default_factory=list)  # configurations that failed

    def models(self) -> list[str]:
        return list(dict.fromkeys(r["model"] for r in self.rows))


def summarize(ranks: Sequence[dict[str, Any]], config: dict[str, Any]) -> Row:
    """One configuration's row from every rank's :func:`hora.lab.train_worker.train` result.

    Step ``i`` lasts the mean over ranks of each rank's step ``i``. The ranks wait for one
    another in every step's collectives, so over the timed steps every rank spends the same
    wall time, the slowest rank's pace; but each rank's steps begin and end at its own points of
    the shared step (after its own update, before its own data), so one rank's step ``i`` may
    be long where another's is short, and the next the other way round. The mean over ranks is
    the wall time per step; the maximum over ranks, step by step, would count every such
    offset as time (it overstated the step by 6-10% with four ranks on two cores, where the
    offsets are milliseconds). Throughput is ``np * batch / mean step time``; phase times are
    means over ranks and steps; ``comm_share`` is wait / step (None where the ranks say they
    could not time the wait apart: DDP's is inside backward).
    """
    if not ranks or any(len(r["compute_s"]) != len(ranks[0]["compute_s"]) for r in ranks):
        raise ValueError("every rank must report the same number of steps")
    per_rank = [[sum(ph) for ph in zip(*(r[f"{p}_s"] for p in PHASES))] for r in ranks]
    steps = [statistics.fmean(times) for times in zip(*per_rank)]
    phase = {f"{p}_s": statistics.fmean(v for r in ranks for v in r[f"{p}_s"]) for p in PHASES}
    mean = statistics.fmean(steps)
    quantiles = statistics.quantiles(steps, n=10, method="inclusive") if len(steps) > 1 else []
    np_ = len(ranks)
    return {
        **config,
        "np": np_,
        "step_times_s": steps,
        "step_mean_s": mean,
        "step_std_s": statistics.stdev(steps) if len(steps) > 1 else 0.0,
        "step_p50_s": statistics.median(steps),
        "step_p90_s": quantiles[-1] if quantiles else steps[0],
        **phase,
        # None where the wait is not a phase of its own (DDP waits inside backward)
        "comm_share": (phase["wait_s"] / sum(phase.values())
                       if all(r.get("wait_measured", True) for r in ranks) else None),
        "throughput": np_ * config["batch_size"] / mean,
        "params": ranks[0]["params"],
        "grad_bytes": ranks[0]["grad_bytes"],
        "backend_used": ranks[0]["backend"],
        **({"ddp_backend": ranks[0]["ddp_backend"]} if "ddp_backend" in ranks[0] else {}),
    }


def derive(rows: Sequence[Row]) -> list[Row]:
    """Copies with ``speedup`` (throughput over one process, same model and backend) and
    ``efficiency`` (speedup / np); both None when that backend has no one-process run."""
    base = {(r["model"], r["backend"]): r["throughput"] for r in rows if r["np"] == 1}
    out = []
    for r in rows:
        b = base.get((r["model"], r["backend"]))
        speedup = r["throughput"] / b if b else None
        out.append({**r, "speedup": speedup, "efficiency": speedup / r["np"] if speedup else None})
    return out


def config_key(r: Row) -> tuple[str, str, int, int]:
    """What identifies a configuration across runs: model, backend, servers, per server."""
    return r["model"], r["backend"], r["servers"], r["per_server"]
