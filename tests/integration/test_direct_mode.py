"""Direct mode end to end (hora.core.fastpath): real ranks over real connections.

The steady state runs without the coordinator (its request counters stand still while the
rounds count up), and everything a round cannot settle goes back to it: a new tensor, a
changed shape (reported naming both sides), tensors submitted in different orders, join,
a rank that never submits (the stall inspector), a rank that shuts down or dies
while the others wait in a round. A barrier stays in the rounds and still waits for every rank.
Every test has a hard timeout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import run_ranks, spawn_ranks


def _stats() -> dict[str, int]:
    from hora.core import runtime

    return dict(runtime.runtime().engine.stats)


def _steady(rank: int) -> dict[str, object]:
    import numpy as np

    import hora as hvd

    hvd.init()
    size = hvd.size()
    x = np.arange(64, dtype=np.float32) + rank
    for _ in range(3):  # negotiated in full once, then as cache hits, then direct
        hvd.allreduce(x, op=hvd.Sum, name="x")
    before = _stats()
    sums = []
    for i in range(50):
        got = hvd.allreduce(x * (i + 1), op=hvd.Sum, name="x")
        sums.append(float(got[1]))
        g = hvd.grouped_allreduce([x, x[:8] + i], op=hvd.Average, name="g")
        assert np.allclose(g[1], np.arange(8) + (size - 1) / 2 + i)
    after = _stats()
    hvd.shutdown()
    expect = [float(sum(1 + r for r in range(size)) * (i + 1)) for i in range(50)]
    return {
        "sums_ok": sums == expect,
        "requests": (after["requests_full"] + after["requests_cached"])
        - (before["requests_full"] + before["requests_cached"]),
        "rounds": after["direct_rounds"] - before["direct_rounds"],
        "exits": after["direct_exits"] - before["direct_exits"],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_steady_state_skips_the_coordinator(np_: int) -> None:
    for out in run_ranks(_steady, np_, timeout=90):
        assert out["sums_ok"], out
        # the grouped op was new in the loop's first step, so that step asked rank 0; from
        # then on nothing did
        assert out["requests"] <= 4, out
        assert out["rounds"] >= 95, out
        assert out["exits"] <= 1, out


def _small_only(rank: int) -> dict[str, object]:
    import numpy as np

    import hora as hvd
    from hora.collectives.hierarchical import layout_of
    from hora.core import runtime

    hvd.init()
    x = np.arange(16, dtype=np.float32) + rank
    engine = runtime.runtime().engine
    got = [hvd.allreduce(x, op=hvd.Sum, name="x") for _ in range(29)]
    # looked at before the last call: once it is done, another rank's shutdown may close
    # this one's backend, arenas and all, before this thread looks
    ms = engine.members[0]
    boxes = engine._mailboxes(ms) is not None
    layout = layout_of(ms.comm)
    arenas = engine.executor.backend._arenas
    out = {"mailboxes": boxes, "rounds": engine.stats["direct_rounds"],
           "asked": 0 in arenas, "mapped": arenas.get(0) is not None,
           "shared": layout is not None and layout.shared}
    got.append(hvd.allreduce(x, op=hvd.Sum, name="x"))
    out["ok"] = all(np.array_equal(g, 3 * np.arange(16) + 3) for g in got)
    hvd.shutdown()
    return out


@pytest.mark.timeout(90)
def test_a_set_of_three_with_only_small_allreduces_rounds_through_mailboxes() -> None:
    """No allreduce here fuses, or is large enough for the set's shared arena: entering direct
    mode opens it, so the rounds' headers are written once each instead of sent on every
    pair."""
    from hora.transport.shm.arena import STORES_IN_ORDER

    results = spawn_ranks(_small_only, 3, timeout=60, env={"HOROVOD_LOG_LEVEL": "debug"})
    for r in results:
        # what the ranks said of their shared memory and arena, should this fail
        said = "\n".join(line for line in r.stderr.splitlines()
                         if "arena" in line or "shared memory" in line)[-3000:]
        assert r.ok, f"rank {r.rank}: {r.status}\n{r.stderr[-3000:]}"
        out = r.value
        assert out["ok"] and out["rounds"] >= 24, out
        assert out["asked"], out  # entering direct mode asked for the set's arena
        assert out["shared"], f"rank {r.rank}: the set is not on shared memory: {out}\n{said}"
        assert out["mapped"] and out["mailboxes"] == STORES_IN_ORDER, f"{out}\n{said}"


def _off(rank: int) -> dict[str, int]:
    import numpy as np

    import hora as hvd

    hvd.init()
    for _ in range(20):
        hvd.allreduce(np.ones(4), name="x")
    out = _stats()
    hvd.shutdown()
    return out


@pytest.mark.timeout(90)
def test_fast_path_can_be_turned_off() -> None:
    for out in run_ranks(_off, 2, timeout=60, env={"HORA_FAST_PATH": "0"}):
        assert out["direct_rounds"] == 0 and out["requests_cached"] >= 18, out


def _mixed(rank: int) -> dict[str, object]:
    import threading

    import numpy as np

    import hora as hvd

    hvd.init()
    out: dict[str, object] = {}
    a = np.full(4, rank + 1.0)
    for _ in range(3):
        hvd.allreduce(a, op=hvd.Sum, name="a")
        hvd.allreduce(a, op=hvd.Sum, name="b")
    # different submission orders on the two ranks, both asynchronous
    names = ["a", "b"] if rank == 0 else ["b", "a"]
    handles = {n: hvd.allreduce_async(a * (2 if n == "b" else 1), op=hvd.Sum, name=n)
               for n in names}
    out["order"] = [float(hvd.synchronize(handles[n])[0]) for n in ("a", "b")]
    # a new tensor, a broadcast, a barrier and an allgather in the middle of the steady state
    out["new"] = float(hvd.allreduce(a, op=hvd.Sum, name="new")[0])
    out["bcast"] = float(hvd.broadcast(a, root_rank=1, name="bc")[0])
    hvd.barrier()
    out["gather"] = hvd.allgather(np.full(rank + 1, rank), name="ag").tolist()
    for _ in range(3):
        hvd.allreduce(a, op=hvd.Sum, name="a")
    # a changed shape under a cached name: every rank gets the coordinator's report
    try:
        hvd.allreduce(np.ones(4 + rank), name="a")
        out["mismatch"] = "completed?!"
    except hvd.HorovodInternalError as e:
        out["mismatch"] = str(e)
    out["after"] = float(hvd.allreduce(a, op=hvd.Sum, name="a")[0])
    # join: rank 1 keeps reducing, rank 0 joins first
    if rank == 0:
        out["join"] = hvd.join()
    else:
        for _ in range(3):
            hvd.allreduce(a, op=hvd.Sum, name="a")
        out["join"] = hvd.join()
    out["final"] = float(hvd.allreduce(a, op=hvd.Sum, name="a")[0])
    done = threading.Event()
    done.set()
    out["stats"] = _stats()
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_everything_a_round_cannot_settle_goes_to_the_coordinator() -> None:
    for out in run_ranks(_mixed, 2, timeout=90):
        assert out["order"] == [3.0, 6.0], out
        assert out["new"] == 3.0 and out["bcast"] == 2.0, out
        assert out["gather"] == [0, 1, 1], out
        assert "Mismatched ALLREDUCE tensor shapes" in str(out["mismatch"]), out
        assert "[4]" in str(out["mismatch"]) and "[5]" in str(out["mismatch"]), out
        assert out["after"] == 3.0 and out["final"] == 3.0, out
        assert out["join"] == 1, out
        stats = out["stats"]
        assert isinstance(stats, dict) and stats["direct_exits"] >= 2, out


def _barriers(rank: int) -> dict[str, object]:
    import time

    import numpy as np

    import hora as hvd

    hvd.init()
    x = np.full(4, rank + 1.0)
    for _ in range(3):
        hvd.allreduce(x, op=hvd.Sum, name="x")
    before = _stats()
    spans = []
    sums = []
    for i in range(5):
        time.sleep(0.05 * ((rank + i) % hvd.size()))  # a different rank arrives last each time
        entered = time.time()
        hvd.barrier()
        spans.append((entered, time.time()))
        sums.append(float(hvd.allreduce(x, op=hvd.Sum, name="x")[0]))
    # a barrier behind work still in flight: the round runs the work, then the barrier
    h = hvd.allreduce_async(x, op=hvd.Sum, name="x")
    if rank == 1:
        time.sleep(0.2)
    hvd.barrier()
    sums.append(float(hvd.synchronize(h)[0]))
    after = _stats()
    hvd.shutdown()
    return {"spans": spans, "sums": sums,
            "exits": after["direct_exits"] - before["direct_exits"],
            "requests": (after["requests_full"] + after["requests_cached"])
            - (before["requests_full"] + before["requests_cached"])}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_barrier_in_the_steady_state_waits_for_all_without_the_coordinator(np_: int) -> None:
    outs = run_ranks(_barriers, np_, timeout=90)
    total = float(sum(range(1, np_ + 1)))
    for i in range(5):
        last_in = max(out["spans"][i][0] for out in outs)
        for out in outs:  # nobody left the barrier before the last rank entered it
            assert out["spans"][i][1] >= last_in, (i, outs)
    for out in outs:
        assert out["sums"] == [total] * 6, out
        assert out["exits"] == 0 and out["requests"] == 0, out


def _stall(rank: int, flag: str) -> str:
    import os
    import time

    import numpy as np

    import hora as hvd

    hvd.init()
    hvd.allreduce(np.ones(100_000), name="large")  # opens the set's shared arena
    for _ in range(3):
        hvd.allreduce(np.ones(2), name="x")
    try:
        if rank == 0:  # the others never ask again: rank 0 waits in a round
            try:
                hvd.allreduce(np.ones(2), name="x")
            finally:
                open(flag, "w").close()
            return "completed?!"
        deadline = time.monotonic() + 30
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)  # asleep, not in an op, until rank 0's op is over
        return "slept"
    except hvd.HorovodInternalError as e:
        return str(e)
    finally:
        hvd.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [2, 3])  # at np=3 the round's headers are in mailboxes
def test_a_round_that_waits_too_long_warns_then_shuts_down(tmp_path: Path, np_: int) -> None:
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    results = spawn_ranks(_stall, np_, args=(str(tmp_path / "rank0-done"),), timeout=60,
                          env=env)  # fmt: skip
    r0 = results[0]
    assert r0.ok, r0.stderr
    assert "Missing ranks" in r0.value and "1: [allreduce.x]" in r0.value, r0.value
    if np_ == 3:
        assert "2: [allreduce.x]" in r0.value, r0.value
    assert "STALL_SHUTDOWN" in r0.value, r0.value
    assert "waiting for remainder of ranks" in r0.stderr  # the warning came first
    # the others were asleep, not in an op: they learn of the shutdown as they leave
    for r in results[1:]:
        assert r.status in ("ok", "error"), r.stderr


def _leave_or_die(rank: int, how: str) -> dict[str, object]:
    import os
    import signal
    import time

    import numpy as np

    import hora as hvd

    hvd.init()
    hvd.allreduce(np.ones(100_000), name="large")  # opens the set's shared arena
    for _ in range(3):
        hvd.allreduce(np.ones(2), name="x")
    from hora.core import runtime

    engine = runtime.runtime().engine
    # the rounds' headers go through the arena's mailboxes (a pair's too)
    boxes = engine._mailboxes(engine.members[0]) is not None
    if rank == 1:
        time.sleep(0.5)  # the others now wait in a round
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.shutdown()
        return {"left": True}
    t0 = time.monotonic()
    try:
        hvd.allreduce(np.ones(2), name="x")
        err = "completed?!"
    except hvd.HorovodInternalError as e:
        err = str(e)
    return {"error": err, "seconds": time.monotonic() - t0, "mailboxes": boxes}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["shutdown", "kill"])
@pytest.mark.parametrize("np_", [2, 3])
def test_a_peer_that_leaves_during_a_round_fails_the_others_quickly(np_: int, how: str) -> None:
    from hora.transport.shm.arena import STORES_IN_ORDER

    results = spawn_ranks(_leave_or_die, np_, (how,), timeout=60)
    for r in results[:1] + results[2:]:
        assert r.ok, r.stderr
        assert "has been shut down" in str(r.value["error"]), r.value
        assert "rank 1" in str(r.value["error"]), r.value
        assert float(r.value["seconds"]) < 10, r.value
        assert r.value["mailboxes"] == STORES_IN_ORDER, r.value
    if how == "kill":
        assert results[1].status == "died" and results[1].returncode == -9


def _same_bits(rank: int, count: int) -> dict[str, object]:
    import hashlib

    import numpy as np

    import hora as hvd

    hvd.init()
    rng = np.random.default_rng(rank)
    out: dict[str, object] = {}
    ops = {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max,
           "prod": hvd.Product}
    digest = hashlib.sha256()
    before = _stats()
    for dtype in ("float32", "float64", "float16", "int32", "int64", "uint8", "bool"):
        for label, op in ops.items():
            if dtype == "bool" and label in ("avg", "prod"):
                continue
            x = (rng.standard_normal(count) * 10).astype(dtype)
            got = []
            # the first is negotiated with rank 0 (the backend's bits), the second as cache
            # hits, the later ones in direct mode, with the inputs exchanged in the round
            for _ in range(4):
                got.append(hvd.allreduce(x, op=op, name=f"{dtype}.{label}",
                                         prescale_factor=1.0 if dtype == "bool" else 0.5,
                                         postscale_factor=1.0 if dtype == "bool" else 3.0))
            out[f"{dtype}.{label}"] = all(g.tobytes() == got[0].tobytes() for g in got[1:])
            digest.update(got[-1].tobytes())
    # in place, into a given output, bfloat16 storage
    size = hvd.size()
    buf = np.arange(count, dtype=np.float32) * (rank + 1)
    for _ in range(4):
        hvd.allreduce(buf, op=hvd.Sum, output=buf, name="inplace")
    # element i is i * (1 + .. + size) after the first step, times size at each later one
    total = size * (size + 1) / 2
    out["inplace"] = bool(np.array_equal(buf, np.arange(count) * total * size**3))
    src = np.full(count, rank + 1, dtype=np.float64)
    dst = np.zeros_like(src)
    for _ in range(4):
        hvd.allreduce(src, op=hvd.Average, output=dst, name="given")
    out["given"] = bool(np.all(dst == total / size) and np.all(src == rank + 1))
    bf = np.full(count, 0x3F80, dtype=np.uint16)  # bfloat16 1.0
    for _ in range(4):
        res = hvd.allreduce(bf, op=hvd.Sum, dtype="bfloat16", name="bf16")
    want = np.array([size], np.float32).view(np.uint32) >> 16  # bfloat16 of size
    out["bf16"] = bool(np.all(res == want) and np.all(bf == 0x3F80))  # the input kept
    after = _stats()
    out["exchanged"] = after["exchanged"] - before["exchanged"]
    out["exchanged_shared"] = after["exchanged_shared"] - before["exchanged_shared"]
    out["lane"] = after["lane"] - before["lane"]
    out["spread"] = after["spread"] - before["spread"]
    out["digest"] = digest.hexdigest()
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("np_", "count", "way"),
    [
        (2, 300, "exchanged"),
        # 70 KB to 560 KB: the shared arena, in a slot up to 256 KiB, else staged ahead
        (2, 70_001, "exchanged_shared+spread"),
        (3, 300, "exchanged"),  # every member's inputs to every other, in the headers
        (4, 300, "exchanged"),
        (3, 70_001, "spread"),  # staged in the shared arena ahead of the header
        (4, 70_001, "spread"),
    ],
    ids=["in-the-headers", "shared-arena", "np3-in-the-headers", "np4-in-the-headers",
         "np3-staged-ahead", "np4-staged-ahead"],
)
def test_inputs_exchanged_in_the_round_give_the_backends_bits(np_: int, count: int,
                                                              way: str) -> None:  # fmt: skip
    """Two members: up to 64 KiB the inputs travel in the round's headers; above, on one
    host, through the set's shared arena (hora.backends.native.exchange_slot). More members:
    small inputs travel in the headers to every member, and each reduces them in the order of
    the backend's recursive doubling; larger ones each member stages in the shared arena
    before its header, and the backend's steps go on from there once every header is in.
    Either way the later results have the bits of the first, which the backend made, on every
    rank (prescaled, in place, into a given output, bfloat16)."""
    results = run_ranks(_same_bits, np_, args=(count,), timeout=90)
    assert len({r["digest"] for r in results}) == 1  # the same bits on every rank
    for out in results:
        bad = [k for k, v in out.items() if v is False]
        assert not bad, bad
        # 31 dtype and op cases plus 3 more, each exchanged twice or more
        assert sum(int(out[w]) for w in way.split("+")) >= 2 * 34, out  # type: ignore[call-overload]
        assert all(int(out[w]) > 0 for w in way.split("+")), out  # type: ignore[call-overload]
        # every one of them by the callers' lanes (hora.core.handover)
        assert int(out["lane"]) >= 2 * 34, out  # type: ignore[call-overload]


def _split_group(rank: int) -> dict[str, object]:
    import numpy as np

    import hora as hvd

    hvd.init()
    # the group's first member fits a hand-over and its second does not (over 14 MiB, or over
    # 64 KiB / (n - 1) among more members): a round that settled the first alone left the
    # second waiting for a group that could never be whole again
    xs = [np.full(n, rank + 1.0, np.float32) for n in (1024, 5_000_000)]
    want = hvd.size() * (hvd.size() + 1) / 2
    ok = []
    for _ in range(6):
        out = hvd.grouped_allreduce(xs, op=hvd.Sum, name="split")
        ok.append(all(bool(np.all(o == want)) for o in out))
    rounds = _stats()["direct_rounds"]
    hvd.shutdown()
    return {"ok": all(ok), "rounds": rounds}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_group_is_never_split_between_a_hand_over_and_the_backend(np_: int) -> None:
    env = {"HOROVOD_FUSION_THRESHOLD": str(1 << 20)}
    for out in run_ranks(_split_group, np_, timeout=90, env=env):
        assert out["ok"] is True, out
        assert int(out["rounds"]) > 0, out  # type: ignore[call-overload]  # in direct mode


def _lane_meets_other_rounds(rank: int) -> dict[str, object]:
    import numpy as np

    import hora as hvd

    hvd.init()
    # in the header, and (400 KB) staged in the set's shared arena ahead of the header
    xs = {"a": np.arange(300, dtype=np.float32) + rank, "b": np.full(40, rank + 1.0),
          "c": np.arange(100_000, dtype=np.float32) * (rank + 1)}
    n = hvd.size()
    ones = n * (n + 1) // 2  # the sum of rank + 1 over the ranks
    want = {"a": n * np.arange(300) + ones - n, "b": np.full(40, ones),
            "c": np.arange(100_000) * ones}
    ok = []

    def blocking(name: str) -> None:
        ok.append(np.array_equal(hvd.allreduce(xs[name], op=hvd.Sum, name=name), want[name]))

    for _ in range(3):  # cached, and direct mode entered
        for name in xs:
            blocking(name)
    before = _stats()
    for step in range(20):
        if rank == 0 or step % 2 == 0:  # blocking, one at a time: the callers' lanes
            for name in xs:
                blocking(name)
        else:  # all at once, in the other order: rank 0's header is not mirrored
            handles = {n: hvd.allreduce_async(xs[n], op=hvd.Sum, name=n) for n in "cba"}
            ok.extend(np.array_equal(hvd.synchronize(h), want[n]) for n, h in handles.items())
    after = _stats()
    hvd.shutdown()
    return {"ok": all(ok) and len(ok) == 69,
            **{k: after[k] - before[k]
               for k in ("lane", "direct_rounds", "exchanged_shared", "spread")}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_the_lane_of_a_blocking_allreduce_meets_rounds_that_differ(np_: int) -> None:
    """A caller's blocking allreduce goes in one header, its inputs in it (or, larger, staged
    in the shared arena ahead of it), and is reduced with the others' when every other header
    mirrors it (the lane, hora.core.handover). Where rank 1 holds more, in another order, the
    round goes on as any other: every result is right, on every rank."""
    r0, r1, *_ = results = run_ranks(_lane_meets_other_rounds, np_, timeout=90)
    for out in results:
        assert out["ok"] is True, out
        # 400 KB staged in the shared arena ahead of the header
        assert int(out["spread"]) >= 10, out  # type: ignore[call-overload]
    # the ten steps all block: every rank's lanes, three (two) times a step
    assert int(r1["lane"]) >= (30 if np_ == 2 else 20), r1  # type: ignore[call-overload]
    # and the other ten: rank 0's lane saw [c, b, a] against its [a], and went on as a round
    assert int(r0["direct_rounds"]) > int(r0["lane"]), r0  # type: ignore[call-overload]
