"""``hora bench scaling``: the scaling lab in one command.

For every model x backend x placement (processes per server x servers), it launches the
training benchmark (:func:`hora.lab.train_worker.train`) through :func:`hora.run`, and turns
every rank's step times into a row: mean step time with its spread, throughput, speedup over
one process, scaling efficiency and the share of a step spent waiting on communication
(:mod:`hora.lab.bench_results`). Backends that cannot run here are reported as skipped with the
reason; configurations that fail are reported with theirs. A progress bar on stderr says which
configuration runs and how far it is; a line is printed per finished configuration. The
environment of every server is collected (:mod:`hora.lab.envreport`). The tables go to stdout;
``--out DIR`` also gets results.json/.csv, tables.md and PNG plots.

Placements: ``--np`` lists total process counts. Without hosts, each runs on this host. With
``-H``/``--hostfile`` each count ``n`` runs as every balanced split ``servers x per_server = n``
that the hosts' slots allow, filling hosts in the order given (``--np 1,2,4 -H a:2,b:2``: 1x1,
1x2, 2x1, 2x2), so both of the lab's tables (inside one server, across servers) get filled.

Devices: ``--device auto`` (the default) trains on CUDA when torch sees a GPU, else on the CPU.
On CUDA every backend runs (native, Gloo and MPI stage the gradients through pinned memory,
NCCL reduces them on the GPU), and a :class:`hora.lab.gpu_sampler.GpuSampler` polls this host's
GPUs while each configuration trains: its mean and peak utilisation and peak memory go into the
configuration's row.

Runs in the caller's thread, plus daemon threads that poll the progress file and the GPUs. Not
meant to be called from two threads at once: each configuration redirects
``sys.stdout``/``sys.stderr`` into its log while it runs, so that worker output does not tear
through the progress bar.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from hora.errors import LaunchError
from hora.lab import bench_report, bench_results, compression, envreport, gpu, scaling_netns
from hora.lab.bench_results import Row, ScalingResult
from hora.lab.gpu_sampler import GpuSampler
from hora.lab.netns import parse_rate as netns_parse_rate
from hora.lab.progress import Progress, poll, timed
from hora.lab.train_worker import DEFAULT_BATCH, DEFAULT_GPU_BATCH, MODELS, TrainSpec, train
from hora.launch.hosts import HostSlots, parse_hostfile, parse_hosts
from hora.launch.workerenv import TORCH_HUGE_PAGES

log = logging.getLogger("hora.lab")

BACKENDS = ("native", "gloo", "mpi", "nccl", "ddp")
EXAMPLES = """examples:
  hora bench scaling                        cnn, every backend, 1 and 2 processes here
  hora bench scaling --model cnn --backends native,gloo,mpi --np 1,2,4 --out results/
  hora bench scaling --model all --np 1,2 --repeat 3 --out results/
  hora bench scaling --model mlp,lstm --np 1,2,4 -H server1:2,server2:2 --out results/
                                            across servers, over ssh as hora run does
  hora bench scaling --device cuda --model resnet50 --np 1 --steps 10 --out gpu/
                                            on the GPU, with its utilisation per configuration
  hora bench scaling --device cpu           on the CPU even where there is a GPU
  hora bench report results/                tables and plots again from a saved run"""


def parse_names(text: str, known: Sequence[str], what: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]`` checked against ``known``; ``"all"`` -> ``known``."""
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    if names == ["all"]:
        return list(known)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--{what} {text!r}: choose from {', '.join(known)} (or all)")
    return list(dict.fromkeys(names))


def parse_counts(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (sorted, positive)."""
    try:
        counts = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError as e:
        raise ValueError(f"--np {text!r}: give process counts like 1,2,4") from e
    if not counts or counts[0] < 1:
        raise ValueError(f"--np {text!r}: give positive process counts like 1,2,4")
    return counts


@dataclass(frozen=True)
class Placement:
    """``servers`` hosts with ``per_server`` processes each."""

    servers: int
    per_server: int
    hosts: tuple[str, ...] = ()  # empty: this host, no -H

    @property
    def np(self) -> int:
        return self.servers * self.per_server

    def hosts_arg(self) -> str | None:
        return ",".join(f"{h}:{self.per_server}" for h in self.hosts) if self.hosts else None

    def label(self) -> str:
        return f"{self.servers} server{'s' * (self.servers > 1)} x {self.per_server}"


def placements(counts: Sequence[int], hosts: Sequence[HostSlots] = ()) -> list[Placement]:
    """Every placement of each process count (see the module docstring); ValueError when a
    count fits on no split of the hosts."""
    if not hosts:
        return [Placement(1, n) for n in counts]
    out = []
    for n in counts:
        fits = [
            Placement(s, n // s, tuple(h.name for h in hosts[:s]))
            for s in range(1, len(hosts) + 1)
            if n % s == 0 and all(h.slots >= n // s for h in hosts[:s])
        ]
        if not fits:
            slots = ",".join(f"{h.name}:{h.slots}" for h in hosts)
            raise ValueError(f"--np {n} fits no balanced split of the hosts {slots}")
        out += fits
    return out


def unavailable(backend: str, device: str = "cpu") -> str | None:
    """Why ``backend`` cannot run the training benchmark on ``device`` here, or None when it
    can."""
    from hora.backends import registry

    if backend == "ddp":  # torch's own, beside hora's backends: Gloo, or NCCL on the GPU
        import torch.distributed as dist

        if not dist.is_available():
            return "this build of torch has no torch.distributed"
        if device == "cuda":
            return gpu.unavailable("nccl")
        return None if dist.is_gloo_available() else "this build of torch has no Gloo"
    entry = registry.BACKENDS.get(backend)
    module = entry.split(":")[0] if entry else None
    if backend == "nccl":
        reason = gpu.unavailable("nccl")
        if reason is not None:
            return reason
        if device != "cuda":
            return "NCCL reduces GPU tensors: train on the GPU (--device cuda, or auto)"
    if module is None or importlib.util.find_spec(module) is None:
        return f"this build of hora has no {backend} backend ({module or 'not registered'})"
    if backend == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed"
        if shutil.which("mpirun") is None:
            return "mpirun is not on PATH (install Open MPI)"
    return None


@dataclass
class ScalingConfig:
    models: list[str] = field(default_factory=lambda: ["cnn"])
    backends: list[str] = field(default_factory=lambda: list(BACKENDS))
    nps: list[int] = field(default_factory=lambda: [1, 2])
    hosts: list[HostSlots] = field(default_factory=list)  # empty: this host
    batch_size: int | None = None  # None: DEFAULT_BATCH per model
    steps: int = 20
    warmup: int = 5
    threads: int = 1
    timeout: float = 600.0  # seconds per configuration
    repeat: int = 1  # rounds over every configuration; each keeps its best
    out: str | None = None
    examples_dir: str = ""
    data_dir: str = "./data"
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_config_file: str | None = None
    start_timeout: float = 30.0
    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu (resolved here)
    # hora's DistributedOptimizer(compression=) per configuration (hora.lab.compression names)
    compressions: list[str] = field(default_factory=lambda: ["none"])
    ddp_hook: str = ""  # the ddp backend's communication hook: "" or powersgd[-r<R>]
    netns: int = 0  # >= 2: across this many namespace hosts made here (hora.lab.scaling_netns)
    link_rate: str = "1gbit"  # with netns: each host's link, per direction

    def __post_init__(self) -> None:
        self.device = gpu.resolve_device(self.device)
        if self.repeat < 1:
            raise ValueError(f"--repeat {self.repeat}: give at least 1 round")
        for name in self.compressions:
            compression.check(name)
        if self.ddp_hook and not self.ddp_hook.startswith("powersgd"):
            raise ValueError(f"--ddp-hook {self.ddp_hook!r}: choose powersgd or powersgd-r<R>")
        for model in self.models:
            self.spec(model)  # validates batch size, steps, warm-up, threads, timeout
        if self.netns:
            if self.netns < 2 or self.hosts:
                raise ValueError("--netns: give 2 or more hosts, and no -H/--hostfile")
            netns_parse_rate(self.link_rate)
            self.placements = [Placement(self.netns, n // self.netns) for n in self.nps
                               if n % self.netns == 0]  # fmt: skip
            if not self.placements:
                raise ValueError(f"--np {self.nps}: none splits evenly over {self.netns} hosts")
        else:
            self.placements = placements(self.nps, self.hosts)

    def variants(self, backends: list[str]) -> list[str]:
        """The configurations' backend labels: ``native``, ``native+powersgd-r4``, ...; the
        DDP peer as ``ddp`` or, with a hook, ``ddp+<hook>``."""
        out = []
        for b in backends:
            if b == "ddp":
                out.append(f"ddp+{self.ddp_hook}" if self.ddp_hook else "ddp")
            else:
                out += [b if c == "none" else f"{b}+{c}" for c in self.compressions]
        return out

    def batch(self, model: str) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return (DEFAULT_GPU_BATCH if self.device == "cuda" else DEFAULT_BATCH)[model]

    def spec(self, model: str, progress_path: str | None = None,
             backend: str = "native") -> TrainSpec:  # fmt: skip
        """``backend`` is a label of :meth:`variants`."""
        base, _, variant = backend.partition("+")
        ddp = base == "ddp"
        return TrainSpec(
            model, self.batch(model), self.steps, self.warmup, self.threads, self.timeout,
            self.examples_dir, self.data_dir, progress_path, self.device, ddp,
            compression="none" if ddp or not variant else variant,
            ddp_hook=variant if ddp else "",
        )  # fmt: skip


def _why(error: Exception, log_path: str) -> str:
    """One line: what failed, and the last line the workers wrote about it."""
    text = str(error).strip().splitlines()
    detail = [ln for ln in text[1:] if ln.strip() and not ln.startswith(" ")]
    with contextlib.suppress(OSError), open(log_path, errors="replace") as f:
        detail += [ln.rstrip() for ln in f if ln.strip() and "Traceback" not in ln][-1:]
    reason = text[0] if text else type(error).__name__
    return f"{reason}: {detail[-1].strip()}" if detail else reason


def _worker_env(backend: str = "native", device: str = "cpu") -> dict[str, str]:
    """The workers' environment: one compute thread each; on CUDA, with only ``backend``'s own
    choice of hora's backend (the caller's HOROVOD_CPU/GPU_OPERATIONS left out)."""
    env = {**TORCH_HUGE_PAGES, **os.environ}  # as hora run gives them, to every launcher
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if device == "cuda":
        env = gpu.without_backend_choice(env)
        if backend == "nccl":
            env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
        elif backend == "native":  # gloo and mpi are named by hora.run itself
            env["HOROVOD_CPU_OPERATIONS"] = "native"
    return env


def _sampler(config: ScalingConfig, place: Placement, progress_path: str) -> GpuSampler | None:
    """A GPU sampler for the GPUs ``place`` uses on this host (None on the CPU)."""
    if config.device != "cuda":
        return None
    used = min(place.per_server, max(gpu.device_count(), 1))
    warmup = config.warmup
    return GpuSampler(gpu.visible_indices(used), timed=lambda: timed(progress_path, warmup))


def run_configuration(
    config: ScalingConfig, model: str, backend: str, place: Placement, logdir: str,
    progress: Progress, round_: int = 1,
) -> Row:  # fmt: skip
    """Train ``model`` on ``place`` with ``backend``; its row. RuntimeError (saying why) when
    the job failed or ran on another backend than asked."""
    name = f"{model}-{backend}-{place.servers}x{place.per_server}"
    name += f".round{round_}" if config.repeat > 1 else ""
    log_path = os.path.join(logdir, name + ".log")
    progress_path = os.path.join(logdir, name + ".progress")
    if config.device == "cuda" and backend == "nccl" and not place.hosts:
        count = gpu.device_count()
        if place.per_server > count:
            raise RuntimeError(
                f"nccl needs one GPU per process: {place.per_server} processes, {count} GPU(s) here"
            )
    sampler = _sampler(config, place, progress_path)
    stop = threading.Event()
    poller = threading.Thread(target=poll, args=(progress_path, progress, stop), daemon=True)
    poller.start()
    if sampler is not None:
        sampler.start()
    started = time.monotonic()
    try:
        with (
            open(log_path, "w") as log_file,
            contextlib.redirect_stdout(log_file),
            contextlib.redirect_stderr(log_file),
        ):
            spec, base = config.spec(model, progress_path, backend), backend.partition("+")[0]
            link_bytes = None  # what the namespace hosts' links sent
            if config.netns:
                ranks, link_bytes = scaling_netns.launch(spec, place.np, config.netns,
                                                         config.link_rate,
                                                         _worker_env(base, config.device))
            else:
                ranks = _launch(config, spec, base, place)
    except LaunchError as e:
        raise RuntimeError(_why(e, log_path)) from e
    finally:
        stop.set()
        poller.join(timeout=5)
        sampled = sampler.stop() if sampler is not None else None
        with contextlib.suppress(OSError):
            os.remove(progress_path)
    if any(r["backend"] != base for r in ranks):
        raise RuntimeError(f"asked for the {base} backend but ran on {ranks[0]['backend']}")
    info = {
        "model": model, "backend": backend, "servers": place.servers,
        "per_server": place.per_server, "hosts": list(place.hosts) or ["localhost"],
        "batch_size": config.batch(model), "steps": config.steps, "warmup": config.warmup,
        "wall_s": time.monotonic() - started, "device": config.device,
    }  # fmt: skip
    if link_bytes is not None:  # the hosts' links, over warm-up and timed steps alike
        info["link_bytes_per_step"] = link_bytes / (config.warmup + config.steps)
        info["link_rate"] = config.link_rate
    return {**bench_results.summarize(ranks, info), **(sampled or {})}


def _launch(config: ScalingConfig, spec: TrainSpec, backend: str, place: Placement) -> list[Any]:
    import hora

    return hora.run(
        train, args=(spec,), num_proc=place.np, hosts=place.hosts_arg(),
        use_gloo=backend == "gloo", use_mpi=backend == "mpi",
        env=_worker_env(backend, config.device),
        start_timeout=config.start_timeout, ssh_port=config.ssh_port,
        ssh_identity_file=config.ssh_identity_file, ssh_config_file=config.ssh_config_file,
    )  # fmt: skip


def collect_environment(config: ScalingConfig) -> list[dict[str, str]]:
    """:func:`envreport.collect` on every server the run uses (this host when none is given)."""
    from hora.launch.local import is_local_host

    names = list(dict.fromkeys(h for p in config.placements for h in p.hosts))
    if not names or all(is_local_host(n) for n in names):
        return [{**envreport.collect(), "server": names[0] if names else "localhost"}]
    import hora

    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        found = list(
            hora.run(
                envreport.collect, num_proc=len(names), hosts=",".join(f"{n}:1" for n in names),
                env=_worker_env(), start_timeout=config.start_timeout, ssh_port=config.ssh_port,
                ssh_identity_file=config.ssh_identity_file, ssh_config_file=config.ssh_config_file,
            )
        )  # fmt: skip
    return [{**env, "server": name} for env, name in zip(found, names)]


def _load() -> list[float]:
    """This host's 1, 5 and 15 minute load averages: how busy it was besides the benchmark."""
    return [round(x, 2) for x in os.getloadavg()]


def _share(value: float | None) -> str:
    return "inside backward" if value is None else f"{100 * value:.0f}%"


def _done_line(row: Row, base: float | None) -> str:
    speedup = f", speedup {row['throughput'] / base:.2f}" if base else ""
    gpus = (
        f", GPU {row['gpu_util_mean_pct']:.0f}% (max {row['gpu_util_max_pct']:.0f}%, "
        f"{row.get('gpu_samples', '?')} samples)"
        if "gpu_util_mean_pct" in row
        else ""
    )
    return (
        f"{row['model']} {row['backend']} {row['servers']}x{row['per_server']}: "
        f"{row['step_mean_s'] * 1e3:.1f} ± {row['step_std_s'] * 1e3:.1f} ms/step, "
        f"{row['throughput']:.1f} samples/s{speedup}, comm wait {_share(row['comm_share'])}"
        + gpus + (f", {bench_report.link_cell(row)} {bench_report.LINK_HEADER}"
                  if "link_bytes_per_step" in row else "")
    )


def _measure_all(
    config: ScalingConfig, backends: list[str], progress: Progress, logdir: str
) -> tuple[list[Row], list[dict[str, Any]]]:
    """Every configuration, ``config.repeat`` rounds over all of them; each keeps its best
    round (highest throughput) and the mean step time of every round."""
    best: dict[tuple[str, str, int, int], Row] = {}
    failed: list[dict[str, Any]] = []
    for round_ in range(1, config.repeat + 1):
        tag = f" (round {round_}/{config.repeat})" if config.repeat > 1 else ""
        for model in config.models:
            for backend in backends:
                for place in config.placements:
                    what = f"{model} {backend} {place.label()}{tag}"
                    progress.start(what)
                    try:
                        row = run_configuration(
                            config, model, backend, place, logdir, progress, round_
                        )
                    except RuntimeError as e:
                        failed.append({"model": model, "backend": backend, "round": round_,
                                       "servers": place.servers, "per_server": place.per_server,
                                       "reason": str(e)})  # fmt: skip
                        progress.line(f"{what} failed: {e}")
                        continue
                    key = bench_results.config_key(row)
                    kept = best.get(key, row)
                    rounds = [*kept.get("round_step_means_s", []), row["step_mean_s"]]
                    if row["throughput"] > kept["throughput"]:
                        kept = row
                    best[key] = {**kept, "round_step_means_s": rounds}
                    base = best.get((model, backend, 1, 1))
                    progress.line(_done_line(row, base["throughput"] if base else None) + tag)
    return list(best.values()), failed


def run_scaling(config: ScalingConfig, stream: TextIO | None = None) -> ScalingResult:
    """Run every configuration of ``config``; progress on ``stream`` (default stderr)."""
    stream = stream or sys.stderr
    skipped = {
        b: why for b in config.backends if (why := unavailable(b, config.device)
                                            or (scaling_netns.unavailable(b) if config.netns
                                                else None)) is not None
    }  # fmt: skip
    backends = config.variants([b for b in config.backends if b not in skipped])
    total = len(config.models) * len(backends) * len(config.placements) * config.repeat
    progress = Progress(stream, max(total, 1))
    for backend, why in skipped.items():
        progress.line(f"skipped {backend}: {why}", finished=False)
    meta = {
        "title": "hora scaling lab",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "models": config.models,
        "backends": config.backends,
        "nps": config.nps,
        "hosts": [f"{h.name}:{h.slots}" for h in config.hosts],
        "batch_sizes": {m: config.batch(m) for m in config.models},
        "steps": config.steps,
        "warmup": config.warmup,
        "threads": config.threads,
        "repeat": config.repeat,
        "device": config.device,
        "compressions": config.compressions,
        "ddp_hook": config.ddp_hook,
        **({"netns": config.netns, "link_rate": config.link_rate} if config.netns else {}),
        "gpu": gpu.describe() if config.device == "cuda" else None,
        "load_before": _load(),
    }
    environment = collect_environment(config)
    with contextlib.ExitStack() as stack:
        if config.out:
            logdir = os.path.join(config.out, "logs")
            os.makedirs(logdir, exist_ok=True)
        else:
            logdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="hora-scaling-"))
        rows, failed = _measure_all(config, backends, progress, logdir)
    meta["load_after"] = _load()
    result = ScalingResult(meta, environment, rows, skipped, failed)
    if config.out:
        for path in bench_report.save(result, config.out):
            log.info("wrote %s", path)
    return result


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``hora bench scaling``'s options to ``parser``."""
    add = parser.add_argument
    add("--model", default="cnn", help=f"comma-separated from {','.join(MODELS)}, or all "
        "(default cnn)")  # fmt: skip
    add("--backends", default=",".join(BACKENDS), help="comma-separated from "
        f"{','.join(BACKENDS)} (default all; those that cannot run here are listed as skipped)")  # fmt: skip  # noqa: E501
    add("--np", default="1,2", help="total process counts, e.g. 1,2,4 (default 1,2)")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="servers as host:slots,... e.g. a:2,b:2")
    hosts.add_argument("--hostfile", help="file with one 'host slots=N' per line")
    batches = ", ".join(f"{m} {b}" for m, b in DEFAULT_BATCH.items())
    add("--batch-size", type=int, help=f"samples per process per step (default: {batches})")
    add("--steps", type=int, default=20, help="timed steps per configuration (default 20)")
    add("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    add("--device", default="auto", choices=["auto", *gpu.DEVICES], help="where to train: "
        "cuda (one GPU per local rank, GPU utilisation sampled), cpu, or auto (default: cuda "
        "when torch sees a GPU)")  # fmt: skip
    add("--threads", type=int, default=1, help="torch threads per process (default 1)")
    add("--timeout", type=float, default=600.0, help="seconds per configuration (default 600)")
    add("--repeat", type=int, default=1, help="run every configuration R times, in R rounds "
        "over all of them, and keep each one's best round: the least disturbed by other work "
        "on the machine (default 1)")  # fmt: skip
    add("--out", metavar="DIR", help="write results.json/.csv, tables.md, PNG plots and logs")
    add("--examples-dir", default="", help="hora's examples/ folder (default: next to src/)")
    add("--data-dir", default="./data", help="MNIST files for --model mnist (default ./data; "
        "without them scikit-learn's digits)")  # fmt: skip
    add("-p", "--ssh-port", type=int, help="ssh port of the servers")
    add("-i", "--ssh-identity-file", help="ssh private key for the servers")
    add("--ssh-config-file", help="ssh client config (ssh -F) for host aliases")
    add("--start-timeout", type=float, default=30.0, help="seconds for a job to start")
    add("--compression", default="none", help="comma-separated DistributedOptimizer "
        f"compressions, each a configuration: {', '.join(compression.NAMES)} (default none)")
    add("--ddp-hook", default="", help="the ddp backend with torch's PowerSGD hook: powersgd "
        "(rank 4) or powersgd-r<R>")  # fmt: skip
    add("--netns", type=int, default=0, metavar="HOSTS", help="across HOSTS network-namespace "
        "hosts made here, links shaped to --link-rate (root; native and ddp)")  # fmt: skip
    add("--link-rate", default="1gbit", metavar="RATE", help="with --netns: each host's link "
        "per direction, in tc's notation (default 1gbit)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> ScalingConfig:
    hosts = (
        parse_hosts(args.hosts) if args.hosts else parse_hostfile(args.hostfile)
        if args.hostfile else []
    )  # fmt: skip
    return ScalingConfig(
        models=parse_names(args.model, MODELS, "model"),
        backends=parse_names(args.backends, BACKENDS, "backends"),
        nps=parse_counts(args.np), hosts=hosts, batch_size=args.batch_size, steps=args.steps,
        warmup=args.warmup, threads=args.threads, timeout=args.timeout, repeat=args.repeat,
        out=args.out,
        examples_dir=args.examples_dir, data_dir=args.data_dir, ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file, ssh_config_file=args.ssh_config_file,
        start_timeout=args.start_timeout, device=getattr(args, "device", "auto"),
        compressions=compression.parse_list(getattr(args, "compression", "none")),
        ddp_hook=getattr(args, "ddp_hook", ""), netns=getattr(args, "netns", 0),
        link_rate=getattr(args, "link_rate", "1gbit"),
    )  # fmt: skip


def command(args: argparse.Namespace) -> int:
    """Progress on stderr, tables on stdout; 0 when something was measured, 1 when nothing
    was, 2 for bad options."""
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"hora bench scaling: error: {e}", file=sys.stderr)
        return 2
    result = run_scaling(config)
    sys.stdout.write(bench_report.render_text(result))
    if config.out:
        print(f"results, tables and plots in {config.out}", file=sys.stderr)
    return 0 if result.rows else 1
