"""``python -m hora.lab allreduce`` (and ``hora bench allreduce``): allreduce against the peers.

For each backend (hora, torch.distributed Gloo, mpi4py on Open MPI) this module starts a fresh
set of worker processes on this host (:mod:`hora.lab.workers`), lets them time float32 Sum
allreduces of every size, and collects rank 0's numbers: median and p90 latency, and bus
bandwidth. A backend that cannot run here is reported as skipped, with the reason. With
``device="cuda"`` (``--device cuda``) the buffers are CUDA tensors and the backends are those of
:data:`hora.lab.gpu.CUDA_BACKENDS` (hora on NCCL, hora staged through pinned memory,
torch.distributed's NCCL), one GPU per rank. The Python
API is :func:`run_allreduce_bench`; the command line only turns argv into an
:class:`AllreduceBenchConfig`.

Runs in the caller's thread; it blocks while the workers run. Not meant to be called from two
threads at once (each call owns its worker processes and temporary directory).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import platform
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from hora.lab import envreport, gpu, moved, report
from hora.lab.procs import (
    HORA_VARIANTS,
    BackendFailed,
    base_env,
    follow,
    free_port,
    start,
    stop,
    tail,
    warmup_iters,
    worker_cmd,
)

log = logging.getLogger("hora.lab")

BACKENDS = ("hora", "hora-tcp", "hora-shm-staged", "gloo", "mpi")
DEFAULT_BACKENDS = ("hora", "gloo", "mpi")
# the backends each --device offers, and those it runs by default
DEVICE_BACKENDS = {"cpu": (BACKENDS, DEFAULT_BACKENDS), "cuda": (gpu.CUDA_BACKENDS,) * 2}
TORCH_PEERS = ("gloo", "nccl")  # started with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE
DEFAULT_SIZES = [4 * 4**k * 1024 for k in range(0, 9, 2)]  # 4 KiB, 64 KiB, 1 MiB, 16, 256 MiB
EXAMPLES = """examples:
  hora bench allreduce                      hora, Gloo and Open MPI, 4 KiB to 256 MiB, np=2
  hora bench allreduce --backends hora,hora-tcp,gloo,mpi --engine-cost
                                            also TCP alone, and the engine's own cost
  hora bench allreduce --np 4 --repeat 3 --csv ar.csv --plot ar.png
                                            4 ranks, best of 3 rounds, files to keep
  HOROVOD_FUSION_THRESHOLD=0 hora bench allreduce --backends hora
                                            knobs in the environment reach hora's ranks
  hora bench allreduce --device cuda        CUDA tensors: hora on NCCL, hora staged through
                                            pinned memory, torch's NCCL; one rank per GPU
  hora bench allreduce --device cuda --np 1 --sizes 4K,1M,64M --json gpu.json
                                            one GPU: each call's cost, no link crossed
  sudo hora bench allreduce --netns 2 --link-rate 1gbit
                                            across 2 hosts (network namespaces here) of 2
                                            ranks each, 1 Gbit/s per host link; 1M to 256M

Compare ratios within one run: the title names this machine's memory copy speed now."""
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
_SIZE = re.compile(r"^(\d+)\s*([KMG]?)(?:I?B)?$")


def parse_size(text: str) -> int:
    """Bytes in ``"4096"``, ``"4K"``, ``"16M"``, ``"1G"`` (binary units; ``KiB``/``KB`` too)."""
    m = _SIZE.match(text.strip().upper())
    if m is None:
        raise ValueError(f"size {text!r} is not a number of bytes like 4096, 4K, 16M or 1G")
    nbytes = int(m.group(1)) * _UNITS[m.group(2)]
    if nbytes <= 0 or nbytes % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return nbytes


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes, sorted and without duplicates."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"--sizes {text!r} names no size; give e.g. 4K,64K,1M")
    return sorted({parse_size(p) for p in parts})


def parse_backends(text: str, device: str = "cpu") -> list[str]:
    known = DEVICE_BACKENDS[device][0]
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        on = f" with --device {device}" if device != "cpu" else ""
        raise ValueError(f"--backends {text!r}: choose from {', '.join(known)}{on}")
    return list(dict.fromkeys(names))


def default_iters(size_bytes: int) -> int:
    """Timed calls for one size: about 4 GiB of data, between 10 and 1000 calls."""
    return max(10, min(1000, (4 << 30) // size_bytes))


@dataclass
class AllreduceBenchConfig:
    np: int = 2
    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    iters: int | None = None  # None: default_iters(size) per size
    backends: list[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))
    engine_cost: bool = False
    repeat: int = 1  # rounds over all backends; each row keeps its best round
    timeout: float = 600.0  # seconds per backend
    csv: str | None = None
    json: str | None = None
    plot: str | None = None
    device: str = "cpu"  # cuda: CUDA tensors, gpu.CUDA_BACKENDS, one GPU per rank
    netns: int = 0  # >= 2: ranks split over this many hosts (hora.lab.netns)
    link_rate: str = "10gbit"  # each such host's link, per direction

    def __post_init__(self) -> None:
        if self.netns:  # hosts made here: hora.lab.netns
            importlib.import_module("hora.lab.netns").check(self)
        if self.device not in DEVICE_BACKENDS:
            raise ValueError(f"--device {self.device!r}: choose from {', '.join(DEVICE_BACKENDS)}")
        if self.np < 1:  # one: a world of one, each call's own cost (no link crossed)
            raise ValueError(f"--np must be at least 1, got {self.np}")
        if self.device == "cuda":
            if self.engine_cost:
                raise ValueError(
                    "--engine-cost times hora's engine on host buffers: not with --device cuda"
                )
            wrong = [b for b in self.backends if b not in gpu.CUDA_BACKENDS]
            if wrong:
                raise ValueError(
                    f"--device cuda runs {', '.join(gpu.CUDA_BACKENDS)}, not {', '.join(wrong)}"
                )
        if self.engine_cost and self.np < 2:
            raise ValueError("--engine-cost times the engine against a backend's exchange: "
                             "--np 2 or more")
        if self.iters is not None and self.iters < 1:
            raise ValueError(f"--iters must be at least 1, got {self.iters}")
        if self.repeat < 1:
            raise ValueError(f"--repeat must be at least 1, got {self.repeat}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be positive seconds, got {self.timeout}")
        if not self.sizes or not self.backends:
            raise ValueError("give at least one size and one backend")

    def plan(self, out: str, label: str) -> dict[str, Any]:
        """What ``label``'s workers need: sizes, iterations and warm-up, the result file."""
        iters = [self.iters or default_iters(s) for s in self.sizes]
        resnet = self.iters or default_iters(25_557_032 * 4)
        small = self.iters or 1000
        return {
            "label": label,
            "device": self.device,
            "sizes": self.sizes,
            "iters": iters,
            "warmup": [warmup_iters(i) for i in iters],
            "out": out,
            "timeout": self.timeout,
            "engine_cost": self.engine_cost,
            "small_iters": small,
            "small_warmup": warmup_iters(small),
            "resnet_iters": resnet,
            "resnet_warmup": warmup_iters(resnet),
            # hora on host buffers: the bytes each rank moved per size (hora.lab.moved)
            "moved": f"{out}.moved" if self.device == "cpu" and not self.netns else None,
        }


@dataclass
class BenchResult:
    meta: dict[str, Any]
    rows: list[report.Row]  # with bandwidths
    skipped: dict[str, str]  # backend -> why it did not run

    def title(self) -> str:
        if self.meta.get("device") == "cuda":
            return (
                f"allreduce float32 Sum of CUDA tensors, np={self.meta['np']}, "
                f"{self.meta['gpu']}, {self.meta['host']}"
            )
        title = f"allreduce float32 Sum, np={self.meta['np']}, {self.meta['host']}"
        if "link_rate" in self.meta:  # across hora.lab.netns's hosts
            title += f", {self.meta['across']}"
        copy = self.meta.get("copy_speed")
        return f"{title}, memory copy {copy} per core" if copy else title


def unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run on this machine, or None when it can."""
    if backend in gpu.CUDA_BACKENDS:
        return gpu.unavailable(backend)
    if backend in HORA_VARIANTS:
        return None if importlib.util.find_spec("hora.frameworks.ops") else "hora core missing"
    if backend == "gloo":
        return None if importlib.util.find_spec("torch") else "torch is not installed"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed"
    return None if shutil.which("mpirun") else "mpirun is not on PATH"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _spawn(
    backend: str, nranks: int, plan_path: str, tmp: str, extra: dict[str, str]
) -> list[subprocess.Popen[bytes]]:
    env = base_env()
    if backend in gpu.CUDA_BACKENDS:  # the variant's own choice only
        env = gpu.without_backend_choice(env)
    env.update(extra)
    if backend == "mpi":
        cmd = ["mpirun", "--allow-run-as-root", "-np", str(nranks)]
        if nranks > (os.cpu_count() or 1):
            cmd.append("--oversubscribe")
        return [start(cmd + worker_cmd(backend, plan_path), env, f"{tmp}/mpi.log")]
    if backend in TORCH_PEERS:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nranks))
    procs = []
    for rank in range(nranks):
        renv = dict(env)
        if backend in TORCH_PEERS:
            renv.update(RANK=str(rank), LOCAL_RANK=str(rank))
        else:
            renv.update(
                HORA_RANK=str(rank),
                HORA_SIZE=str(nranks),
                HORA_LOCAL_RANK=str(rank),
                HORA_LOCAL_SIZE=str(nranks),
                HORA_CROSS_RANK="0",
                HORA_CROSS_SIZE="1",
            )
        procs.append(start(worker_cmd(backend, plan_path), renv, f"{tmp}/{backend}.{rank}.log"))
    return procs


def run_backend(
    backend: str,
    config: AllreduceBenchConfig,
    tmp: str,
    on_row: Callable[[report.Row], None],
    tag: str = "",
) -> list[report.Row]:
    """Start ``config.np`` workers for ``backend``, return rank 0's rows; BackendFailed on error.

    ``tmp`` holds the plan, results and logs, named after ``backend`` and ``tag``.
    """
    out = os.path.join(tmp, f"{backend}{tag}.jsonl")
    plan_path = os.path.join(tmp, f"{backend}{tag}.plan.json")
    with open(plan_path, "w") as f:
        json.dump(config.plan(out, backend), f)
    server = None
    extra: dict[str, str] = {}
    if backend in HORA_VARIANTS:
        from hora.rendezvous.server import RendezvousServer

        secret = secrets.token_bytes(32)
        server = RendezvousServer(secret, host="127.0.0.1")
        extra = {
            **HORA_VARIANTS[backend],
            "HORA_RENDEZVOUS_ADDR": "127.0.0.1",
            "HORA_RENDEZVOUS_PORT": str(server.start()),
            "HORA_SECRET_KEY": secret.hex(),
        }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs = _spawn(backend, config.np, plan_path, tmp, extra)
        try:
            return follow(procs, out, config.timeout, on_row)
        except BackendFailed as e:
            logs = sorted(
                n for n in os.listdir(tmp) if n.startswith(backend + ".") and n.endswith(".log")
            )
            tails = "\n".join(f"--- {n}\n{tail(os.path.join(tmp, n))}" for n in logs)
            raise BackendFailed(f"{e}\n{tails}") from e
    finally:
        stop(procs)
        if server is not None:
            server.stop()


def run_allreduce_bench(
    config: AllreduceBenchConfig, progress: Callable[[str], None] | None = None
) -> BenchResult:
    """Measure every backend of ``config`` in turn; write the CSV/JSON/plot files it names."""
    say = progress or (lambda _msg: None)
    meta = {
        "np": config.np,
        "host": f"{socket.gethostname()} ({os.cpu_count()} CPUs)",
        "copy_speed": envreport.copy_speed(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "versions": {d: _version(d) for d in ("hora", "numpy", "torch", "mpi4py")},
        "dtype": "float32",
        "op": "sum, in place",
        "repeat": config.repeat,
        "device": config.device,
    }
    if config.device == "cuda":
        meta["gpu"] = gpu.describe()
    rows: list[report.Row] = []
    skipped: dict[str, str] = {}
    counts: dict[str, Any] = {}  # backend -> what each rank moved (hora.lab.moved)

    def on_row(row: report.Row) -> None:
        (done,) = report.with_bandwidth([row], config.np)
        say(
            f"[{done['backend']}] {done['case']} {report.human_size(done['size_bytes'])}: "
            f"p50 {done['median_s'] * 1e3:.3f} ms, p90 {done['p90_s'] * 1e3:.3f} ms, "
            f"busbw {done['busbw_gbps']:.3f} GB/s ({done['iters']} iterations)"
        )

    hosts = None
    if config.netns:  # the ranks on hosts made here (hora.lab.netns)
        from hora.lab import netns

        hosts = netns.Hosts(config.netns, config.np // config.netns, config.link_rate)
        meta.update(hosts.describe())
    nothing = contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="hora-bench-") as tmp, hosts or nothing:
        for round_ in range(1, config.repeat + 1):
            tag = f" #{round_}" if config.repeat > 1 else ""
            for backend in config.backends:
                if backend in skipped:
                    continue
                reason = unavailable(backend) or (hosts.unavailable(backend) if hosts else None)
                if reason is None and config.device == "cuda":
                    reason = gpu.short_of_devices(config.np, backend)
                if reason is not None:
                    skipped[backend] = reason
                    say(f"[{backend}] skipped: {reason}")
                    continue
                say(f"[{backend}{tag}] starting {config.np} workers")
                try:
                    run = hosts.run_backend if hosts else run_backend
                    label = backend + tag.replace(" #", ".")
                    found = run(backend, config, tmp, on_row, tag.replace(" #", "."))
                    rows += [{**row, "round": round_} for row in found]
                    counted = moved.load(os.path.join(tmp, f"{label}.jsonl.moved"))
                    if counted is not None:
                        counts[backend] = counted
                except BackendFailed as e:
                    skipped[backend] = f"failed: {e}"
                    say(f"[{backend}{tag}] failed: {e}")
    if counts:
        meta["moved"] = counts
    if hosts:
        meta.update(link_bytes=hosts.link_bytes, layouts=hosts.layouts)
    result = BenchResult(meta, report.with_bandwidth(report.best_of(rows), config.np), skipped)
    if config.csv:
        with open(config.csv, "w") as f:
            f.write(report.to_csv(result.rows))
    if config.json:
        with open(config.json, "w") as f:
            f.write(report.to_json(result.meta, result.rows, result.skipped))
    if config.plot and any(r["case"] == "allreduce" for r in result.rows):
        report.plot_bus_bandwidth(result.rows, config.plot, result.title())
    return result


def render(result: BenchResult) -> str:
    """The terminal report: the main table, then the engine-cost table, then what was skipped."""
    lines = [
        result.title(),
        "latency per call after warm-up; busbw = size / p50 * 2(n-1)/n; "
        "vs x = this hora row's busbw over x's (above 1: hora is faster)",
        "",
    ]
    if result.meta.get("device") == "cuda":
        note = "each timed call ends with torch.cuda.synchronize(): from the call to the sum"
        if result.meta["np"] == 1:
            note += "; at np=1 busbw is 0 (no link crossed): compare p50"
        lines.insert(2, note)
    if "link_rate" in result.meta:
        from hora.lab import netns

        lines[1:2] = netns.header(result.meta)
        lines.append(netns.table(result.rows, result.meta))
    elif any(r["case"] == "allreduce" for r in result.rows):
        lines.append(report.allreduce_table(result.rows))
    if any(r["case"] in ("api", "resnet50") for r in result.rows):
        lines += [
            "",
            "engine cost (hora): A against B, alternating call by call",
            report.engine_cost_table(result.rows),
        ]
    if any(r["case"] in report.PER_OP_CASES for r in result.rows):
        lines += [
            "",
            "per op (hora), back to back: CPU per call of rank 0's engine thread and calling "
            "thread",
            report.per_op_table(result.rows),
        ]
    for backend, counted in result.meta.get("moved", {}).items():
        lines += [
            "",
            f"bytes moved per rank ({backend}, np={result.meta['np']}), counted: the most any rank "
            "sent, received, copied and reduced, in buffers; a ring's 2(n-1)/n is the optimum",
            moved.table(counted),
        ]
    if "link_rate" in result.meta:
        lines += netns.footer(result.meta)
    for backend, reason in result.skipped.items():
        lines.append(f"skipped {backend}: {reason}")
    return "\n".join(lines) + "\n"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's options to ``parser``."""
    parser.add_argument(
        "--device",
        choices=list(DEVICE_BACKENDS),
        default="cpu",
        help="cpu (default): host buffers; cuda: CUDA tensors, backends "
        f"{','.join(gpu.CUDA_BACKENDS)}, one GPU per rank",
    )
    parser.add_argument(
        "--np",
        type=int,
        default=None,
        help="ranks per backend (default 2; --device cuda: one per GPU here; --netns: 2 per host)",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help="comma-separated message sizes per rank, e.g. 4K,1M,256M (default "
        "4K,64K,1M,16M,256M; with --netns 1M,4M,16M,64M,256M)",
    )
    parser.add_argument("--netns", type=int, default=0, metavar="HOSTS", help="run across HOSTS "
                        "hosts made here (root): network namespaces on a bridge, --np split evenly "
                        "over them; TCP between hosts, shared memory within, as on a cluster")
    parser.add_argument("--link-rate", default="10gbit", metavar="RATE", help="with --netns: each "
                        "host's link speed per direction, in tc's notation (default 10gbit)")
    parser.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed calls per size (default: about 4 GiB of data, 10 to 1000)",
    )
    parser.add_argument(
        "--backends",
        default=None,
        help=f"comma-separated, from {','.join(BACKENDS)} (default {','.join(DEFAULT_BACKENDS)}); "
        "hora-tcp is hora with shared memory off, hora-shm-staged hora with "
        "HORA_SHM_SINGLE_COPY=0 (as under Yama's ptrace_scope=1); with --device cuda from "
        f"{','.join(gpu.CUDA_BACKENDS)} (default all): hora-nccl is hora with "
        "HOROVOD_GPU_OPERATIONS=NCCL, hora-staged hora's CPU backend through pinned memory, "
        "nccl torch.distributed's NCCL",
    )
    parser.add_argument(
        "--engine-cost",
        action="store_true",
        help="also time hora's API against its backend called directly, and "
        "ResNet-50's 161 gradient tensors against one buffer",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds allowed per backend (default 600)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds over all backends; each size keeps its best (lowest p50) round (default 1)",
    )
    parser.add_argument("--csv", metavar="FILE", help="write the measurements as CSV")
    parser.add_argument("--json", metavar="FILE", help="write the measurements as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write a PNG of bus bandwidth")


def config_from_args(args: argparse.Namespace) -> AllreduceBenchConfig:
    device = getattr(args, "device", "cpu")
    np = args.np
    if np is None:  # one rank per GPU: NCCL refuses two ranks on one device
        np = max(gpu.device_count(), 1) if device == "cuda" else 2 * (args.netns or 1)
    default = ",".join(DEVICE_BACKENDS[device][1])
    sizes = args.sizes or ("1M,4M,16M,64M,256M" if args.netns else "4K,64K,1M,16M,256M")
    return AllreduceBenchConfig(
        np=np,
        device=device,
        netns=args.netns,
        link_rate=args.link_rate,
        sizes=parse_sizes(sizes),
        iters=args.iters,
        backends=parse_backends(args.backends or default, device),
        engine_cost=args.engine_cost,
        repeat=args.repeat,
        timeout=args.timeout,
        csv=args.csv,
        json=args.json,
        plot=args.plot,
    )


def command(args: argparse.Namespace) -> int:
    """Run from parsed arguments: progress on stderr, the report on stdout.

    Returns 0, 1 when no backend produced a measurement, 2 for bad options.
    """
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"hora.lab allreduce: error: {e}", file=sys.stderr)
        return 2
    result = run_allreduce_bench(config, lambda msg: print(msg, file=sys.stderr, flush=True))
    sys.stdout.write(render(result))
    return 0 if result.rows else 1
