"""A process set of one (a world of one, or a set of one rank in a larger world) runs its
collectives in the caller's thread (hora.core.solo), on real ranks.

The results must be the engine path's bit for bit, for every op, dtype and scale: each battery
runs once with sets of one local (the default) and once through the engine
(``HORA_LOCAL_SETS=0``), and the two are compared byte for byte; the engine's counters show
that the first made no engine round and the second did (else the comparison proves nothing).
Around that: handles, names, the timeline, errors, join, in place without a copy, and device
tensors that stay on their device (``meta`` tensors, whose data cannot reach host memory).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cuda_fakes import cuda_only
from harness import run_ranks

ENGINE = {"HORA_LOCAL_SETS": "0"}
# (prescale, postscale): none, exact, inexact, and a negative one that truncates integers
SCALES = [(1.0, 1.0), (0.5, 3.0), (1 / 3, 2.5), (-2.0, 0.1)]
ELEMENTWISE = ("Sum", "Average", "Min", "Max", "Product")


def _values(dt: str, shape: tuple[int, ...] = (6, 2)) -> np.ndarray:
    """Storage-dtype values of hora dtype ``dt`` (bfloat16 as uint16 bits)."""
    from hora.collectives.reduce_ops import f32_to_bf16

    rng = np.random.default_rng(len(dt))
    n = int(np.prod(shape))
    if dt == "bool":
        v = rng.integers(0, 2, n).astype(bool)
    elif dt == "bfloat16":
        v = f32_to_bf16((rng.standard_normal(n) * 100).astype(np.float32))
    elif dt.startswith("float"):
        v = (rng.standard_normal(n) * 100).astype(dt)
    else:
        info = np.iinfo(dt)
        v = rng.integers(max(int(info.min), -1000), min(int(info.max), 1000), n).astype(dt)
    return v.reshape(shape)


def _battery(hvd: Any, process_set: Any, device: bool) -> dict[str, Any]:
    """Every op of the op surface on every dtype and scale: key -> result. ``device``: the
    inputs are torch tensors handed over as a device's (``DeviceArray`` with torch's buffer
    operations; CPU tensors standing in for a GPU's), else NumPy arrays."""
    import hora
    from hora.dtypes import DTYPES, FLOATING
    from hora.frameworks import ops

    def give(arr: np.ndarray, dt: str) -> tuple[Any, dict[str, Any]]:
        if not device:
            return arr.copy(), {"dtype": dt} if dt == "bfloat16" else {}
        import torch

        from hora.core.buffers import DeviceArray
        from hora.torch.adapter import local_ops

        t = torch.from_numpy(arr.copy())
        if dt == "bfloat16":
            t = t.view(torch.int16).view(torch.bfloat16)
        return DeviceArray(t, dt, local_ops(t.device)), {}

    out: dict[str, Any] = {}
    ps = {"process_set": process_set}
    for dt in DTYPES:
        base = _values(dt)
        for pre, post in SCALES:
            scale = {"prescale_factor": pre, "postscale_factor": post}
            ops_here = ELEMENTWISE + (("Adasum",) if dt in FLOATING else ())
            for opname in ops_here:
                op = getattr(hora, opname)
                x, kw = give(base, dt)
                key = f"{dt}/{opname}/{pre}/{post}"
                out[f"{key}/new"] = ops.allreduce(x, op=op, **scale, **kw, **ps)
                out[f"{key}/in_place"] = ops.allreduce(x, op=op, output=x, **scale, **kw, **ps)
                if not device:  # an output apart from the input (host arrays only)
                    o = np.zeros_like(base)
                    out[f"{key}/output"] = ops.allreduce(base.copy(), op=op, output=o, **scale,
                                                         **kw, **ps)  # fmt: skip
                if opname in ("Sum", "Average"):
                    y, _ = give(base[:2], dt)
                    z, _ = give(base, dt)
                    out[f"{key}/grouped"] = ops.grouped_allreduce([y, z], op=op, **scale, **kw,
                                                                  **ps)  # fmt: skip
                    r, _ = give(base, dt)
                    out[f"{key}/reducescatter"] = ops.reducescatter(r, op=op, **scale, **kw, **ps)
        x, kw = give(base, dt)
        out[f"{dt}/allgather"] = ops.allgather(x, **kw, **ps)
        out[f"{dt}/broadcast"] = ops.broadcast(x, process_set.ranks[0], **kw, **ps)
        out[f"{dt}/broadcast_"] = ops.broadcast(x, process_set.ranks[0], output=x, **kw, **ps)
        out[f"{dt}/alltoall"] = ops.alltoall(x, **kw, **ps)
        out[f"{dt}/alltoall_splits"] = ops.alltoall(x, [base.shape[0]], **kw, **ps)
    return out


def _as_bytes(value: Any) -> Any:
    """A result as (dtype, shape, bytes), a tuple or list of them, for exact comparison."""
    if isinstance(value, (list, tuple)):
        return [_as_bytes(v) for v in value]
    if not isinstance(value, np.ndarray):  # a torch tensor
        import torch

        t = value.detach()
        value = (t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16
                 else t.numpy())  # fmt: skip
    return (value.dtype.str, value.shape, value.tobytes())


def _run(rank: int, sets_of_one: bool, device: bool) -> dict[str, Any]:
    """The battery on this rank's set of one (a world of one, or ``ProcessSet([rank])``)."""
    import hora as hvd

    if sets_of_one:
        mine = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]
        hvd.init(process_sets=mine)
        ps = mine[rank]
    else:
        hvd.init()
        ps = hvd.global_process_set
    from hora.core.runtime import runtime

    stats = runtime().engine.stats
    before = dict(stats)
    res = {k: _as_bytes(v) for k, v in _battery(hvd, ps, device).items()}
    rounds = stats["responses"] - before["responses"] + stats["direct_rounds"] - \
        before["direct_rounds"]  # fmt: skip
    if sets_of_one:  # the world still works alongside
        assert hvd.allreduce(np.ones(1), op=hvd.Sum)[0] == 2.0
    hvd.shutdown()
    return {"results": res, "engine_rounds": rounds}


def _same(local: dict[str, Any], engine: dict[str, Any]) -> None:
    assert local["engine_rounds"] == 0, local["engine_rounds"]
    assert engine["engine_rounds"] > 0, "the engine path ran no round: HORA_LOCAL_SETS=0 ignored"
    a, b = local["results"], engine["results"]
    assert a.keys() == b.keys()
    differ = [k for k in a if a[k] != b[k]]
    assert not differ, f"{len(differ)} of {len(a)} results differ from the engine's: {differ[:8]}"


@pytest.mark.timeout(300)
def test_a_world_of_one_gives_the_engines_bits_for_every_op_dtype_and_scale() -> None:
    (local,) = run_ranks(_run, 1, args=(False, False), timeout=120)
    (engine,) = run_ranks(_run, 1, args=(False, False), timeout=240, env=ENGINE)
    _same(local, engine)


@pytest.mark.timeout(300)
def test_device_buffers_alone_give_the_host_engines_bits() -> None:
    """Torch's buffer operations on a device (CPU tensors stand in for a GPU's) against the
    engine path on host arrays: the scaling rules are the same bits."""
    (local,) = run_ranks(_run, 1, args=(False, True), timeout=120)
    (engine,) = run_ranks(_run, 1, args=(False, False), timeout=240, env=ENGINE)
    engine["results"] = {k: v for k, v in engine["results"].items() if k in local["results"]}
    _same(local, engine)


@pytest.mark.timeout(400)
def test_sets_of_one_in_a_larger_world_give_the_engines_bits() -> None:
    local = run_ranks(_run, 2, args=(True, False), timeout=150)
    engine = run_ranks(_run, 2, args=(True, False), timeout=300, env=ENGINE)
    for mine, theirs in zip(local, engine):
        _same(mine, theirs)


def _semantics(rank: int, timeline: str) -> dict[str, Any]:
    import hora as hvd
    from hora.core.runtime import runtime

    hvd.init()
    stats = runtime().engine.stats
    out: dict[str, Any] = {}
    x = np.arange(6, dtype=np.float32)
    h = hvd.allreduce_async(x, name="a", op=hvd.Average)  # already done: nothing to wait for
    out["poll"] = hvd.poll(h)
    out["by_int"] = hvd.synchronize(int(h)).tolist()
    out["again"] = hvd.synchronize(int(h))  # synchronized once: unknown now
    # in place: the input itself, no copy; a second op of the same name is no duplicate
    y = x.copy()
    r = hvd.allreduce(y, output=y, name="a", op=hvd.Sum, prescale_factor=2.0)
    out["in_place"] = bool(np.shares_memory(r, y)) and y.tolist() == (2 * x).tolist()
    hvd.allreduce(x)  # unnamed: allreduce.noname.0, then .1
    hvd.allgather_async(x)
    errors = {}
    for what, call in {
        "splits": lambda: hvd.alltoall(x, [2, 4]),
        "root": lambda: hvd.broadcast(x, 1),
        "adasum_int": lambda: hvd.allreduce(np.arange(4), op=hvd.Adasum),
        "scalar_rs": lambda: hvd.reducescatter(np.float32(1)),
        "output": lambda: hvd.allreduce(x, output=np.zeros(5, np.float32)),
        "op": lambda: hvd.allreduce(x, op=17),
    }.items():
        try:
            call()
            errors[what] = "accepted?!"
        except (ValueError, TypeError) as e:
            errors[what] = type(e).__name__
    out["errors"] = errors
    out["join"] = hvd.join()  # through the engine, as a control op
    out["after_join"] = hvd.allreduce(x, op=hvd.Sum).tolist()
    out["barrier"] = hvd.barrier() is None
    out["responses"] = stats["responses"]  # the join and the barrier only
    if timeline:
        runtime().timeline.flush()
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_a_world_of_one_keeps_handles_names_errors_join_and_the_timeline(tmp_path: Any) -> None:
    import json

    path = tmp_path / "timeline.json"
    (out,) = run_ranks(_semantics, 1, args=(str(path),), timeout=90,
                       env={"HOROVOD_TIMELINE": str(path)})  # fmt: skip
    assert out["poll"] is True and out["by_int"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert out["again"] is None and out["in_place"] is True
    assert all(v != "accepted?!" for v in out["errors"].values()), out["errors"]
    assert out["join"] == 0 and out["after_join"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert out["barrier"] and out["responses"] == 2
    events = json.loads(path.read_text())
    names = {e["args"]["name"] for e in events
             if e.get("ph") == "M" and "name" in e.get("args", {})}  # fmt: skip
    ops = [e["name"] for e in events if e.get("ph") == "B"]
    for n in ("allreduce.a", "allreduce.noname.0", "allgather.noname.1"):
        assert n in names, (n, names)
    assert ops.count("ALLREDUCE") == 4 and "ALLGATHER" in ops, ops
    assert not any(o.startswith("NEGOTIATE_ALLREDUCE") for o in ops), ops


def _device_stays(rank: int, local: bool) -> dict[str, Any]:
    """Every op of hora.torch on ``meta`` tensors: they have no data to bring to host memory,
    so an op that tried would fail; the results must be meta tensors of the right shape."""
    import torch

    import hora.torch as hvd

    hvd.init()
    m = torch.empty(4, 3, device="meta")
    calls = {
        "allreduce": lambda: hvd.allreduce(m, op=hvd.Average, prescale_factor=0.5),
        "allreduce_": lambda: hvd.allreduce_(m, op=hvd.Sum, postscale_factor=2.0),
        "grouped": lambda: hvd.grouped_allreduce([m, m[:1]]),
        "allgather": lambda: hvd.allgather(m),
        "broadcast": lambda: hvd.broadcast(m, 0),
        "broadcast_": lambda: hvd.broadcast_(m, 0),
        "alltoall": lambda: hvd.alltoall(m),
        "reducescatter": lambda: hvd.reducescatter(m),
        "adasum": lambda: hvd.allreduce(m, op=hvd.Adasum),
    }
    out: dict[str, Any] = {}
    for what, call in calls.items():
        try:
            r = call()
            rs = r if isinstance(r, list) else [r]
            out[what] = [(str(t.device), tuple(t.shape)) for t in rs]
        except Exception as e:  # the engine path: staging a meta tensor to host memory fails
            out[what] = f"{type(e).__name__}: {e}"
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_device_tensors_stay_on_their_device_in_a_world_of_one() -> None:
    (out,) = run_ranks(_device_stays, 1, args=(True,), timeout=90)
    for what, got in out.items():
        shapes = [(4, 3), (1, 3)] if what == "grouped" else [(4, 3)]
        assert got == [("meta", s) for s in shapes], (what, got)


def _cuda_battery(rank: int) -> dict[str, Any]:
    import torch

    import hora.torch as hvd
    from hora.core.runtime import runtime

    hvd.init()
    stats = runtime().engine.stats
    before = stats["responses"]
    out: dict[str, Any] = {}
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.uint8):
        base = (torch.arange(-24, 24, device="cuda") * 37 % 251).to(dt).reshape(12, 4)
        for pre, post in SCALES:
            if dt == torch.uint8 and min(pre, post) < 0:
                continue  # out of range: a negative value's conversion differs by device
            for op in (hvd.Sum, hvd.Average, hvd.Max):
                key = f"{dt}/{op}/{pre}/{post}"
                out[key] = hvd.allreduce(base, op=op, prescale_factor=pre,
                                         postscale_factor=post)  # fmt: skip
                t = base.clone()
                hvd.allreduce_(t, op=op, prescale_factor=pre, postscale_factor=post)
                out[key + "/in_place"] = t
            out[f"{dt}/{pre}/{post}/rs"] = hvd.reducescatter(base, op=hvd.Average,
                                                            prescale_factor=pre,
                                                            postscale_factor=post)  # fmt: skip
        out[f"{dt}/allgather"] = hvd.allgather(base)
        out[f"{dt}/broadcast"] = hvd.broadcast(base, 0)
        out[f"{dt}/alltoall"] = hvd.alltoall(base)
    on_gpu = all(v.is_cuda for v in out.values())
    res = {k: _as_bytes(v.cpu()) for k, v in out.items()}
    rounds = stats["responses"] - before
    hvd.shutdown()
    return {"results": res, "engine_rounds": rounds, "on_gpu": on_gpu}


@pytest.mark.gpu
@cuda_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", [{}, {"HOROVOD_GPU_OPERATIONS": "NCCL"}],
                         ids=["staged", "nccl"])  # fmt: skip
def test_cuda_tensors_alone_give_the_engines_bits_on_a_gpu(backend: dict[str, str]) -> None:
    (local,) = run_ranks(_cuda_battery, 1, timeout=150, env=backend)
    (engine,) = run_ranks(_cuda_battery, 1, timeout=150, env={**backend, **ENGINE})
    assert local["on_gpu"] and engine["on_gpu"]
    _same(local, engine)
