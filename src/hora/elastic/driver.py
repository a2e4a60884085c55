"""The launcher's side of elastic training: ``hora run --min-np/--max-np/--host-discovery-script``.

Horovod's elastic driver, on hora's rendezvous store (see :mod:`hora.rendezvous.rounds`):

* **Start.** Wait (up to ``--elastic-timeout``) until the hosts have ``-np`` slots, then start a
  worker on every slot, up to ``--max-np``, and form round 0.
* **Discovery.** ``--host-discovery-script`` runs every second
  (:data:`hora.elastic.discovery.DISCOVERY_INTERVAL`);
  host order is stable, new hosts come last. Workers start on new slots (up to ``--max-np``);
  once one asks to join, the running workers are told (the ``hosts`` key) and raise
  ``HostsUpdatedInterrupt`` at their next ``commit()``/``check_host_updates()`` (so the job
  trains on while new workers start). The workers of a host that disappeared are told the same
  way; at the re-formation they leave with status 0, and nothing is rolled back.
* **Hand-over.** Workers hold the committed state from round 0 or once they synced it (they
  write ``elastic/synced/<id>``, :func:`hora.elastic.run.synced_key`). Workers whose host is
  removed while no other worker holds the state stay (``retiring``) until the job re-formed
  with new workers and those synced, then leave; after ``--elastic-timeout`` the job ends.
* **A failed worker** (non-zero exit) blacklists its host: all of the host's workers leave the
  job (they exit at the re-formation). With ``--blacklist-cooldown-range MIN MAX`` the host comes
  back after its cooldown (:func:`hora.elastic.discovery.cooldown`); without it, never.
* **Re-formation.** Once every worker still in the job asked for the next round (and there are
  at least ``--min-np``), the launcher forms it: earlier workers first, by their last rank (the
  new rank 0 holds the committed state). Each re-formation is one reset; more than
  ``--reset-limit`` end the job, with Horovod's message.
* **The end.** Success when every worker of the last round exited with 0. Failure, with the
  reason, when every worker failed or every host is blacklisted, when fewer than ``--min-np``
  remain with no way to get more, or when a round is not formed within ``--elastic-timeout``.

Layering: built on :mod:`hora.launch` (processes, hosts, ssh, the static :class:`Job`); the
CLI chooses between the two. Runs in the launcher's main thread; not thread-safe.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass

from hora.elastic.discovery import DISCOVERY_INTERVAL, cooldown, discover
from hora.elastic.run import synced_key
from hora.errors import LaunchError
from hora.launch.config import ElasticOptions, LaunchConfig
from hora.launch.hosts import HostSlots, SlotInfo, assign_ranks
from hora.launch.job import Job, exit_status
from hora.launch.preflight import run_preflight
from hora.launch.process import ConsoleSink, Worker, stop_all
from hora.launch.workerenv import job_env
from hora.rendezvous import rounds as rdv
from hora.rendezvous.client import StoreClient

__all__ = ["ElasticJob", "ElasticOptions"]

log = logging.getLogger("hora.launch")

_POLL = 0.05  # seconds between looks at the workers and the store


@dataclass
class _Member:
    id: str  # host:index[+n], the worker's name in the store
    host: str
    label: int  # the prefix of its output lines
    worker: Worker
    slot: str  # host:index it runs on
    rank: int = -1  # in the newest round it belongs to
    code: int | None = None  # exit code once it exited
    leaving: bool = False  # its host left the job: it exits at the next re-formation
    retiring: float | None = None  # since when its host is gone while it holds the only state
    stop_at: float = math.inf  # when a leaving worker that did not exit is stopped
    stranded: bool = False  # stopped waiting for a round that could not form (job finishing)


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
        total = sum(h.slots for h in self._hosts)
        cap = total if options.max_np is None else min(total, options.max_np)
        self.slots = assign_ranks(self._hosts, cap)  # every slot up to --max-np, as Horovod
        self.members: list[_Member] = []
        self._starts: dict[str, int] = {}  # slot -> workers started on it so far
        self._host_failures: dict[str, int] = {}
        self._blacklist: dict[str, float] = {}  # host -> when it may come back (inf: never)
        self._round = 0
        self._current: set[str] = set()  # ids of the newest round's members
        self._resets = 0
        self._updates = 0
        self._announced = -1  # the round whose joiners the workers were told about
        self._holders: set[str] = set()  # workers known to hold the committed state

    # -- hosts --------------------------------------------------------------------------------
    def _wait_for_hosts(self, np: int) -> list[HostSlots]:
        opts = self.options
        assert opts.host_discovery_script is not None
        deadline = time.monotonic() + opts.elastic_timeout
        while True:
            hosts = self._discover()
            if sum(h.slots for h in hosts) >= np:
                return hosts
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"Timed out waiting for minimum number of slots to become available: "
                    f"{np} needed, the discovery script lists "
                    f"{','.join(f'{h.name}:{h.slots}' for h in hosts) or 'none'}"
                )
            time.sleep(DISCOVERY_INTERVAL)

    def _discover(self) -> list[HostSlots]:
        """The hosts and slots now: the discovery script's answer. A job whose hosts come from
        elsewhere (Ray's nodes, :mod:`hora.ray`) overrides it."""
        opts = self.options
        assert opts.host_discovery_script is not None
        return discover(opts.host_discovery_script, opts.slots_per_host)

    def _address(self, host: str) -> str:
        assert self._preflight is not None
        known = self._preflight.launcher_address
        if host not in known:
            cfg = self.config
            found = run_preflight([host], self._ssh, cfg.start_timeout, cfg.network_interfaces)
            known.update(found.launcher_address)
        return known[host]

    def _blacklisted(self, host: str, now: float) -> bool:
        return self._blacklist.get(host, 0.0) > now

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
                "HOROVOD_ELASTIC_TIMEOUT": str(self.options.elastic_timeout),
            }
        )
        self._out, self._err = ConsoleSink(sys.stdout), ConsoleSink(sys.stderr)
        with StoreClient(self.store_address, self.port, self.secret) as store:
            self._store = store
            started = [self._start(slot) for slot in self.slots]
            self._form(0, started)
            self._holders = {m.id for m in started}  # one start state, synced from rank 0
            try:
                return self._watch()
            except LaunchError as e:
                log.error("hora run: %s", e)
                stop_all(self.workers, cfg.grace_seconds)
                return 1

    def _start(self, slot: SlotInfo) -> _Member:
        """Start a worker on ``slot``, with the identity variables it is planned to have."""
        host = slot.hostname
        where = f"{host}:{slot.local_rank}"
        n = self._starts.get(where, 0)
        self._starts[where] = n + 1
        wid = f"{where}+{n}" if n else where  # a fresh name: the store may hold the old keys
        env = dict(self._common)
        env.update(slot.identity_env())
        env["HORA_RENDEZVOUS_ADDR"] = env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = self._address(host)
        env["HORA_ELASTIC_ID"] = wid
        label = len(self.members)
        worker = self._spawn(label, host, env, self._out, self._err)
        member = _Member(wid, host, label, worker, slot=where)
        self.members.append(member)
        log.info("elastic: started worker %d (%s)", label, wid)
        return member

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
        # the host changes this round takes in: later ones interrupt its workers
        self._store.set(rdv.formed_key(r), str(self._updates).encode())
        self._round, self._current = r, {m.id for m in members}
        if r:
            log.info("elastic: round %d formed with %d workers", r, len(members))
            grace = time.monotonic() + self.config.grace_seconds + 5.0
            for m in self.members:
                if m.leaving and m.code is None:
                    m.stop_at = min(m.stop_at, grace)

    def _watch(self) -> int:
        opts = self.options
        pending_since: float | None = None
        next_discovery = time.monotonic() + DISCOVERY_INTERVAL
        while True:
            self._reap()
            now = time.monotonic()
            if now >= next_discovery:
                if opts.host_discovery_script:
                    self._rediscover()
                else:
                    self._refill(self._hosts)
                next_discovery = now + DISCOVERY_INTERVAL
            for m in self.members:
                if m.leaving and m.code is None and now > m.stop_at:
                    log.info("elastic: worker %d (%s) left no room; stopping it", m.label, m.id)
                    m.worker.stop()
                    m.stop_at = math.inf
            live = [m for m in self.members if m.code is None]
            active = [m for m in live if not m.leaving]
            if not live:
                return self._result()
            nxt = self._round + 1
            if self._finishing():
                # a worker of the job finished its training (Horovod: any success stops the
                # job): workers not yet in it are not taken in any more
                for m in active:
                    if m.id not in self._current:
                        self._leave(m)
                        m.worker.stop()
                self._stop_stranded(nxt)
                time.sleep(_POLL)
                continue
            self._note_holders(active)
            self._hand_over(active, now)
            active = [m for m in active if not m.leaving]
            ready = [m for m in active if self._store.check([rdv.ready_key(nxt, m.id)])]
            if not ready:
                pending_since = None
            else:
                pending_since = pending_since or now
                if len(active) < opts.min_np and not self._can_grow():
                    raise LaunchError(
                        f"only {len(active)} workers are left, fewer than --min-np "
                        f"{opts.min_np}, and no --host-discovery-script or "
                        "--blacklist-cooldown-range can add more"
                    )
                if any(m.id not in self._current for m in ready) and self._announced < nxt:
                    self._announced = nxt
                    self._hosts_changed(removed_only=False)
                if len(ready) == len(active) and len(active) >= opts.min_np:
                    self._next_round(active)
                    pending_since = None
                elif now - pending_since > opts.elastic_timeout:
                    missing = [m.id for m in active if m not in ready]
                    raise LaunchError(
                        "Timed out waiting for minimum number of slots to become available: "
                        f"round {nxt} was not formed within {opts.elastic_timeout:g}s "
                        f"(--elastic-timeout); {len(active)} workers in the job, --min-np "
                        f"{opts.min_np}; not ready: {', '.join(missing) or 'none'}"
                    )
            time.sleep(_POLL)

    def _finishing(self) -> bool:
        return any(
            m.code == 0 and m.id in self._current and not m.leaving for m in self.members
        )

    def _stop_stranded(self, nxt: int) -> None:
        """The job is finishing: a worker of the round that asks for the next one waits for a
        round that is never formed. Once no member of the round trains any more, such workers
        are stopped at once (Horovod ends the job when every worker has finished, failed or
        asked to re-form), instead of after --elastic-timeout; each counts as failed."""
        live = [m for m in self.members if m.code is None and m.id in self._current]
        live = [m for m in live if not m.leaving]
        waiting = [m for m in live if self._store.check([rdv.ready_key(nxt, m.id)])]
        if not waiting or len(waiting) < len(live):
            return
        done = [m.id for m in self.members if m.code == 0 and m.id in self._current]
        for m in (m for m in waiting if not m.stranded):  # each is told once
            log.warning(
                "elastic: worker %d (%s) asks to re-form, but %s finished the training; "
                "stopping it",
                m.label,
                m.id,
                ", ".join(done),
            )
            m.stranded = True
            m.worker.stop()

    def _note_holders(self, active: list[_Member]) -> None:
        """Workers of the round that synced the state since they joined now hold it."""
        for m in active:
            known = m.id in self._holders or m.id not in self._current
            if not known and self._store.check([synced_key(m.id)]):
                self._holders.add(m.id)

    def _hand_over(self, active: list[_Member], now: float) -> None:
        """Workers whose host is gone but which hold the only committed state leave once
        every other worker of the round has it (synced from them after a re-formation), or
        end the job after --elastic-timeout."""
        retiring = [m for m in active if m.retiring is not None]
        if not retiring:
            return
        heirs = [m for m in active if m.retiring is None and m.id in self._current]
        if heirs and all(m.id in self._holders for m in heirs):
            for m in retiring:
                log.info(
                    "elastic: worker %d (%s) handed the state over; it leaves at the next "
                    "commit",
                    m.label,
                    m.id,
                )
                self._leave(m)
            self._hosts_changed(removed_only=True)
            return
        since = min(m.retiring for m in retiring if m.retiring is not None)
        timeout = self.options.elastic_timeout
        if now - since > timeout:
            raise LaunchError(
                "No hosts from previous set remaining, unable to broadcast state: the workers "
                f"holding the committed state ({', '.join(m.id for m in retiring)}) are on "
                f"hosts that left the job, and no new worker received the state within "
                f"{timeout:g}s (--elastic-timeout); new workers waiting: "
                f"{', '.join(m.id for m in active if m.retiring is None) or 'none'}"
            )

    def _leave_or_retire(self, gone: list[_Member], now: float) -> list[_Member]:
        """Workers whose host left the job: they leave, except that if no other worker would
        be left holding the committed state, those that hold it stay (retire) until they
        handed it over (:meth:`_hand_over`). Returns the workers that leave now."""
        keep = [m for m in self.members if m.code is None and not m.leaving and m not in gone]
        heirs = [m for m in keep if m.id in self._holders and m.retiring is None]
        left = []
        for m in gone:
            if not heirs and m.id in self._holders:
                if m.retiring is None:
                    m.retiring = now
                    log.warning(
                        "elastic: host %s is gone; worker %d (%s) holds the committed state "
                        "and stays until new workers have it (at most --elastic-timeout %gs)",
                        m.host,
                        m.label,
                        m.id,
                        self.options.elastic_timeout,
                    )
                continue
            self._leave(m)
            left.append(m)
        return left

    def _next_round(self, active: list[_Member]) -> None:
        limit = self.options.reset_limit
        if limit is not None and self._resets >= limit:
            raise LaunchError(
                "Horovod was shutdown because number of resets during elastic job exceeded "
                f"limit: {limit}"
            )
        self._resets += 1
        # earlier members first, those known to hold the committed state ahead, by their last
        # rank: the new rank 0 holds the committed state
        old = sorted(
            (m for m in active if m.id in self._current),
            key=lambda m: (m.id not in self._holders, m.rank),
        )
        if not old:
            raise LaunchError("No hosts from previous set remaining, unable to broadcast state.")
        self._form(self._round + 1, old + [m for m in active if m.id not in self._current])

    def _reap(self) -> None:
        while not self._exits.empty():
            label, code = self._exits.get_nowait()
            m = self.members[label]
            m.code = code
            if m.leaving:  # not in the job any more: its exit does not count (as in Horovod)
                log.log(
                    logging.INFO if code == 0 else logging.WARNING,
                    "elastic: worker %d (%s), no longer in the job, exited with %s",
                    label,
                    m.id,
                    exit_status(code),
                )
                continue
            if code == 0:
                continue
            if m.stranded:
                continue
            log.warning("elastic: worker %d (%s) exited with %s", label, m.id, exit_status(code))
            if m.id in self._current:  # its round's connections wait for it no longer
                why = f"worker {m.id} (rank {m.rank}) exited with {exit_status(code)}"
                self._store.set(rdv.gone_key(self._round), why.encode())
            self._blacklist_host(m.host)
        live = [m for m in self.members if m.code is None]
        failed = any(m.code not in (0, None) and not m.leaving for m in self.members)
        if failed and live and all(m.leaving for m in live) and not self._finishing():
            raise LaunchError(self._why_none_left())

    def _why_none_left(self) -> str:
        failed = [m for m in self.members if m.code not in (0, None) and not m.leaving]
        hosts = sorted(self._blacklist)
        return (
            f"every host is blacklisted ({', '.join(hosts)}) after {len(failed)} workers "
            "exited with non-zero status; no worker is left to go on"
        )

    def _blacklist_host(self, host: str) -> None:
        """A worker on ``host`` failed: the host leaves the job, for good or for its cooldown."""
        bounds = self.options.cooldown_range
        failures = self._host_failures[host] = self._host_failures.get(host, 0) + 1
        others = [m for m in self.members if m.host == host and m.code is None and not m.leaving]
        others = [m for m in others if m.retiring is None]
        if bounds is None:
            self._blacklist[host] = math.inf
            log.warning(
                "elastic: host %s is blacklisted; its %d other workers leave the job",
                host,
                len(others),
            )
        else:
            wait = cooldown(bounds, failures)
            self._blacklist[host] = time.monotonic() + wait
            log.warning(
                "elastic: host %s is blacklisted for %.1fs; its %d other workers leave the job",
                host,
                wait,
                len(others),
            )
        self._leave_or_retire(others, time.monotonic())

    def _leave(self, m: _Member) -> None:
        m.leaving, m.retiring = True, None
        self._store.set(rdv.removed_key(m.id), b"1")
        if m.id not in self._current:  # a joiner never formed: nothing to wait for
            m.stop_at = time.monotonic() + self.config.grace_seconds

    def _can_grow(self) -> bool:
        return bool(self.options.host_discovery_script or self.options.cooldown_range)

    def _rediscover(self) -> None:
        opts = self.options
        assert opts.host_discovery_script is not None
        try:
            found = self._discover()
        except LaunchError as e:
            log.warning("elastic: %s; keeping the hosts found before", e)
            return
        by_name = {h.name: h for h in found}
        # a stable order: known hosts keep their place, new ones come last
        kept = [by_name[h.name] for h in self._hosts if h.name in by_name]
        known = {h.name for h in kept}
        self._hosts = kept + [h for h in found if h.name not in known]
        live = [m for m in self.members if m.code is None and not m.leaving]
        gone = self._removed(live, by_name)
        for m in live:
            if m.retiring is not None and m not in gone:  # its host is listed again
                log.info("elastic: host %s is back; worker %d stays", m.host, m.label)
                m.retiring = None
        left = self._leave_or_retire([m for m in gone if m.retiring is None], time.monotonic())
        for m in left:
            log.info("elastic: host %s is gone; worker %d leaves at the next commit", m.host,
                     m.label)  # fmt: skip
        added = self._refill(self._hosts)
        if any(m.id in self._current for m in left) and not added:
            # (workers that never joined a round leave without interrupting the job)
            self._hosts_changed(removed_only=True)

    def _removed(self, live: list[_Member], hosts: dict[str, HostSlots]) -> list[_Member]:
        """The workers of ``live`` the hosts found leave no room for: a gone host's, and those
        past their host's slots (Horovod's rule: a shrunk host loses its highest local ranks).
        :mod:`hora.spark.elastic`, whose slots are Spark's tasks, overrides it."""
        return [m for m in live if m.host not in hosts or _index(m.slot) >= hosts[m.host].slots]

    def _refill(self, hosts: list[HostSlots]) -> int:
        """Start workers on the free slots of ``hosts`` that are not blacklisted, up to
        ``--max-np``; with the identity they would have if the job re-formed with them."""
        opts, now = self.options, time.monotonic()
        if self._finishing():
            return 0  # the job is finishing: no new workers
        active = [m for m in self.members if m.code is None and not m.leaving]
        busy = {m.slot for m in active}
        active = [m for m in active if m.retiring is None]  # their hosts are gone
        room = math.inf if opts.max_np is None else opts.max_np - len(active)
        new: list[str] = []
        for h in hosts:
            if self._blacklisted(h.name, now):
                continue
            # as many new workers as the host has slots its workers do not take, on the
            # lowest free indexes (a worker may stay on an index past a shrunk host's slots)
            free = h.slots - sum(1 for s in busy if s.rsplit(":", 1)[0] == h.name)
            index = 0
            while free > 0 and len(new) < room:
                slot = f"{h.name}:{index}"
                if slot not in busy:
                    new.append(slot)
                    free -= 1
                index += 1
        if not new:
            return 0
        for host in {s.rsplit(":", 1)[0] for s in new} & set(self._blacklist):
            del self._blacklist[host]  # its cooldown ended
            log.info("elastic: host %s is back after its cooldown", host)
        order: dict[str, list[str]] = {}
        for m in sorted(active, key=lambda m: m.rank):
            order.setdefault(m.host, []).append(m.slot)
        for slot in new:
            order.setdefault(slot.rsplit(":", 1)[0], []).append(slot)
        size = sum(len(v) for v in order.values())
        plan = assign_ranks([HostSlots(h, len(v)) for h, v in order.items()], size)
        where = [s for v in order.values() for s in v]
        for slot, info in zip(where, plan):
            if slot in new:
                self._start(SlotInfo(info.hostname, info.rank, _index(slot), info.cross_rank,
                                     info.size, info.local_size, info.cross_size))  # fmt: skip
        return len(new)

    def _hosts_changed(self, removed_only: bool) -> None:
        self._updates += 1
        self._store.set(rdv.HOSTS, f"{self._updates},{int(removed_only)}".encode())

    def _result(self) -> int:
        last = [m for m in self.members if m.id in self._current and not m.leaving]
        failed = [m for m in last if m.code != 0]
        if last and not failed:
            return 0
        stranded = [m.id for m in failed if m.stranded]
        if stranded:
            done = [m.id for m in last if m.code == 0]
            log.error(
                "hora run: %s finished the training while %s had not and asked to re-form "
                "without it; they were stopped and the job fails, as Horovod's does",
                ", ".join(done),
                ", ".join(stranded),
            )
        if not last:
            log.error("hora run: %s", self._why_none_left())
            return 1
        first = failed[0]
        code = first.code or 1
        if len(failed) == len(last):
            log.error(
                "hora run: every worker of the last round (%d) exited with non-zero status; "
                "the first, worker %d (%s), with %s",
                len(last),
                first.label,
                first.id,
                exit_status(code),
            )
        else:
            log.error(
                "elastic: worker %d (%s) of the last round exited with %s",
                first.label,
                first.id,
                exit_status(code),
            )
        return code if 0 < code < 256 else 1


def _index(slot: str) -> int:
    return int(slot.rsplit(":", 1)[1])
