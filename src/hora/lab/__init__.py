"""hora's lab: benchmarks that measure hora beside its peers on this machine.

``python -m hora.lab <benchmark> [options]`` and ``hora bench <benchmark> [options]`` run the
same code. Each benchmark module offers ``configure(parser)`` (adds its options to an
``argparse`` parser), ``command(args) -> int`` (runs it) and a Python API; this package gives
``hora bench`` the same two functions over all of them, loading a benchmark's module only when
it runs. Called from the main thread of a command-line process.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

# benchmark name -> (module, one-line summary); a module's EXAMPLES text ends its --help
BENCHMARKS: dict[str, tuple[str, str]] = {
    "allreduce": (
        "hora.lab.allreduce",
        "allreduce latency and bus bandwidth of hora beside torch Gloo and Open MPI",
    ),
    "scaling": (
        "hora.lab.scaling",
        "training step time, throughput and speedup per backend, process count and server count",
    ),
    "report": ("hora.lab.bench_report", "render saved scaling results again, or compare two"),
    "ddp": ("hora.lab.ddp", "the same DDP training and dist.all_reduce on backend gloo and hora"),
    "clients": ("hora.lab.clients", "Lightning's and Accelerate's training step on gloo and hora"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    """Add one sub-command per benchmark to ``parser`` (``hora bench``'s parser)."""
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module, summary) in BENCHMARKS.items():
        bench = importlib.import_module(module)
        child = sub.add_parser(
            name,
            help=summary,
            description=summary,
            epilog=getattr(bench, "EXAMPLES", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        bench.configure(child)


def command(args: argparse.Namespace) -> int:
    """Run the benchmark ``configure``'s parser selected."""
    module = importlib.import_module(BENCHMARKS[args.benchmark][0])
    return int(module.command(args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hora.lab", description="hora's benchmarks", allow_abbrev=False
    )
    configure(parser)
    args = parser.parse_args(argv)
    return command(args)
