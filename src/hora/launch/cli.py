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
    "timeline": ("hora.lab.timeline", "merge every rank's timeline into one trace, summarise it"),
}

# horovodrun flags that hora accepts with nothing to do: flag -> what hora says, once, at start.
NO_EFFECT: dict[str, str] = {
    "--disable-cache": "hora keeps no cache of the ssh and network-interface checks; they run "
    "at every launch",
    "--num-nccl-streams": "hora's NCCL backend runs on one torch.distributed process group; "
    "HOROVOD_NUM_NCCL_STREAMS is passed on but changes nothing",
    "--tcp": "hora's own transport already uses TCP between hosts; NCCL_IB_DISABLE=1 is passed "
    "on to the workers (and, with --mpi, Open MPI is told to leave InfiniBand alone)",
}
# horovodrun flags hora refuses: flag -> why. The job does not start.
REFUSED: dict[str, str] = {
    "--jsrun": "not supported: hora cannot start workers through IBM's jsrun (LSF); use -H or "
    "-hostfile (hora starts them over ssh) or --mpi",
}
# Config-file keys hora accepts with nothing to do: (section, key) -> why.
NO_EFFECT_KEYS: dict[tuple[str, str], str] = {
    ("library_options", "ccl_bgt_affinity"): "hora has no CCL",
}

# Each boolean knob's flag -> the flag that turns it the other way (Horovod's `--no-` forms).
INVERSE: dict[str, str] = {
    "--no-stall-check": "--stall-check",
    "--log-without-timestamp": "--log-with-timestamp",
}
# More names for boolean knob flags: extra flag -> (knob field, value). Horovod's deprecated
# `--log-hide-timestamp` and its `--no-` form; `--no-log-with-timestamp` for symmetry.
BOOL_ALIASES: dict[str, tuple[str, bool]] = {
    "--log-hide-timestamp": ("log_hide_time", True),
    "--no-log-hide-timestamp": ("log_hide_time", False),
    "--no-log-with-timestamp": ("log_hide_time", True),
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
    "library_options": (
        "library options",
        "hora run -np 2 --gloo-timeout-seconds 60 python t.py",
    ),
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
        help="one interface (or several, comma-separated); may repeat",
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
        "-prefix-timestamp",
        "--prefix-output-with-timestamp",
        dest="prefix_output_with_timestamp",
        action="store_true",
        default=None,
        help="put the time before each output line's [rank] prefix",
    )
    g.add_argument(
        "--as-horovod",
        action="store_true",
        default=None,
        help="run Horovod scripts unchanged: in the workers, `import horovod.torch` (and every "
        "horovod.* name hora has) gives hora's module (sets HORA_AS_HOROVOD=1)",
    )
    g.add_argument(
        "--disable-cache",
        action="store_true",
        default=None,
        help="accepted for horovodrun; hora caches no checks, so there is nothing to disable",
    )
    g.add_argument(
        "--tcp",
        action="store_true",
        default=None,
        help="use TCP, not InfiniBand: sets NCCL_IB_DISABLE=1 for the workers, and with --mpi "
        "tells Open MPI '-mca pml ob1 -mca btl ^openib' (hora's own transport is TCP anyway)",
    )

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
    cx.add_argument(
        "--jsrun",
        action="store_true",
        default=None,
        help="refused: hora cannot start workers through jsrun (use -H/-hostfile or --mpi)",
    )
    c.add_argument("--mpi-args", help="extra arguments for mpirun (with --mpi)")
    c.add_argument(
        "--binding-args",
        help="with --mpi: mpirun's binding and mapping arguments, instead of hora's default "
        "'-bind-to none -map-by slot' (e.g. '--bind-to core --map-by socket')",
    )

    groups = {key: _group(parser, *value) for key, value in _SECTION_TITLES.items()}
    for knob in KNOBS:
        if knob.flag is None:
            continue
        g = groups[knob.section if knob.section in groups else "library_options"]
        if knob.type is bool:
            pair = g.add_mutually_exclusive_group()
            pair.add_argument(
                knob.flag, dest=knob.field, action="store_true", default=None, help=knob.doc
            )
            inverse = inverse_flag(knob.flag)
            pair.add_argument(
                inverse,
                dest=knob.field,
                action="store_false",
                default=None,
                help=f"the opposite of {knob.flag} (wins over the config file and environment)",
            )
            for alias, (field, value) in BOOL_ALIASES.items():
                if field == knob.field:
                    pair.add_argument(
                        alias,
                        dest=knob.field,
                        action="store_true" if value else "store_false",
                        default=None,
                        help=f"same as {knob.flag if value else inverse} (Horovod's older name)",
                    )
        else:
            kind = float if knob.field == "fusion_threshold" else knob.type
            g.add_argument(knob.flag, dest=knob.field, type=kind, help=knob.doc)

    e = _group(
        parser,
        "elastic (workers may fail, leave or join; the training script uses hvd.elastic.run)",
        "hora run -np 2 --min-np 2 --max-np 4 -H host1:2,host2:2 python train_elastic.py",
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
        help="elastic: a host blacklisted after a failure comes back after MIN seconds, doubled "
        "for each earlier failure there, at most MAX (each 1-3600; default: never)",
    )

    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the program to run on every rank, with its arguments",
    )


def inverse_flag(flag: str) -> str:
    """The flag that sets a boolean knob the other way: ``--x`` <-> ``--no-x``."""
    if flag in INVERSE:
        return INVERSE[flag]
    return "--" + flag[5:] if flag.startswith("--no-") else "--no-" + flag[2:]


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _given_flags(args: argparse.Namespace) -> dict[str, str]:
    """Knob field -> the flag that set it on this command line."""
    out: dict[str, str] = {}
    for k in KNOBS:
        value = getattr(args, k.field, None)
        if k.flag is None or value is None:
            continue
        out[k.field] = k.flag if k.type is not bool or value else inverse_flag(k.flag)
    return out


# Launcher flags and the smallest value each takes (checked before anything starts).
_AT_LEAST = {
    "--min-np": ("min_np", 1),
    "--max-np": ("max_np", 1),
    "--slots-per-host": ("slots_per_host", 1),
    "--reset-limit": ("reset_limit", 0),
    "--ssh-port": ("ssh_port", 1),
}
_ELASTIC_ONLY = ("--slots-per-host", "--elastic-timeout", "--reset-limit",
                 "--blacklist-cooldown-range")  # fmt: skip


def _check_launcher_flags(args: argparse.Namespace) -> list[str]:
    """ValueError naming the first launcher flag out of range; the notes for flags that have
    nothing to do in this job."""
    for flag, (dest, low) in _AT_LEAST.items():
        value = getattr(args, dest, None)
        if value is not None and value < low:
            raise ValueError(f"{flag}={value}: must be >= {low}")
    if args.ssh_port is not None and args.ssh_port > 65535:
        raise ValueError(f"--ssh-port={args.ssh_port}: must be a port number, 1-65535")
    if args.elastic_timeout is not None and args.elastic_timeout <= 0:
        raise ValueError(f"--elastic-timeout={args.elastic_timeout:g}: must be > 0 (seconds)")
    if args.min_np is not None and args.max_np is not None and args.max_np < args.min_np:
        raise ValueError(f"--max-np={args.max_np}: must be >= --min-np {args.min_np}")
    if args.blacklist_cooldown_range is not None:
        low, high = args.blacklist_cooldown_range
        if low < 0 or high < low:
            raise ValueError(
                f"--blacklist-cooldown-range={low} {high}: expected MIN MAX seconds with "
                "0 <= MIN <= MAX"
            )
    notes = []
    elastic = args.min_np is not None or args.max_np is not None or args.host_discovery_script
    if not elastic:
        notes += [f"{flag}: only elastic jobs (--min-np, --max-np, --host-discovery-script) "
                  "use it; this job is static" for flag in _ELASTIC_ONLY
                  if getattr(args, _dest(flag), None) is not None]  # fmt: skip
    return notes


def build_config(args: argparse.Namespace, env: dict[str, str] | None = None) -> LaunchConfig:
    """Turn parsed ``hora run`` arguments into a LaunchConfig (flags > config file > env).

    Every setting is validated here, before any worker starts (ValueError naming it)."""
    env = dict(os.environ) if env is None else dict(env)
    for flag, message in REFUSED.items():
        if getattr(args, _dest(flag), None):
            raise ValueError(f"{flag}: {message}")
    notes = [f"{flag}: {message}" for flag, message in NO_EFFECT.items()
             if getattr(args, _dest(flag), None) not in (None, False)]  # fmt: skip
    notes += _check_launcher_flags(args)
    file_knobs, file_launch = read_config_file(args.config_file) if args.config_file else ({}, {})
    notes += [f"{args.config_file}: {section}.{key}: {NO_EFFECT_KEYS[(section, key)]}; ignored"
              for section, key in file_launch.pop("no_effect", [])]  # fmt: skip
    flag_knobs = {
        k.field: knob_from_flag(k, getattr(args, k.field))
        for k in KNOBS
        if k.flag is not None and getattr(args, k.field, None) is not None
    }
    origin = {**file_launch.pop("origin", {}), **_given_flags(args)}
    if args.tcp:
        env["NCCL_IB_DISABLE"] = "1"
    if getattr(args, "as_horovod", None):
        from hora import as_horovod

        env[as_horovod.ENV] = "1"
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = as_horovod.shim_path() + (os.pathsep + path if path else "")
    if args.np is None:
        raise ValueError("-np is required: the number of processes, e.g. hora run -np 4 ...")
    if args.hosts:
        hosts = parse_hosts(args.hosts)
    elif args.hostfile:
        hosts = parse_hostfile(args.hostfile)
    else:
        hosts = []
    given = [args.network_interfaces or "", *(args.network_interface or [])]
    interfaces = list(
        dict.fromkeys(n.strip() for text in given for n in text.split(",") if n.strip())
    ) or file_launch.get("network_interfaces", [])
    start_timeout = args.start_timeout
    if start_timeout is None:
        start_timeout = file_launch.get("start_timeout")
    if start_timeout is None:
        raw = env_lookup(env, "START_TIMEOUT", "30") or "30"
        try:
            start_timeout = float(raw)
        except ValueError:
            raise ValueError(
                f"HOROVOD_START_TIMEOUT={raw!r}: expected a number of seconds"
            ) from None

    def pick(name: str, flag_value: object, default: object) -> object:
        return flag_value if flag_value is not None else file_launch.get(name, default)

    backend = str(pick("backend", args.backend, "native"))
    if backend != "mpi":
        notes += [f"{flag}: only used with --mpi (mpirun); this job does not use mpirun"
                  for flag in ("--binding-args", "--mpi-args")
                  if getattr(args, _dest(flag), None)]  # fmt: skip
    config = LaunchConfig(
        command=list(args.command),
        np=args.np,
        hosts=hosts,
        backend=backend,
        tcp_flag=bool(args.tcp),
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
        settings=resolve_settings(env, file_knobs, flag_knobs, origin),
        env=env,
    )
    for note in notes:  # once, at start-up, for a launch that goes ahead
        log.info("hora run: note: %s", note)
    return config


def elastic_options(args: argparse.Namespace, config: LaunchConfig) -> Any:
    """The elastic options when any elastic flag was given (else None: a static job)."""
    if args.min_np is None and args.max_np is None and not args.host_discovery_script:
        return None
    from hora.launch.config import ElasticOptions

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
                # the one place launch/ reaches up: the CLI picks the elastic driver (which is
                # built on launch/'s processes, hosts and ssh) over a static Job
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
