"""The launcher's side of elastic training: ``hora run --min-np/--max-np/--host-discovery-script``.

:class:`ElasticJob` starts ``-np`` workers (at most ``--max-np``) and forms round 0 of the job
(see :mod:`hora.elastic.rendezvous`). Then it watches:

* A worker that exits with an error is dropped; the others' collectives fail, they roll back to
  their last commit and ask for the next round, which the launcher forms once every running
  worker has asked - with at least ``--min-np`` of them. A failed worker's slot is not used
  again, unless ``--blacklist-cooldown-range MIN MAX`` is given: the slot then cools down
  (:func:`cooldown`) and a new worker is started on it, which joins like a discovered one.
* ``--host-discovery-script`` is run every second: workers are started on new slots (up to
  ``--max-np``), and stopped on hosts that disappeared. The workers learn of the change at their
  next ``state.commit()`` (``HostsUpdatedInterrupt``) and ask for the next round together.
* A round not formed within ``--elastic-timeout`` seconds, fewer workers than ``--min-np`` with
  no way to get more, or more resets than ``--reset-limit`` end the job.

The job succeeds when every worker of the last round exited with 0. Runs in the launcher's main
thread; not thread-safe.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass

from hora.elastic import rendezvous as rdv
from hora.errors import LaunchError
from hora.launch.config import LaunchConfig
from hora.launch.hosts import HostSlots, assign_ranks, parse_hosts
from hora.launch.job import Job
from hora.launch.preflight import run_preflight
from hora.launch.process import ConsoleSink, Worker, stop_all
from hora.launch.workerenv import job_env
from hora.rendezvous.client import StoreClient

log = logging.getLogger("hora.launch")

_POLL = 0.1  # seconds between looks at the workers and the store
_DISCOVERY_EVERY = 1.0


@dataclass(frozen=True)
class ElasticOptions:
    min_np: int
    max_np: int | None = None  # None: as many as there are slots
    host_discovery_script: str | None = None
    slots_per_host: int | None = None
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    cooldown_range: tuple[int, int] | None = None  # --blacklist-cooldown-range: reuse failed slots


@dataclass
class _Member:
    id: str  # host:index, the worker's name in the store
    host: str
    label: int  # the prefix of its output lines
    worker: Worker
    rank: int = -1  # in the newest round it belongs to
    code: int | None = None  # exit code once it exited
    removed: bool = False  # stopped because its host went away
    slot: str = ""  # host:index it runs on


def cooldown(bounds: tuple[int, int], failures: int, jitter: float | None = None) -> float:
    """Seconds a slot rests after its ``failures``-th failure: the lower bound doubled for each
    earlier failure, plus up to a second of jitter, within ``bounds`` (each clamped to 1-3600 s,
    as Horovod does)."""
    low, high = (min(max(int(b), 1), 3600) for b in bounds)
    high = max(high, low)
    extra = random.random() if jitter is None else jitter
    return float(min(high, low * 2 ** min(failures - 1, 12) + extra))


def discover(script: str, slots_per_host: int | None, timeout: float = 30.0) -> list[HostSlots]:
    """Run the discovery script: one ``host`` or ``host:slots`` per line on its stdout."""
    try:
        done = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"--host-discovery-script {script!r} ran longer than {timeout:g}s"
        ) from None
    if done.returncode != 0:
        raise LaunchError(
            f"--host-discovery-script {script!r} exited with {done.returncode}: "
            f"{done.stderr.strip()[-500:]}"
        )
    lines = [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]
    if slots_per_host:
        lines = [ln if ":" in ln else f"{ln}:{slots_per_host}" for ln in lines]
    return parse_hosts(",".join(lines)) if lines else []


class ElasticJob(Job):
    open_ended = True

    def __init__(self, config: LaunchConfig, options: ElasticOptions) -> None:
        self.options = options
        if options.min_np < 1 or options.min_np > config.np:
            raise ValueError(f"--min-np {options.min_np} must be between 1 and -np {config.np}")
        if options.max_np is not None and options.max_np < config.np:
            raise ValueError(f"--max-np {options.max_np} is below -np {config.np}")
        self._hosts = config.host_list()
        if options.host_discovery_script:
            self._hosts = self._wait_for_hosts(config.np)
        config.hosts = self._hosts
        super().__init__(config)
        self.members: list[_Member] = []
        self._used: set[str] = set()  # slots (host:index) ever started; refilled only if resting
        self._failures: dict[str, int] = {}  # slot -> failures so far
        self._resting: dict[str, float] = {}  # slot -> when its cooldown ends
        self._round = 0
        self._resets = 0
        self._updates = 0
        self._announced = -1  # the round whose joiners the workers were told about

    # -- hosts --------------------------------------------------------------------------------
    def _wait_for_hosts(self, np: int) -> list[HostSlots]:
        opts = self.options
        assert opts.host_discovery_script is not None
        deadline = time.monotonic() + opts.elastic_timeout
        while True:
            hosts = discover(opts.host_discovery_script, opts.slots_per_host)
            if sum(h.slots for h in hosts) >= np:
                return hosts
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"Timed out waiting for minimum number of slots to become available: "
                    f"{np} needed, the discovery script lists "
                    f"{','.join(f'{h.name}:{h.slots}' for h in hosts) or 'none'}"
                )
            time.sleep(_DISCOVERY_EVERY)

    def _address(self, host: str) -> str:
        assert self._preflight is not None
        known = self._preflight.launcher_address
        if host not in known:
            cfg = self.config
            found = run_preflight([host], self._ssh, cfg.start_timeout, cfg.network_interfaces)
            known.update(found.launcher_address)
        return known[host]

    # -- running ------------------------------------------------------------------------------
    def run(self) -> int:
        if self._preflight is None:
            raise LaunchError("ElasticJob.run() must be called inside `with ElasticJob(...)`")
        if self.config.backend == "mpi":
            raise LaunchError(
                "elastic jobs run over hora's own or Gloo's connections, not MPI: drop --mpi"
            )
        cfg = self.config
        base = os.environ if cfg.env is None else cfg.env
        self._common = job_env(
            base, cfg.settings, cfg.backend, self.port, self._preflight.interfaces
        )
        self._common.update(
            {
                "HORA_ELASTIC": "1",
                "HOROVOD_ELASTIC": "1",
                "HORA_ELASTIC_TIMEOUT": str(self.options.elastic_timeout),
            }
        )
        self._out, self._err = ConsoleSink(sys.stdout), ConsoleSink(sys.stderr)
        with StoreClient("127.0.0.1", self.port, self.secret) as store:
            self._store = store
            for slot in self.slots:
                self._start(slot.hostname, slot.local_rank)
            self._form(0, self.members)
            try:
                return self._watch()
            except LaunchError as e:
                log.error("hora run: %s", e)
                stop_all(self.workers, cfg.grace_seconds)
                return 1

    def _start(self, host: str, index: int) -> None:
        slot = wid = f"{host}:{index}"
        if self._failures.get(slot):  # a fresh name: the store may hold the failed one's keys
            wid = f"{slot}+{self._failures[slot]}"
        env = dict(self._common)
        env["HORA_RENDEZVOUS_ADDR"] = env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = self._address(host)
        env["HORA_ELASTIC_ID"] = wid
        for prefix in ("HORA_", "HOROVOD_"):
            env[prefix + "HOSTNAME"] = host
        label = len(self.members)
        self._used.add(slot)
        worker = self._spawn(label, host, env, self._out, self._err)
        self.members.append(_Member(wid, host, label, worker, slot=slot))
        log.info("elastic: started worker %d (%s)", label, wid)

    def _form(self, r: int, members: list[_Member]) -> None:
        """Write round ``r``: ranks host by host, in the order of ``members``."""
        hosts: dict[str, list[_Member]] = {}
        for m in members:
            hosts.setdefault(m.host, []).append(m)
        slots = assign_ranks([HostSlots(h, len(ms)) for h, ms in hosts.items()], len(members))
        placed = [m for ms in hosts.values() for m in ms]
        for m, slot in zip(placed, slots):
            self._store.set(rdv.assign_key(r, m.id), rdv.encode_assignment(slot))
            m.rank = slot.rank
        self._store.set(rdv.ROUND, str(r).encode())
        self._store.set(rdv.formed_key(r), b"1")
        self._round, self._current = r, {m.id for m in members}
        if r:
            log.info("elastic: round %d formed with %d workers", r, len(members))

    def _watch(self) -> int:
        opts = self.options
        pending_since: float | None = None
        next_discovery = time.monotonic() + _DISCOVERY_EVERY
        while True:
            self._reap()
            now = time.monotonic()
            if now >= next_discovery:
                if opts.host_discovery_script:
                    self._rediscover()
                elif opts.cooldown_range:
                    self._refill(self._hosts)
                next_discovery = now + _DISCOVERY_EVERY
            live = [m for m in self.members if m.code is None]
            if not live:
                return self._result()
            nxt = self._round + 1
            ready = [m for m in live if self._store.check([rdv.ready_key(nxt, m.id)])]
            if not ready:
                pending_since = None
            else:
                pending_since = pending_since or now
                if len(live) < opts.min_np and not self._can_grow():
                    raise LaunchError(
                        f"only {len(live)} workers are left, fewer than --min-np "
                        f"{opts.min_np}, and no --host-discovery-script or "
                        "--blacklist-cooldown-range can add more"
                    )
                if any(m.id not in self._current for m in ready) and self._announced < nxt:
                    self._announced = nxt
                    self._hosts_changed(removed_only=False)
                if len(ready) == len(live) and len(live) >= opts.min_np:
                    self._next_round(live)
                    pending_since = None
                elif now - pending_since > opts.elastic_timeout:
                    missing = [m.id for m in live if m not in ready]
                    raise LaunchError(
                        f"round {nxt} was not formed within {opts.elastic_timeout:g}s "
                        f"(--elastic-timeout): workers {', '.join(missing)} did not ask for it "
                        f"({len(live)} running, --min-np {opts.min_np})"
                    )
            time.sleep(_POLL)

    def _next_round(self, live: list[_Member]) -> None:
        limit = self.options.reset_limit
        self._resets += 1
        if limit is not None and self._resets > limit:
            raise LaunchError(
                "Horovod was shutdown because number of resets during elastic job exceeded "
                f"limit: {limit}"
            )
        # earlier members first, by their last rank: the new rank 0 holds the committed state
        old = sorted((m for m in live if m.id in self._current), key=lambda m: m.rank)
        self._form(self._round + 1, old + [m for m in live if m.id not in self._current])

    def _reap(self) -> None:
        while not self._exits.empty():
            label, code = self._exits.get_nowait()
            m = self.members[label]
            m.code = code
            if code != 0 and not m.removed:
                log.warning(
                    "elastic: worker %d (%s) exited with %s; the others go on", label, m.id, code
                )
                self._rest(m.slot)

    def _rest(self, slot: str) -> None:
        """A worker failed on ``slot``: close the slot for good, or for its cooldown."""
        bounds = self.options.cooldown_range
        self._failures[slot] = self._failures.get(slot, 0) + 1
        if bounds is None:
            return  # never used again
        wait = cooldown(bounds, self._failures[slot])
        self._resting[slot] = time.monotonic() + wait
        log.info("elastic: slot %s rests %.1fs before a new worker starts there", slot, wait)

    def _can_grow(self) -> bool:
        return bool(self.options.host_discovery_script or self.options.cooldown_range)

    def _rediscover(self) -> None:
        opts = self.options
        assert opts.host_discovery_script is not None
        try:
            hosts = discover(opts.host_discovery_script, opts.slots_per_host)
        except LaunchError as e:
            log.warning("elastic: %s; keeping the hosts found before", e)
            return
        names = {h.name for h in hosts}
        gone = [m for m in self.members if m.code is None and m.host not in names]
        for m in gone:
            log.info("elastic: host %s is gone; stopping worker %d", m.host, m.label)
            m.removed = True
            m.worker.stop()
        added = self._refill(hosts)
        if gone and not added:
            self._hosts_changed(removed_only=True)

    def _refill(self, hosts: list[HostSlots]) -> int:
        """Start workers on free slots of ``hosts``, up to ``--max-np``: slots never used, and
        (with ``--blacklist-cooldown-range``) failed ones whose cooldown has ended."""
        opts, now = self.options, time.monotonic()
        live = sum(1 for m in self.members if m.code is None and not m.removed)
        room = (opts.max_np if opts.max_np is not None else 1 << 30) - live
        added = 0
        for h in hosts:
            for index in range(h.slots):
                slot = f"{h.name}:{index}"
                # a used slot is running, ended, or failed; only a rested failed one is free
                free = slot not in self._used or self._resting.get(slot, now + 1) <= now
                if added >= room or not free:
                    continue
                self._resting.pop(slot, None)
                self._start(h.name, index)
                added += 1
        return added

    def _hosts_changed(self, removed_only: bool) -> None:
        self._updates += 1
        self._store.set(rdv.HOSTS, f"{self._updates},{int(removed_only)}".encode())

    def _result(self) -> int:
        last = [m for m in self.members if m.id in self._current and not m.removed]
        failed = [m for m in last if m.code != 0]
        if not failed:
            return 0
        code = failed[0].code or 1
        log.error(
            "elastic: worker %d (%s) of the last round exited with %s",
            failed[0].label,
            failed[0].id,
            code,
        )
        return code if 0 < code < 256 else 1
