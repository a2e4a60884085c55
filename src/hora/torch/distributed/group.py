"""hora's ``torch.distributed`` process group: torch's collectives on hora's engine.

torch calls :func:`create` from ``init_process_group(backend="hora")`` (after
:mod:`hora_torch_plugin` registered the name). It starts hora if the script has not
(:mod:`hora.torch.distributed.bootstrap`) and returns a :class:`HoraProcessGroup`, a Python
subclass of ``torch.distributed.ProcessGroup`` that torch's C++ side (DDP's reducer, its
parameter broadcast) calls through its trampoline as ``dist.*`` calls do from Python.

Every collective is submitted with ``hora.torch``'s async ops on the group's hora process set,
named by :mod:`~hora.torch.distributed.names` so that a loop's ops are served from hora's
response cache, and returns a :class:`~hora.torch.distributed.work.HoraWork`. A blocking call
(``async_op=False``, torch's default) goes as hora.torch's blocking forms go: the caller's
thread runs it where hora's direct mode lets it, waits, and returns a completed
:class:`~hora.torch.distributed.work.DoneWork`. The ops run where hora runs them: negotiated
and fused by the engine, over hora's transports, in hora's timeline.
``dist.new_group(ranks)`` becomes a hora process set (negotiated by every rank, as torch's
``new_group`` is called by every rank). ``gather``, ``scatter`` and ``reduce`` are hora's
rooted ops (:mod:`~hora.torch.distributed.rooted`); ``send`` and ``recv`` (from a named
rank or from any) hora's tagged
messages beside the engine (:mod:`~hora.torch.distributed.p2p`). Submission runs in the
caller's thread (the training thread, or DDP's autograd thread); completion in the engine
thread.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import hora.torch as hvd
from hora.frameworks import repeat
from hora.frameworks.submit import caller_waits
from hora.torch.adapter import host_view
from hora.torch.distributed import p2p, rooted
from hora.torch.distributed.bootstrap import ensure_hora
from hora.torch.distributed.names import CallNames
from hora.torch.distributed.work import DoneWork, HoraWork, backend_error

_R = dist.ReduceOp
_OPS = {
    _R.SUM: hvd.Sum,
    _R.AVG: hvd.Average,
    _R.MIN: hvd.Min,
    _R.MAX: hvd.Max,
    _R.PRODUCT: hvd.Product,
}


def _op(opts: Any, call: str) -> int:
    """hora's op for the ``ReduceOp`` of ``opts`` (torch's options; None: SUM), or ValueError
    naming ``call``."""
    reduce_op = opts.reduceOp if opts is not None else _R.SUM
    for torch_op, hora_op in _OPS.items():
        if reduce_op == torch_op:
            return int(hora_op)
    what = str(getattr(reduce_op, "op", reduce_op)).rsplit(".", 1)[-1]
    raise ValueError(
        f"hora backend: {call} with ReduceOp.{what} is not supported; hora reduces with "
        "ReduceOp.SUM, AVG, MIN, MAX or PRODUCT"
    )


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1)


def _key(call: str, tensors: list[torch.Tensor], *extra: Any) -> tuple[Any, ...]:
    return (call, *extra, *((t.dtype, t.numel()) for t in tensors))


class HoraProcessGroup(dist.ProcessGroup):
    """The ranks ``ranks`` (global) as one torch process group over a hora process set."""

    def __init__(self, store: Any, rank: int, size: int, ranks: list[int],
                 process_set: Any) -> None:  # fmt: skip
        super().__init__(rank, size)  # the (store, rank, size) form skips the trampoline
        self._store = store
        self._rank = rank
        self._size = size
        self._ranks = list(ranks)
        self._set = process_set
        self._names = CallNames()
        self._group_name = ""
        self._group_desc = "undefined"

    # -- identity ---------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "hora"

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    # torch's ProcessGroup keeps these in its backends; this group has none of its own
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    @property
    def process_set(self) -> Any:
        """The hora process set this group runs on."""
        return self._set

    def __repr__(self) -> str:
        return f"<HoraProcessGroup rank {self._rank} of {self._ranks}>"

    # -- submission helpers -----------------------------------------------------------------
    def _name(self, call: str, tensors: list[torch.Tensor], *extra: Any) -> str:
        return self._names.name(_key(call, tensors, *extra))

    def _work(self, call: str, outputs: list[torch.Tensor], start: Any, finish: Any = None,
              names: list[str] | None = None, opts: Any = None) -> dist.Work:  # fmt: skip
        """Submit through ``start() -> [handles]`` (the ops named ``names``); a failure to
        submit (bad input) raises at once as torch's error naming ``call``. A blocking call
        (``opts.asyncOp`` False: ``dist.all_reduce(t)``) on host tensors runs as hora.torch's
        blocking forms do, in this thread where the engine lets it (no hand-off to the
        engine's thread and back), and returns a :class:`DoneWork`; its failure raises here."""
        blocking = (opts is not None and not opts.asyncOp
                    and all(t.device.type == "cpu" for t in outputs))  # fmt: skip
        try:
            if blocking:
                with caller_waits():
                    handles = start()
            else:
                handles = start()
        except (ValueError, TypeError, NotImplementedError) as e:
            raise type(e)(f"hora backend: {call}: {e}") from e
        except Exception as e:
            raise backend_error(call, e) from e
        if blocking:
            return self._finish_here(call, outputs, handles, finish, names)
        work = HoraWork(call, outputs, handles, finish, self._names.reset)
        if names:
            self._names.track(names, work)
        return work

    def _finish_here(self, call: str, outputs: list[torch.Tensor], handles: list[Any],
                     finish: Any, names: list[str] | None) -> DoneWork:  # fmt: skip
        """A blocking call's end: wait for its handles in this thread, finish, raise."""
        try:
            results = [hvd.synchronize(h) for h in handles]
            if finish is not None:
                finish(results)
        except BaseException as e:
            self._names.reset()
            raise backend_error(call, e) from e
        if names:
            self._names.untrack(names)  # an earlier op under these names is over too
        return DoneWork(call, outputs)

    # -- reductions -------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = _op(opts, "allreduce")
        return self._allreduce("allreduce", list(tensors), op, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = _op(opts, "allreduce_coalesced")
        return self._allreduce("allreduce_coalesced", list(tensors), op, opts)

    def _allreduce(self, call: str, tensors: list[torch.Tensor], op: int,
                   opts: Any) -> dist.Work:  # fmt: skip
        name = self._name("allreduce", tensors, op)
        again = None  # a blocking call of one tensor: as hora.torch.allreduce_, the express lane
        if len(tensors) == 1 and opts is not None and not opts.asyncOp:
            again = {"name": name, "op": op, "process_set": self._set}
            try:
                done = repeat.again(tensors[0], again, host_view) is not repeat.MISSED
            except BaseException as e:
                self._names.reset()
                raise backend_error(call, e) from e
            if done:
                self._names.untrack([name])
                return DoneWork(call, tensors)

        def start() -> list[Any]:
            if len(tensors) == 1:
                return [hvd.allreduce_async_(tensors[0], name=name, op=op,
                                             process_set=self._set)]  # fmt: skip
            return [hvd.grouped_allreduce_async_(tensors, name=name, op=op,
                                                 process_set=self._set)]  # fmt: skip

        work = self._work(call, tensors, start, names=[name], opts=opts)
        if again is not None and isinstance(work, DoneWork):
            repeat.remember(tensors[0], again, host_view)
        return work

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:  # fmt: skip
        call = "reduce_scatter"
        op = _op(opts, call)
        inputs = [torch.cat([_flat(t) for t in chunks]).view(self._size, -1)
                  for chunks in input_lists]  # fmt: skip
        return self._reduce_scatter(call, list(outputs), inputs, op, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> dist.Work:  # fmt: skip
        call = "reduce_scatter_tensor"
        op = _op(opts, call)
        rows = [self._rows(input, output, call)]
        return self._reduce_scatter(call, [output], rows, op, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:  # fmt: skip
        call = "reduce_scatter_tensor_coalesced"
        op = _op(opts, call)
        rows = [self._rows(i, o, call) for o, i in zip(outputs, inputs)]
        return self._reduce_scatter(call, list(outputs), rows, op, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _rows(self, input: torch.Tensor, output: torch.Tensor, call: str) -> torch.Tensor:
        if input.numel() != output.numel() * self._size:
            raise ValueError(
                f"hora backend: {call}: the input has {input.numel()} elements, the output "
                f"{output.numel()}; the input must hold the group's size ({self._size}) times "
                "the output's"
            )
        return _flat(input).view(self._size, -1)

    def _reduce_scatter(self, call: str, outputs: list[torch.Tensor],
                        inputs: list[torch.Tensor], op: int,
                        opts: Any) -> dist.Work:  # fmt: skip
        name = self._name("reducescatter", inputs, op)

        def start() -> list[Any]:
            if len(inputs) == 1:
                return [hvd.reducescatter_async(inputs[0], name=name, op=op,
                                                process_set=self._set)]  # fmt: skip
            return [hvd.grouped_reducescatter_async(inputs, name=name, op=op,
                                                    process_set=self._set)]  # fmt: skip

        def finish(results: list[Any]) -> None:
            parts = [results[0]] if len(inputs) == 1 else results[0]
            for out, part in zip(outputs, parts):
                out.copy_(part.view(out.shape))

        return self._work(call, outputs, start, finish, [name], opts)

    # -- broadcast --------------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        root = opts.rootRank if opts is not None else 0
        if not 0 <= root < self._size:
            raise ValueError(f"hora backend: broadcast: root rank {root} is not in the group "
                             f"of {self._size}")  # fmt: skip
        global_root = self._ranks[root]
        tensors = list(tensors)
        names = [self._name("broadcast", [t], global_root) for t in tensors]
        return self._work(
            "broadcast",
            tensors,
            lambda: [hvd.broadcast_async_(t, global_root, name=n, process_set=self._set)
                     for t, n in zip(tensors, names)],
            names=names,
            opts=opts,
        )  # fmt: skip

    # -- gathers ----------------------------------------------------------------------------
    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:  # fmt: skip
        return self._allgather("allgather", output_lists, list(inputs), opts)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:  # fmt: skip
        return self._allgather("allgather_coalesced", output_lists, list(inputs), opts)

    def _allgather(self, call: str, output_lists: list[list[torch.Tensor]],
                   inputs: list[torch.Tensor], opts: Any) -> dist.Work:  # fmt: skip
        for outs in output_lists:
            if len(outs) != self._size:
                raise ValueError(f"hora backend: {call}: each output list must hold "
                                 f"{self._size} tensors, got {len(outs)}")  # fmt: skip

        def finish(parts: list[torch.Tensor]) -> None:
            for outs, got in zip(output_lists, parts):
                chunks = got.view(self._size, -1)
                for i, out in enumerate(outs):
                    out.copy_(chunks[i].view(out.shape))

        flat = [out for outs in output_lists for out in outs]
        return self._gather(call, flat, [_flat(t) for t in inputs], finish, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> dist.Work:  # fmt: skip
        return self._into("all_gather_into_tensor", [output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:  # fmt: skip
        return self._into("all_gather_into_tensor_coalesced", list(outputs), list(inputs),
                          opts)  # fmt: skip

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _into(self, call: str, outputs: list[torch.Tensor],
              inputs: list[torch.Tensor], opts: Any) -> dist.Work:  # fmt: skip
        for o, i in zip(outputs, inputs):
            if o.numel() != i.numel() * self._size:
                raise ValueError(
                    f"hora backend: {call}: the output has {o.numel()} elements, the input "
                    f"{i.numel()}; the output must hold the group's size ({self._size}) times "
                    "the input's"
                )

        def finish(parts: list[torch.Tensor]) -> None:
            for out, got in zip(outputs, parts):
                if got.numel() != out.numel():
                    raise ValueError(f"gathered {got.numel()} elements into an output of "
                                     f"{out.numel()}: the ranks' inputs differ in size")
                out.copy_(got.view(out.shape))

        return self._gather(call, outputs, [_flat(t) for t in inputs], finish, opts)

    def _gather(self, call: str, outputs: list[torch.Tensor], flat: list[torch.Tensor],
                finish: Any, opts: Any) -> dist.Work:  # fmt: skip
        name = self._name("allgather", flat)

        def start() -> list[Any]:
            if len(flat) == 1:
                return [hvd.allgather_async(flat[0], name=name, process_set=self._set)]
            return [hvd.grouped_allgather_async(flat, name=name, process_set=self._set)]

        def done(results: list[Any]) -> None:
            finish([results[0]] if len(flat) == 1 else list(results[0]))

        return self._work(call, outputs, start, done, [name], opts)

    # -- all-to-all -------------------------------------------------------------------------
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:  # fmt: skip
        call = "all_to_all"
        if len(inputs) != self._size or len(outputs) != self._size:
            raise ValueError(f"hora backend: {call}: needs {self._size} input and output "
                             f"tensors, got {len(inputs)} and {len(outputs)}")  # fmt: skip
        send = torch.cat([_flat(t) for t in inputs])
        splits = [t.numel() for t in inputs]

        def finish(results: list[Any]) -> None:
            got, received = results[0]
            parts = torch.split(got, [int(n) for n in received])
            for out, part in zip(outputs, parts):
                out.copy_(part.view(out.shape))

        name = self._name("alltoall", [send])
        return self._work(
            call,
            list(outputs),
            lambda: [hvd.alltoall_async(send, splits, name=name, process_set=self._set)],
            finish,
            [name],
            opts,
        )

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> dist.Work:  # fmt: skip
        call = "all_to_all_single"
        splits = list(input_split_sizes) or None
        source = input.detach().contiguous()

        def finish(results: list[Any]) -> None:
            got, _ = results[0]
            if got.numel() != output.numel():
                raise ValueError(f"received {got.numel()} elements for an output of "
                                 f"{output.numel()}: output_split_sizes do not match what "
                                 "the peers sent")  # fmt: skip
            output.copy_(got.view(output.shape))

        name = self._name("alltoall", [source])
        return self._work(
            call,
            [output],
            lambda: [hvd.alltoall_async(source, splits, name=name, process_set=self._set)],
            finish,
            [name],
            opts,
        )

    alltoall_base = all_to_all_single

    # -- control ----------------------------------------------------------------------------
    def barrier(self, opts: Any = None) -> dist.Work:
        try:
            hvd.barrier(process_set=self._set)
        except Exception as e:
            raise backend_error("barrier", e) from e
        return DoneWork("barrier", [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        self.barrier().wait()

    # -- rooted and point-to-point calls (rooted.py, p2p.py) ---------------------------------
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> HoraWork:
        return rooted.reduce(self, list(tensors), opts, _op(opts, "reduce"))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> HoraWork:  # fmt: skip
        return rooted.gather(self, outputs, list(inputs), opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> HoraWork:  # fmt: skip
        return rooted.scatter(self, list(outputs), inputs, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> HoraWork:
        return p2p.send(self, list(tensors), dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> HoraWork:
        return p2p.recv(self, list(tensors), src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> HoraWork:
        return p2p.recv(self, list(tensors), None, tag)

    # -- subgroups --------------------------------------------------------------------------
    def new_group(self, ranks: list[int], timeout: timedelta | None = None,
                  pg_options: Any = None, group_name: str | None = None,
                  group_desc: str | None = None) -> HoraProcessGroup | None:  # fmt: skip
        """``dist.new_group(ranks)``, which torch hands to the default group on every rank:
        the ranks become a hora process set (every rank takes part in adding it); None on a
        rank outside ``ranks``."""
        caller = sys._getframe(1).f_locals  # torch's _new_group_with_tag
        backend = str(caller.get("backend") or "hora")
        if backend != "hora":
            raise NotImplementedError(
                f"hora backend: new_group(backend={backend!r}) under backend='hora' is not "
                "supported: hora's subgroups are hora process sets; leave backend= out"
            )
        if caller.get("use_local_synchronization"):
            raise NotImplementedError(
                "hora backend: new_group(use_local_synchronization=True) is not supported: "
                "hora adds a process set with every rank; call new_group on every rank"
            )
        ranks = sorted(int(r) for r in ranks)
        try:
            ps = self._set if ranks == self._ranks else _process_set(ranks)
        except Exception as e:
            raise backend_error("new_group", e) from e
        rank = hvd.rank()
        if rank not in ranks:
            return None
        store = dist.PrefixStore(f"{group_name}/", self._store)
        group = HoraProcessGroup(store, ranks.index(rank), len(ranks), ranks, ps)
        group._group_name = str(group_name or "")
        group._group_desc = str(group_desc or "undefined")
        return group


def _process_set(ranks: list[int]) -> Any:
    """The hora process set for ``ranks``: a new one (negotiated with every rank)."""
    try:
        return hvd.add_process_set(ranks)
    except ValueError as e:
        if "dynamic process sets" in str(e):
            raise ValueError(
                "dist.new_group needs hora's dynamic process sets: start hora with "
                "hvd.init(process_sets='dynamic') or HOROVOD_DYNAMIC_PROCESS_SETS=1, or let "
                "init_process_group(backend='hora') start it"
            ) from e
        raise


def create(options: Any, backend_options: Any = None) -> HoraProcessGroup:
    """torch's creator: the default group (every rank) on hora's global process set."""
    ranks = list(options.global_ranks_in_group or [])
    ensure_hora(options)
    world = list(range(hvd.size()))
    if ranks and ranks != world:
        raise NotImplementedError(
            "hora backend: a subgroup with backend='hora' needs hora as the default backend: "
            "call init_process_group(backend='hora'), then dist.new_group(ranks)"
        )
    return HoraProcessGroup(options.store, options.group_rank, options.group_size, world,
                            hvd.global_process_set)  # fmt: skip
