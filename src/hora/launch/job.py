"""One job from start to end: preflight, rendezvous store, workers, failure handling, cleanup.

``with Job(config) as job: code = job.run()``. Entering runs the preflight and starts the
rendezvous server with a fresh secret; ``run`` starts the workers (local, over ssh, or through
mpirun) and waits. When a worker exits non-zero the job names it, stops every other worker
(stdin end-of-file, SIGTERM, then SIGKILL after ``grace_seconds``) and returns a non-zero code.
Leaving the ``with`` block stops whatever still runs and the store, also on KeyboardInterrupt.

Runs in the caller's thread (the launcher's main thread, or a notebook's); not thread-safe.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
from types import TracebackType

from hora.errors import LaunchError
from hora.launch import local, mpirun, ssh
from hora.launch.config import LaunchConfig
from hora.launch.hosts import SlotInfo, assign_ranks
from hora.launch.preflight import Preflight, run_preflight
from hora.launch.process import ConsoleSink, Worker, stop_all, wrapper_script
from hora.launch.workerenv import job_env, rank_env
from hora.rendezvous.protocol import DEPARTURES_REPORTED, departure_key
from hora.rendezvous.server import RendezvousServer

log = logging.getLogger("hora.launch")


def exit_status(code: int) -> str:
    """A worker's exit status as a person reads it, with the signal behind it named: negative
    for a local process a signal ended, 128 + N as a shell (a rank started over ssh) reports
    signal N."""
    if code < 0:
        return f"{code} (killed by {_signal_name(-code)})"
    if 128 < code <= 128 + 64:
        return f"{code} ({_signal_name(code - 128)}, as a shell reports it)"
    return str(code)


def departure(code: int) -> str:
    """How a worker with exit status ``code`` left, as a rank's error message says it."""
    if code < 0:
        return f"was killed by signal {-code} ({_signal_name(-code)})"
    if 128 < code <= 128 + 64:
        return f"was killed by signal {code - 128} ({_signal_name(code - 128)}; exit code {code})"
    return f"exited with code {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class Job:
    def __init__(self, config: LaunchConfig):
        self.config = config
        self.slots: list[SlotInfo] = assign_ranks(config.host_list(), config.np)
        self.secret = os.urandom(32)
        self.port = 0
        self.store_address = "127.0.0.1"
        self.workers: list[Worker] = []
        self._server: RendezvousServer | None = None
        self._preflight: Preflight | None = None
        self._exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self._say = log.info if config.verbose else log.debug
        self.failure: tuple[int, int] | None = None  # (rank, exit code) of the first failure
        self._ssh = ssh.SshOptions(
            config.ssh_port,
            config.ssh_identity_file,
            config.ssh_config_file,
            connect_timeout=config.start_timeout,
        )

    open_ended = False  # hosts may join later (the elastic job): the store listens on all

    def __enter__(self) -> Job:
        hosts = list(dict.fromkeys(s.hostname for s in self.slots))
        self._preflight = run_preflight(
            hosts, self._ssh, self.config.start_timeout, self.config.network_interfaces
        )
        self._say(
            "network interfaces: %s (%s)",
            ",".join(self._preflight.interfaces) or "none",
            self._preflight.reason,
        )
        settings = self.config.settings
        server = self._start_store(
            self._preflight.store_bind_address(settings.listen_any, self.open_ended)
        )
        if not self.open_ended and self.config.backend != "mpi":  # _wait records each exit
            server.put(DEPARTURES_REPORTED, b"1")
        return self

    def _start_store(self, bind: str) -> RendezvousServer:
        """Start the job's rendezvous store on ``bind`` (an address, or 0.0.0.0 for every
        interface); sets ``port`` and ``store_address``, where the launcher's own clients
        (hora.run, the elastic driver) reach it. Every kind of job starts its store here."""
        server = RendezvousServer(
            self.secret,
            host=bind,
            port=0,
            handshake_timeout=self.config.settings.handshake_timeout_seconds,
        )
        self.port = server.start()
        self.store_address = "127.0.0.1" if bind == "0.0.0.0" else bind
        self._server = server
        self._say("rendezvous store listening on %s:%d", bind, self.port)
        return server

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            stop_all(self.workers, self.config.grace_seconds)
        finally:
            if self._server is not None:
                self._server.stop()
                self._server = None

    def run(self) -> int:
        """Start every worker and wait for them; the job's exit code (0: all succeeded)."""
        if self._preflight is None:
            raise LaunchError("Job.run() must be called inside `with Job(config) as job:`")
        common = job_env(
            os.environ if self.config.env is None else self.config.env,
            self.config.settings,
            self.config.backend,
            self.port,
            self._preflight.interfaces,
        )
        stdout = ConsoleSink(sys.stdout)
        stderr = ConsoleSink(sys.stderr)
        if self.config.backend == "mpi":
            self._start_mpirun(common, stdout, stderr)
        else:
            for slot in self.slots:
                self._start_worker(slot, common, stdout, stderr)
        return self._wait()

    def _start_worker(
        self, slot: SlotInfo, common: dict[str, str], stdout: ConsoleSink, stderr: ConsoleSink
    ) -> None:
        assert self._preflight is not None
        env = rank_env(common, slot, self._preflight.launcher_address[slot.hostname])
        self._spawn(slot.rank, slot.hostname, env, stdout, stderr)

    def _spawn(
        self, label: int, host: str, env: dict[str, str], stdout: ConsoleSink, stderr: ConsoleSink
    ) -> Worker:
        """Start the command on ``host`` with ``env``; its output lines are tagged ``label``."""
        cfg = self.config
        cwd = cfg.cwd or os.getcwd()
        if local.is_local_host(host):
            script = wrapper_script(cfg.command, grace_seconds=cfg.grace_seconds)
            argv, popen_env, popen_cwd = local.worker_argv(script), env, cwd
        else:
            script = wrapper_script(cfg.command, env, cwd, cfg.grace_seconds)
            argv, popen_env, popen_cwd = ssh.remote_argv(self._ssh, host, script), None, None
        output_dir = None
        if cfg.output_filename:
            width = len(str(cfg.np - 1))
            output_dir = os.path.join(cfg.output_filename, f"rank.{label:0{width}d}")
        worker = Worker(
            label,
            argv,
            env=popen_env,
            cwd=popen_cwd,
            stdin_data=self.secret.hex().encode() + b"\n",
            stdout=stdout,
            stderr=stderr,
            exits=self._exits,
            timestamp=cfg.prefix_timestamp,
            output_dir=output_dir,
            quiet=not cfg.settings.tf_logs,
        )
        self.workers.append(worker)
        return worker

    def _start_mpirun(self, common: dict[str, str], stdout: ConsoleSink, stderr: ConsoleSink):
        assert self._preflight is not None
        env = dict(common)
        address = self._preflight.remote_address
        env["HORA_RENDEZVOUS_ADDR"] = env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = address
        env["HORA_SECRET_KEY"] = self.secret.hex()  # forwarded by name with -x, never by value
        argv = mpirun.command(self.config, self.slots, env, self._ssh, self._preflight.interfaces)
        self._say("mpirun command: %s", " ".join(argv))
        self.workers.append(
            Worker(
                0,
                argv,
                env=env,
                cwd=self.config.cwd,
                stdin_data=None,
                stdout=stdout,
                stderr=stderr,
                exits=self._exits,
                prefix=False,
            )
        )

    def _wait(self) -> int:
        remaining = len(self.workers)
        while remaining:
            try:
                label, code = self._exits.get(timeout=0.5)
            except queue.Empty:
                continue
            remaining -= 1
            if self._server is not None and self.config.backend != "mpi":
                self._server.put(departure_key(label), departure(code).encode())
            if code == 0:
                continue
            self.failure = (label, code)
            shown = exit_status(code)
            if self.config.backend == "mpi":
                log.error("mpirun exited with status code %s.", shown)
            else:
                log.error("Process %d exit with status code %s.", label, shown)
                log.error("Terminating remaining workers after failure of Process %d.", label)
            stop_all(self.workers, self.config.grace_seconds)
            return code if 0 < code < 256 else 1
        return 0
