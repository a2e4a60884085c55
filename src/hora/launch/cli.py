"""The ``hora`` command: subcommand dispatch, and ``hora run`` (argv -> LaunchConfig -> Job).

Subcommands are listed in :data:`SUBCOMMANDS` by module path and imported only when used; a
module adds one by adding a line there. Such a module provides ``configure(parser)``, which adds
its arguments to an ``argparse.ArgumentParser``, and ``command(args) -> int``, which runs it.

``hora run`` takes horovodrun's flags with the same meanings (the ``horovodrun`` entry point is
the same thing). Knob flags are generated from :data:`hora.settings.KNOBS`. Runs in the
launcher's main thread.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from hora.errors import LaunchError
from hora.launch.config import LaunchConfig, knob_from_flag, read_config_file, resolve_settings
from hora.launch.hosts import parse_hostfile, parse_hosts
from hora.settings import KNOBS, env_lookup

log = logging.getLogger("hora.launch")

# name -> (module, one-line summary). The module provides configure(parser) and command(args).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("hora.launch.cli", "start a job on this host or many (horovodrun's flags)"),
    "check": ("hora.launch.check", "show frameworks, backends, transports and GPUs found here"),
    "bench": ("hora.lab", "benchmarks: allreduce, scaling (the scaling lab), report"),
}

# Flags accepted for compatibility that hora does not act on yet: flag -> what hora says.
UNSUPPORTED: dict[str, str] = {
    "--disable-cache": "hora does not cache the ssh and interface checks; they run every launch",
    "--tcp": "not supported yet; hora's native backend always uses TCP between hosts",
    "--num-nccl-streams": "not supported yet; ignored",
    "--jsrun": "not supported yet; running with hora's own launcher instead",
}

_SECTION_TITLES = {
    "params": ("tunables", "hora run -np 4 --fusion-threshold-mb 32 --cycle-time-ms 2 python t.py"),
    "autotune": ("autotune", "hora run -np 4 --autotune --autotune-log-file at.csv python t.py"),
    "timeline": ("timeline", "hora run -np 2 --timeline-filename tl.json python t.py"),
    "stall_check": (
        "stall check",
        "hora run -np 2 --stall-check-warning-time-seconds 120 python t.py",
    ),
    "logging": ("logging", "hora run -np 2 --log-level DEBUG python t.py"),
    None: ("library options", "hora run -np 2 --gloo-timeout-seconds 60 python t.py"),
}


def _group(parser: argparse.ArgumentParser, title: str, example: str) -> argparse._ArgumentGroup:
    return parser.add_argument_group(title, f"example: {example}")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``hora run``'s arguments to ``parser``."""
    g = _group(parser, "general", "hora run -np 4 python train.py --lr 0.1")
    g.add_argument("-v", "--version", action="store_true", help="print hora's version and exit")
    g.add_argument("-np", "--num-proc", dest="np", type=int, help="number of processes")
    g.add_argument(
        "-cb",
        "--check-build",
        action="store_true",
        help="show what this installation supports (same as `hora check`)",
    )
    g.add_argument(
        "--start-timeout",
        type=float,
        help="seconds for the ssh checks of remote hosts (default 30, or HORA_START_TIMEOUT)",
    )
    g.add_argument("--network-interfaces", help="comma-separated interfaces to use, e.g. eth0")
    g.add_argument(
        "--network-interface",
        action="append",
        dest="network_interface",
        help="one interface; may repeat (deprecated form of --network-interfaces)",
    )
    g.add_argument(
        "--output-filename", help="also write each rank's output to DIR/rank.<N>/stdout and stderr"
    )
    g.add_argument(
        "--verbose",
        action="store_true",
        default=None,
        help="say what the launcher does (interfaces chosen, commands run)",
    )
    g.add_argument(
        "--config-file", help="Horovod-style YAML file of settings; flags given here win over it"
    )
    g.add_argument(
        "--prefix-output-with-timestamp",
        action="store_true",
        default=None,
        help="put the time before each output line's [rank] prefix",
    )
    for flag in ("--disable-cache", "--tcp"):
        g.add_argument(flag, action="store_true", default=None, help=argparse.SUPPRESS)

    h = _group(parser, "hosts", "hora run -np 4 -H server1:2,server2:2 python train.py")
    hx = h.add_mutually_exclusive_group()
    hx.add_argument(
        "-H", "--hosts", help="host:slots pairs, comma-separated (default localhost:<np>)"
    )
    hx.add_argument("-hostfile", "--hostfile", help="file with one 'host slots=N' per line")
    hx.add_argument(
        "--host-discovery-script",
        help="elastic: a program printing the current hosts, one 'host' or 'host:slots' per "
        "line; run every second, workers start on new slots and stop on hosts that went away",
    )

    s = _group(parser, "ssh", "hora run -np 2 -H a:1,b:1 -p 2222 -i ~/.ssh/id_ed25519 python t.py")
    s.add_argument("-p", "--ssh-port", type=int, help="ssh port of the remote hosts")
    s.add_argument("-i", "--ssh-identity-file", help="ssh private key for the remote hosts")
    s.add_argument(
        "--ssh-config-file",
        help="hora extension: ssh client config (ssh -F), e.g. for host aliases; "
        "default HORA_SSH_CONFIG",
    )

    c = _group(parser, "controller", "hora run -np 2 --gloo python train.py")
    cx = c.add_mutually_exclusive_group()
    cx.add_argument(
        "--gloo",
        action="store_const",
        const="gloo",
        dest="backend",
        help="use the Gloo backend (torch.distributed) for collectives",
    )
    cx.add_argument(
        "--mpi",
        action="store_const",
        const="mpi",
        dest="backend",
        help="start the workers with mpirun and use the MPI backend",
    )
    cx.add_argument("--jsrun", action="store_true", default=None, help=argparse.SUPPRESS)
    c.add_argument("--mpi-args", help="extra arguments for mpirun (with --mpi)")
    c.add_argument(
        "--binding-args",
        help="with --mpi: mpirun's binding and mapping arguments, instead of hora's default "
        "'-bind-to none -map-by slot' (e.g. '--bind-to core --map-by socket')",
    )
    c.add_argument("--num-nccl-streams", type=int, help=argparse.SUPPRESS)

    groups = {key: _group(parser, *value) for key, value in _SECTION_TITLES.items()}
    for knob in KNOBS:
        if knob.flag is None:
            continue
        g = groups[knob.section]
        if knob.type is bool:
            g.add_argument(
                knob.flag, dest=knob.field, action="store_true", default=None, help=knob.doc
            )
            if knob.field in (
                "hierarchical_allreduce",
                "hierarchical_allgather",
                "torus_allreduce",
            ):
                g.add_argument(
                    "--no-" + knob.flag[2:],
                    dest=knob.field,
                    action="store_false",
                    default=None,
                    help="turn it off (overrides the config file)",
                )
        else:
            kind = float if knob.field == "fusion_threshold" else knob.type
            g.add_argument(knob.flag, dest=knob.field, type=kind, help=knob.doc)

    e = _group(
        parser,
        "elastic (workers may fail, leave or join; the training script uses hvd.elastic.run)",
        "hora run -np 3 --min-np 2 --max-np 4 -H localhost:4 python train_elastic.py",
    )
    e.add_argument(
        "--min-np",
        "--min-num-proc",
        dest="min_np",
        type=int,
        help="elastic: go on as long as this many workers run (default: -np)",
    )
    e.add_argument(
        "--max-np",
        "--max-num-proc",
        dest="max_np",
        type=int,
        help="elastic: never run more workers than this (default: as many as there are slots)",
    )
    e.add_argument(
        "--slots-per-host",
        "--slots",
        dest="slots_per_host",
        type=int,
        help="elastic: slots of a discovered host printed without ':slots'",
    )
    e.add_argument(
        "--elastic-timeout",
        type=float,
        help="elastic: seconds to wait for the job to re-form after a failure or a host change "
        "(default 600)",
    )
    e.add_argument(
        "--reset-limit", type=int, help="elastic: end the job after this many re-formations"
    )
    e.add_argument(
        "--blacklist-cooldown-range",
        nargs=2,
        type=int,
        metavar=("MIN", "MAX"),
        help="elastic: start a new worker on a failed worker's slot after MIN seconds, doubled "
        "for each earlier failure there, at most MAX (each 1-3600; default: never reuse it)",
    )

    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the program to run on every rank, with its arguments",
    )


def _dest(flag: str) -> str:
    return {"--min-np": "min_np", "--max-np": "max_np"}.get(flag, flag[2:].replace("-", "_"))


def build_config(args: argparse.Namespace, env: dict[str, str] | None = None) -> LaunchConfig:
    """Turn parsed ``hora run`` arguments into a LaunchConfig (flags > config file > env)."""
    env = dict(os.environ) if env is None else env
    for flag, message in UNSUPPORTED.items():
        if getattr(args, _dest(flag), None) not in (None, False):
            log.warning("hora run: %s: %s", flag, message)
    file_knobs, file_launch = read_config_file(args.config_file) if args.config_file else ({}, {})
    flag_knobs = {
        k.field: knob_from_flag(k, getattr(args, k.field))
        for k in KNOBS
        if k.flag is not None and getattr(args, k.field, None) is not None
    }
    if args.np is None:
        raise ValueError("-np is required: the number of processes, e.g. hora run -np 4 ...")
    if args.hosts:
        hosts = parse_hosts(args.hosts)
    elif args.hostfile:
        hosts = parse_hostfile(args.hostfile)
    else:
        hosts = []
    interfaces = [
        *[n.strip() for n in (args.network_interfaces or "").split(",") if n.strip()],
        *(args.network_interface or []),
    ] or file_launch.get("network_interfaces", [])
    start_timeout = args.start_timeout
    if start_timeout is None:
        start_timeout = file_launch.get("start_timeout") or float(
            env_lookup(env, "START_TIMEOUT", "30") or 30
        )

    def pick(name: str, flag_value: object, default: object) -> object:
        return flag_value if flag_value is not None else file_launch.get(name, default)

    return LaunchConfig(
        command=list(args.command),
        np=args.np,
        hosts=hosts,
        backend=str(pick("backend", args.backend, "native")),
        ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file,
        ssh_config_file=args.ssh_config_file or env.get("HORA_SSH_CONFIG") or None,
        network_interfaces=interfaces,
        start_timeout=float(start_timeout),
        verbose=bool(pick("verbose", args.verbose, False)),
        output_filename=args.output_filename,
        prefix_timestamp=bool(pick("prefix_timestamp", args.prefix_output_with_timestamp, False)),
        disable_cache=bool(args.disable_cache),
        mpi_args=str(pick("mpi_args", args.mpi_args, "")),
        binding_args=args.binding_args or "",
        settings=resolve_settings(env, file_knobs, flag_knobs),
        env=env,
    )


def elastic_options(args: argparse.Namespace, config: LaunchConfig) -> Any:
    """The elastic options when any elastic flag was given (else None: a static job)."""
    if args.min_np is None and args.max_np is None and not args.host_discovery_script:
        return None
    from hora.elastic.driver import ElasticOptions

    timeout = args.elastic_timeout
    return ElasticOptions(
        min_np=config.np if args.min_np is None else args.min_np,
        max_np=args.max_np,
        host_discovery_script=args.host_discovery_script,
        slots_per_host=args.slots_per_host,
        elastic_timeout=config.settings.elastic_timeout if timeout is None else timeout,
        reset_limit=args.reset_limit,
        cooldown_range=None
        if args.blacklist_cooldown_range is None
        else tuple(args.blacklist_cooldown_range),
    )


class _Terminated(Exception):
    """SIGTERM reached the launcher."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def command(args: argparse.Namespace) -> int:
    """Run ``hora run`` with parsed arguments; the launcher's exit code."""
    if args.version:
        from importlib.metadata import version

        print(f"hora {version('hora')}")
        return 0
    if args.check_build:
        from hora.launch import check

        return check.command(args)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    from hora.launch.job import Job

    try:
        config = build_config(args)
        elastic = elastic_options(args, config)
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            if elastic is not None:
                from hora.elastic.driver import ElasticJob

                with ElasticJob(config, elastic) as job:
                    return job.run()
            with Job(config) as job:
                return job.run()
        finally:
            signal.signal(signal.SIGTERM, previous)
    except (ValueError, LaunchError) as e:
        log.error("hora run: %s", e)
        return 2
    except KeyboardInterrupt:
        log.error("hora run: interrupted; workers stopped")
        return 130
    except _Terminated:
        log.error("hora run: terminated; workers stopped")
        return 143


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("hora.launch")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def _top_help() -> str:
    lines = ["usage: hora <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    lines += [
        "",
        "`hora <command> --help` shows a command's options.",
        "example: hora run -np 2 python train.py",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``hora`` entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help())
        return 0 if argv else 2
    name = argv[0]
    if name not in SUBCOMMANDS:
        print(f"hora: unknown command {name!r}\n\n{_top_help()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = argparse.ArgumentParser(
        prog=f"hora {name}", allow_abbrev=False, description=SUBCOMMANDS[name][1]
    )
    module.configure(parser)
    args = parser.parse_args(argv[1:])
    _setup_logging(bool(getattr(args, "verbose", False)))
    if name == "run" and not (args.command or args.version or args.check_build):
        parser.error(
            "no command to run: give the program after the options, "
            "e.g. hora run -np 2 python train.py"
        )
    return int(module.command(args))


def horovodrun_main() -> int:
    """The ``horovodrun`` entry point: ``hora run`` under Horovod's name."""
    return main(["run", *sys.argv[1:]])
