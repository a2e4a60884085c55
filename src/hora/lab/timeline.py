"""``hora timeline FILE...``: merge every rank's timeline into one trace and say what to change.

Input: timelines that hora wrote (``docs/timeline.md``): one per rank when the path had
``{rank}`` in it (``HOROVOD_TIMELINE=/tmp/tl.{rank}.json``), or rank 0's alone, as Horovod
writes it. Output:

* ``-o merged.json``: one Chrome/Perfetto trace with a process row per rank (pid = rank) and a
  thread row per tensor inside it, every rank's clock shifted onto one time axis (``--align
  wall``: the wall-clock start each file records, exact on one host; ``--align ops``: also
  shift each rank so that the ends of the collectives it shares with the first rank line up,
  for hosts whose clocks differ);
* a summary on standard output: time per phase and per tensor with shares, the rank that
  submitted last (the straggler) per tensor, the fused buffers against the fusion threshold, and
  recommendations ordered by the time at stake; ``--summary-json`` writes the same numbers.

Phases of one tensor operation on one rank (they add up to the operation's time in the trace:
its ``NEGOTIATE_*`` span plus its op span):

* ``wait for slowest rank``: from this rank's submission until the last rank submitted;
* ``negotiation``: the rest of the ``NEGOTIATE_*`` span (the coordinator's round trip);
* ``queue``: waiting behind other responses of the same cycle (``QUEUE``);
* ``fusion copy in`` / ``fusion copy out``: ``MEMCPY_IN/OUT_FUSION_BUFFER``;
* ``communication``: the backend's transfer (``TCP_ALLREDUCE``, ``SHM_ALLGATHER``, ...);
* ``other``: the rest of the op span (scaling, bookkeeping).

A pure function of the files; runs in the caller's thread. The CLI dispatches here through
``configure(parser)`` and ``command(args)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from hora.dtypes import itemsize

__all__ = ["Occurrence", "RankTrace", "analyze", "command", "configure", "load", "merge"]

PHASES = (
    "wait for slowest rank",
    "negotiation",
    "queue",
    "fusion copy in",
    "communication",
    "fusion copy out",
    "other",
)
_ACTIVITY_PHASE = {
    "QUEUE": "queue",
    "MEMCPY_IN_FUSION_BUFFER": "fusion copy in",
    "MEMCPY_OUT_FUSION_BUFFER": "fusion copy out",
}
MiB = 1 << 20


@dataclass
class Occurrence:
    """One operation on one tensor on one rank; times in µs on the merged time axis."""

    name: str
    index: int  # the how-manyth time this rank traced this tensor
    neg_start: float | None = None
    neg_end: float | None = None
    op: str = ""
    op_start: float | None = None
    op_end: float | None = None
    activities: list[tuple[str, float, float]] = field(default_factory=list)
    ready: dict[int, float] = field(default_factory=dict)  # rank -> ready mark (rank 0 only)
    nbytes: int = 0
    fused_bytes: int = 0
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.op_start is not None and self.op_end is not None

    @property
    def total(self) -> float:
        neg = (
            0.0 if self.neg_start is None or self.neg_end is None else self.neg_end - self.neg_start
        )
        assert self.op_start is not None and self.op_end is not None
        return neg + self.op_end - self.op_start


@dataclass
class RankTrace:
    path: str
    rank: int
    epoch_us: int
    meta: dict[str, Any]
    events: list[dict[str, Any]]
    names: dict[int, str]  # pid -> tensor name
    occurrences: list[Occurrence]
    offset: float = 0.0  # µs added to the file's ts to put it on the merged axis


# -- reading --------------------------------------------------------------------------------
def load(paths: list[str]) -> list[RankTrace]:
    """Parse timeline files; a file without a rank in its header takes its position."""
    traces = []
    for i, path in enumerate(paths):
        try:
            with open(path) as f:
                events = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable timeline ({e})") from None
        if not isinstance(events, list) or not events or events[0].get("pid") != 0:
            raise ValueError(f"{path}: not a hora/Horovod timeline (no header record on pid 0)")
        meta = dict(events[0].get("args", {}))
        rank = int(meta.get("rank", i))
        names = {
            e["pid"]: str(e["args"]["name"])
            for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name" and e.get("pid")
        }
        traces.append(
            RankTrace(
                path,
                rank,
                int(meta.get("start_time_since_epoch_in_micros", 0)),
                meta,
                events,
                names,
                _occurrences(events, names),
            )
        )
    ranks = [t.rank for t in traces]
    dups = sorted(r for r, c in Counter(ranks).items() if c > 1)
    if dups:
        raise ValueError(f"two files hold the timeline of rank(s) {dups}: give one per rank")
    return sorted(traces, key=lambda t: t.rank)


def _occurrences(events: list[dict[str, Any]], names: dict[int, str]) -> list[Occurrence]:
    out: list[Occurrence] = []
    seen: Counter[str] = Counter()
    cur: dict[int, Occurrence] = {}
    state: dict[int, str] = {}  # pid -> "neg" | "op" | "act"
    act: dict[int, tuple[str, float]] = {}
    for e in events:
        pid, ph = e.get("pid", 0), e.get("ph")
        if not pid or ph not in ("B", "E", "X"):
            continue
        ts = float(e.get("ts", 0))
        name = names.get(pid, str(pid))
        st = state.get(pid, "")
        if ph == "B" and str(e.get("name", "")).startswith("NEGOTIATE_"):
            occ = cur[pid] = Occurrence(name, seen[name], neg_start=ts)
            seen[name] += 1
            out.append(occ)
            state[pid] = "neg"
        elif ph == "X" and st == "neg":
            cur[pid].ready[int(e["name"])] = ts
        elif ph == "E" and st == "neg":
            cur[pid].neg_end = ts
            state[pid] = "negotiated"
        elif ph == "B" and st in ("negotiated", "", "done"):
            if st != "negotiated":  # an op traced without its negotiation
                cur[pid] = Occurrence(name, seen[name])
                seen[name] += 1
                out.append(cur[pid])
            cur[pid].op, cur[pid].op_start = str(e.get("name", "")), ts
            state[pid] = "op"
        elif ph == "B" and st == "op":
            act[pid] = (str(e.get("name", "")), ts)
            state[pid] = "act"
        elif ph == "E" and st == "act":
            label, start = act.pop(pid)
            cur[pid].activities.append((label, start, ts))
            state[pid] = "op"
        elif ph == "E" and st == "op":
            occ = cur[pid]
            occ.op_end = ts
            args = e.get("args", {})
            occ.fused_bytes = int(args.get("fused_bytes", 0))
            occ.nbytes = _nbytes(args)
            state[pid] = "done"
    return out


def _nbytes(args: dict[str, Any]) -> int:
    try:
        dims = json.loads(args.get("shape", "[]"))
        n = 1
        for d in dims:
            n *= int(d)
        return n * itemsize(str(args.get("dtype", "uint8")))
    except (ValueError, TypeError, KeyError):
        return 0


# -- aligning and merging -------------------------------------------------------------------
def align(traces: list[RankTrace], how: str = "wall") -> None:
    """Set every trace's offset so that its ts land on one axis starting at 0."""
    t0 = min(t.epoch_us for t in traces)
    for t in traces:
        t.offset = float(t.epoch_us - t0)
    if how == "ops" and len(traces) > 1:
        ref = {(o.name, o.index): o.op_end for o in traces[0].occurrences
               if o.complete and o.op_end is not None}
        for t in traces[1:]:
            diffs = [
                (ref[(o.name, o.index)] + traces[0].offset) - (o.op_end + t.offset)
                for o in t.occurrences
                if o.complete and (o.name, o.index) in ref and o.op_end is not None
            ]
            if diffs:
                t.offset += statistics.median(diffs)  # type: ignore[operator]
    for t in traces:
        for o in t.occurrences:
            _shift(o, t.offset)


def _shift(o: Occurrence, dt: float) -> None:
    for attr in ("neg_start", "neg_end", "op_start", "op_end"):
        v = getattr(o, attr)
        if v is not None:
            setattr(o, attr, v + dt)
    o.activities = [(a, s + dt, e + dt) for a, s, e in o.activities]
    o.ready = {r: v + dt for r, v in o.ready.items()}


def merge(traces: list[RankTrace]) -> list[dict[str, Any]]:
    """One trace: a process per rank, a thread per tensor, every ts on the merged axis."""
    tids: dict[str, int] = {}
    for t in traces:
        for pid in sorted(t.names):
            tids.setdefault(t.names[pid], len(tids) + 1)
    out: list[dict[str, Any]] = []
    for t in traces:
        r = t.rank
        out.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
        out.append(
            {"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "engine"}}
        )
        for pid in sorted(t.names):
            tid = tids[t.names[pid]]
            out.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": r,
                    "tid": tid,
                    "args": {"name": t.names[pid]},
                }
            )
            out.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": r,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        for e in t.events:
            if e.get("ph") == "M":
                continue
            m = dict(e)
            m["ts"] = float(e.get("ts", 0)) + t.offset
            m["pid"] = r
            m["tid"] = tids[t.names[e["pid"]]] if e.get("pid") in t.names else 0
            if m.get("s") == "g":
                m["s"] = "p"
            out.append(m)
    return out


# -- analysis -------------------------------------------------------------------------------
def _phases(o: Occurrence, last_submit: float | None) -> dict[str, float]:
    ph = dict.fromkeys(PHASES, 0.0)
    if o.neg_start is not None and o.neg_end is not None:
        neg = o.neg_end - o.neg_start
        wait = 0.0 if last_submit is None else min(max(last_submit - o.neg_start, 0.0), neg)
        ph["wait for slowest rank"] = wait
        ph["negotiation"] = neg - wait
    assert o.op_start is not None and o.op_end is not None
    inside = 0.0
    for label, s, e in o.activities:
        ph[_ACTIVITY_PHASE.get(label, "communication")] += e - s
        inside += e - s
    ph["other"] = max(o.op_end - o.op_start - inside, 0.0)
    return ph


def analyze(traces: list[RankTrace], fusion_threshold: int | None = None) -> dict[str, Any]:
    """The summary's numbers (µs); ``traces`` must be aligned."""
    groups: dict[tuple[str, int], dict[int, Occurrence]] = defaultdict(dict)
    for t in traces:
        for o in t.occurrences:
            if o.complete:
                groups[(o.name, o.index)][t.rank] = o
    per_tensor: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES, 0.0))
    totals = dict.fromkeys(PHASES, 0.0)
    last_of: dict[str, Counter[int]] = defaultdict(Counter)
    caused: dict[int, float] = defaultdict(float)  # µs the others waited for each straggler
    counts: Counter[str] = Counter()
    for (name, _), occs in groups.items():
        submits = {r: o.neg_start for r, o in occs.items() if o.neg_start is not None}
        ready = next((o.ready for o in occs.values() if len(o.ready) > 1), {})
        if len(submits) < 2 and ready:
            submits = dict(ready)
        last_rank, last_t = None, None
        if len(submits) > 1:
            last_rank = max(submits, key=lambda r: (submits[r], r))
            last_t = submits[last_rank]
            last_of[name][last_rank] += 1
        counts[name] += 1
        for o in occs.values():
            o.phases = _phases(o, last_t)
            if last_rank is not None:
                caused[last_rank] += o.phases["wait for slowest rank"]
            for k, v in o.phases.items():
                per_tensor[name][k] += v
                totals[k] += v
    total = sum(totals.values())
    threshold = fusion_threshold
    if threshold is None:
        threshold = next(
            (
                int(t.meta["fusion_threshold_bytes"])
                for t in traces
                if "fusion_threshold_bytes" in t.meta
            ),
            None,
        )
    summary: dict[str, Any] = {
        "ranks": [t.rank for t in traces],
        "operations": sum(counts.values()),
        "total_us": total,
        "phases": {k: {"us": v, "share": v / total if total else 0.0} for k, v in totals.items()},
        "tensors": {
            n: {
                "count": counts[n],
                "total_us": sum(p.values()),
                "phases": p,
                "straggler": _straggler(last_of[n]),
            }
            for n, p in sorted(per_tensor.items(), key=lambda kv: -sum(kv[1].values()))
        },
        "stragglers": {
            str(r): {"last": c, "others_waited_us": caused[r]}
            for r, c in sum(last_of.values(), Counter()).most_common()
        },
        "fusion": _fusion(traces, threshold),
        "gaps": _gaps(traces),
        "autotune": [
            dict(e.get("args", {}), ts=float(e.get("ts", 0)) + t.offset)
            for t in traces
            for e in t.events
            if e.get("ph") == "i" and e.get("name") == "AUTOTUNE"
        ],
    }
    summary["recommendations"] = _recommend(summary)
    return summary


def _straggler(c: Counter[int]) -> dict[str, Any] | None:
    if not c:
        return None
    rank, n = c.most_common(1)[0]
    return {"rank": rank, "last": n, "of": sum(c.values())}


def _fusion(traces: list[RankTrace], threshold: int | None) -> dict[str, Any]:
    """Fused buffers on the first trace: members taken in order until their bytes add up."""
    buffers: list[int] = []
    members = 0
    fused_bytes = unfused_bytes = 0
    if traces:
        acc = 0
        for o in sorted(
            (o for o in traces[0].occurrences if o.complete), key=lambda o: (o.op_end, o.name)
        ):
            if not o.fused_bytes:
                unfused_bytes += o.nbytes
                continue
            fused_bytes += o.nbytes
            acc += o.nbytes
            members += 1
            if acc >= o.fused_bytes:
                buffers.append(o.fused_bytes)
                acc = 0
    full = sum(1 for b in buffers if threshold and b >= 0.8 * threshold)
    return {
        "threshold_bytes": threshold,
        "buffers": len(buffers),
        "tensors_fused": members,
        "largest_bytes": max(buffers, default=0),
        "median_bytes": statistics.median(buffers) if buffers else 0,
        "full_buffers": full,
        "fused_bytes": fused_bytes,
        "unfused_bytes": unfused_bytes,
    }


def _gaps(traces: list[RankTrace]) -> dict[str, Any]:
    """Time with no operation in flight, per rank: compute or data loading between steps."""
    out: dict[str, Any] = {}
    for t in traces:
        spans = sorted(
            (o.neg_start if o.neg_start is not None else o.op_start, o.op_end)
            for o in t.occurrences
            if o.complete
        )
        if not spans:
            continue
        gaps, end = [], spans[0][1]
        for s, e in spans[1:]:
            if s > end:  # type: ignore[operator]
                gaps.append(s - end)  # type: ignore[operator]
            end = max(end, e)  # type: ignore[type-var]
        span = end - spans[0][0]  # type: ignore[operator]
        idle = sum(gaps)
        out[str(t.rank)] = {
            "span_us": span,
            "idle_us": idle,
            "idle_share": idle / span if span else 0.0,
            "largest_gap_us": max(gaps, default=0.0),
            "median_gap_us": statistics.median(gaps) if gaps else 0.0,
        }
    return out


def _recommend(s: dict[str, Any]) -> list[str]:
    """Advice, the advice that addresses the most time (µs) first."""
    recs: list[tuple[float, str]] = []
    ph, total = s["phases"], s["total_us"] or 1.0
    ops = s["operations"]
    for rank, st in s["stragglers"].items():
        waited = st["others_waited_us"]
        if ops >= 4 and st["last"] / ops >= (0.75 if len(s["ranks"]) <= 2 else 0.5):
            recs.append((waited, (
                f"rank {rank} submitted last in {st['last']} of {ops} operations; the others "
                f"waited {waited / 1e3:.1f} ms for it. Look at what that rank does before its "
                "collectives (more data, a slower device or host, a busier core, extra "
                "logging or checkpointing on that rank)."
            )))  # fmt: skip
    f = s["fusion"]
    thr, largest = f["threshold_bytes"], f["largest_bytes"]
    if thr and f["buffers"] >= 3 and f["full_buffers"] / f["buffers"] >= 0.5:
        recs.append((ph["communication"]["us"], (
            f"{f['full_buffers']} of {f['buffers']} fused buffers are at least 80% of the "
            f"fusion threshold ({thr / MiB:.1f} MiB): the threshold is too small for this "
            f"model; try HOROVOD_FUSION_THRESHOLD={2 * thr} (twice as large)."
        )))  # fmt: skip
    elif thr and f["buffers"] and largest < 0.1 * thr and f["unfused_bytes"] > 0:
        recs.append((ph["negotiation"]["us"] + ph["queue"]["us"], (
            f"the largest fused buffer ({largest / MiB:.2f} MiB) is under a tenth of the "
            f"fusion threshold ({thr / MiB:.1f} MiB): the threshold is larger than what is "
            "ever ready together, so it does not limit fusion; a longer HOROVOD_CYCLE_TIME "
            "fuses more small tensors, a threshold near the largest buffer changes nothing."
        )))  # fmt: skip
    neg = ph["negotiation"]
    if neg["share"] >= 0.3:
        recs.append((neg["us"], (
            f"negotiation (not counting waits for a slow rank) takes {100 * neg['share']:.0f}% "
            "of the operations' time: many small tensors cost a round trip each; group them "
            "(DistributedOptimizer groups=, grouped_allreduce) and keep the response cache on "
            "(HOROVOD_CACHE_CAPACITY)."
        )))  # fmt: skip
    comm = ph["communication"]
    if comm["share"] >= 0.5:
        recs.append((comm["us"], (
            f"the transfer itself takes {100 * comm['share']:.0f}% of the operations' time: "
            "the job is communication-bound; compress gradients (Compression.fp16), use a "
            "larger batch per rank, or a faster backend or network."
        )))  # fmt: skip
    copies = ph["fusion copy in"]["us"] + ph["fusion copy out"]["us"]
    if copies / total >= 0.2:
        recs.append((copies, (
            f"copies into and out of the fusion buffer take {100 * copies / total:.0f}%: "
            "large tensors are better sent on their own; lower HOROVOD_FUSION_THRESHOLD."
        )))  # fmt: skip
    for rank, g in s["gaps"].items():
        big, med = g["largest_gap_us"], g["median_gap_us"]
        if g["idle_share"] >= 0.5 and med and big >= 3 * med and big >= 1e4:
            recs.append((big, (
                f"rank {rank} has nothing to communicate for {100 * g['idle_share']:.0f}% of "
                f"the trace, and its longest gap ({big / 1e3:.1f} ms) is {big / med:.0f}x the "
                "median gap: steps wait on input; check the data loading (DataLoader "
                "num_workers, pin_memory, prefetching, caching)."
            )))  # fmt: skip
            break
    return [text for _, text in sorted(recs, key=lambda r: -r[0])]


# -- the report -----------------------------------------------------------------------------
def report(s: dict[str, Any], top: int = 10) -> str:
    lines = [
        f"ranks: {', '.join(map(str, s['ranks']))}; operations: {s['operations']}; "
        f"time in operations (all ranks): {s['total_us'] / 1e3:.3f} ms",
        "",
        f"{'phase':<24}{'ms':>12}{'share':>9}",
    ]
    for k, v in s["phases"].items():
        lines.append(f"{k:<24}{v['us'] / 1e3:>12.3f}{100 * v['share']:>8.1f}%")
    lines.append(f"{'total':<24}{s['total_us'] / 1e3:>12.3f}{100.0 if s['total_us'] else 0:>8.1f}%")
    lines += ["", f"{'tensor':<40}{'ops':>6}{'ms':>11}{'share':>8}  straggler"]
    for name, t in list(s["tensors"].items())[:top]:
        share = t["total_us"] / s["total_us"] if s["total_us"] else 0.0
        st = t["straggler"]
        who = f"rank {st['rank']} ({st['last']}/{st['of']})" if st else "-"
        lines.append(
            f"{name[:39]:<40}{t['count']:>6}{t['total_us'] / 1e3:>11.3f}{100 * share:>7.1f}%  {who}"
        )
    if len(s["tensors"]) > top:
        lines.append(f"... {len(s['tensors']) - top} more tensors (--top N shows more)")
    f = s["fusion"]
    thr = f["threshold_bytes"]
    lines += [
        "",
        "fusion: "
        + (
            f"{f['buffers']} fused buffers holding {f['tensors_fused']} tensors; largest "
            f"{f['largest_bytes'] / MiB:.2f} MiB, median {f['median_bytes'] / MiB:.2f} MiB"
            + (
                f", threshold {thr / MiB:.1f} MiB ({f['full_buffers']} at least 80% full)"
                if thr
                else ", threshold unknown (--fusion-threshold)"
            )
            + f"; {f['unfused_bytes'] / MiB:.2f} MiB travelled unfused"
        ),
    ]
    for rank, g in s["gaps"].items():
        lines.append(
            f"rank {rank}: idle {100 * g['idle_share']:.0f}% of "
            f"{g['span_us'] / 1e3:.1f} ms, longest gap "
            f"{g['largest_gap_us'] / 1e3:.1f} ms"
        )
    for a in s["autotune"]:
        lines.append("autotune trial: " + ", ".join(f"{k} {v}" for k, v in a.items() if k != "ts"))
    lines += ["", "recommendations:"]
    recs = s["recommendations"] or ["nothing stands out."]
    lines += [f"{i}. {r}" for i, r in enumerate(recs[:5], 1)]
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="timeline files, one per rank (HOROVOD_TIMELINE=tl.{rank}.json), or rank 0's alone",
    )
    parser.add_argument(
        "-o", "--output", default="", help="write the merged Chrome/Perfetto trace here"
    )
    parser.add_argument(
        "--align",
        choices=("wall", "ops"),
        default="wall",
        help="wall: the files' wall-clock starts (one host); ops: also line "
        "up the ends of shared collectives (hosts with skewed clocks)",
    )
    parser.add_argument(
        "--fusion-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="the threshold to compare fused buffers with (default: the one the timeline recorded)",
    )
    parser.add_argument("--summary-json", default="", help="write the summary's numbers here")
    parser.add_argument("--top", type=int, default=10, help="tensors shown in the summary")


def command(args: argparse.Namespace) -> int:
    try:
        traces = load(list(args.files))
    except ValueError as e:
        print(f"hora timeline: {e}", file=sys.stderr)
        return 2
    align(traces, args.align)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(merge(traces), f, separators=(",", ":"))
    summary = analyze(traces, args.fusion_threshold)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    print(report(summary, args.top))
    if args.output:
        print(f"\nmerged trace: {args.output} (open it in https://ui.perfetto.dev)")
    return 0
