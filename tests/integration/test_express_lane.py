"""The express lane (hora.core.express, hora.frameworks.repeat): a blocking allreduce called
again as before runs again at once. Real ranks over real shared memory: in pairs, whose
rounds' headers go on the pair, and in sets of three and four, where they go through the set's
mailboxes.

Its results are the lane's, bit for bit; a call that is not the same call (another array, a
keyword changed, the array changed in place) goes the usual way; a round whose other headers
say something else goes on as any round; a mismatch across ranks still raises on every rank,
naming both sides; a peer that dies fails the others within seconds. Every test has a hard
timeout.
"""

from __future__ import annotations

import pytest

from harness import run_ranks, spawn_ranks


def _express(what: str = "express") -> int:
    from hora.core import runtime

    return int(runtime.runtime().engine.stats[what])


def _loop(rank: int) -> dict[str, object]:
    import numpy as np

    import hora as hvd

    hvd.init()
    n = hvd.size()
    ok: dict[str, bool] = {}
    for dtype in ("float32", "float64", "int32"):
        for op, label in ((hvd.Sum, "sum"), (hvd.Average, "avg"), (hvd.Max, "max")):
            base = (np.arange(257) % 7 + rank).astype(dtype)
            # what the backend gives (negotiated in full, first), then the same call again
            first = hvd.allreduce(base.copy(), op=op, name=f"{dtype}.{label}")
            x = base.copy()
            same = True
            for _ in range(12):
                x[:] = base
                got = hvd.allreduce(x, op=op, output=x, name=f"{dtype}.{label}")
                same = same and got.tobytes() == first.tobytes() and x.tobytes() == first.tobytes()
            ok[f"{dtype}.{label}"] = same
    # no output: a new array each call, the input kept
    y = np.full(100, rank + 1.0)
    for _ in range(10):
        out = hvd.allreduce(y, op=hvd.Sum, name="fresh")
    ok["fresh"] = bool(np.all(out == n * (n + 1) / 2) and np.all(y == rank + 1) and out is not y)
    before = _express()
    for _ in range(40):  # the name made anew each call: the same call all the same
        z = hvd.allreduce(y, op=hvd.Sum, name=f"{'fre'}sh")
    ok["named anew"] = bool(np.all(z == n * (n + 1) / 2))
    express = _express() - before
    hvd.shutdown()
    return {"ok": ok, "express": express}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_a_call_repeated_takes_the_express_lane_with_the_lanes_bits(np_: int) -> None:
    for out in run_ranks(_loop, np_, timeout=90):
        ok = out["ok"]
        assert isinstance(ok, dict) and all(ok.values()), ok
        assert int(out["express"]) >= 35, out  # type: ignore[call-overload]


def _not_the_same_call(rank: int) -> dict[str, object]:
    import numpy as np

    import hora as hvd

    hvd.init()
    n = hvd.size()
    total = n * (n + 1) / 2
    x = np.full(64, rank + 1.0)
    for _ in range(6):
        x[:] = rank + 1.0
        hvd.allreduce(x, op=hvd.Sum, output=x, name="x")
    seen: dict[str, object] = {}

    def step(label: str, want: float, call: object, array: object = x) -> None:
        array[...] = rank + 1.0  # type: ignore[index]
        before = _express()
        got = call()  # type: ignore[operator]
        seen[label] = (bool(np.all(got == want)), _express() - before)

    step("again", total, lambda: hvd.allreduce(x, op=hvd.Sum, output=x, name="x"))
    # the same array and name, another request: never the one remembered
    step("op", n, lambda: hvd.allreduce(x, op=hvd.Max, output=x, name="x"))
    step("prescaled", 2 * total,
         lambda: hvd.allreduce(x, op=hvd.Sum, output=x, name="x", prescale_factor=2.0))
    x.shape = (8, 8)  # reshaped in place
    step("reshaped", total, lambda: hvd.allreduce(x, op=hvd.Sum, output=x, name="x"))
    x.shape = (64,)
    for _ in range(6):  # the first request again, in direct mode again
        step("back", total, lambda: hvd.allreduce(x, op=hvd.Sum, output=x, name="x"))
    other = np.empty(64)  # another array, the same request
    step("another array", total,
         lambda: hvd.allreduce(other, op=hvd.Sum, output=other, name="x"), other)
    hvd.shutdown()
    return seen


@pytest.mark.timeout(120)
def test_a_call_that_is_not_the_same_goes_the_usual_way() -> None:
    """A call remembered by its array (hora.frameworks.repeat) is never run again with its
    request once the call makes another (another op, factor or shape); a call of another array
    that makes the same request takes the express lane through the usual submission."""
    for seen in run_ranks(_not_the_same_call, 3, timeout=90):
        assert all(right for right, _ in seen.values()), seen  # type: ignore[misc]
        taken = {k: e for k, (_, e) in seen.items()}  # type: ignore[misc]
        assert taken["again"] == 1 and taken["back"] == 1, taken
        assert taken["op"] == taken["prescaled"] == taken["reshaped"] == 0, taken
        assert taken["another array"] == 1, taken


def _others_differ(rank: int) -> dict[str, object]:
    import numpy as np

    import hora as hvd

    hvd.init()
    n = hvd.size()
    a = np.arange(50, dtype=np.float32) + rank
    b = np.full(30, rank + 1.0)
    want_a = n * np.arange(50) + n * (n - 1) / 2
    want_b = np.full(30, n * (n + 1) / 2)
    ok = []
    for _ in range(4):
        ok.append(np.array_equal(hvd.allreduce(a, op=hvd.Sum, name="a"), want_a))
    before, left = _express(), _express("express_left")
    for step in range(20):
        if rank == 1 and step % 2:  # b, then a, at once: its header is not the others'
            hb = hvd.allreduce_async(b, op=hvd.Sum, name="b")
            ok.append(np.array_equal(hvd.allreduce(a, op=hvd.Sum, name="a"), want_a))
            ok.append(np.array_equal(hvd.synchronize(hb), want_b))
        else:
            ok.append(np.array_equal(hvd.allreduce(a, op=hvd.Sum, name="a"), want_a))
            if step % 2:
                ok.append(np.array_equal(hvd.allreduce(b, op=hvd.Sum, name="b"), want_b))
    express, left = _express() - before, _express("express_left") - left
    hvd.shutdown()
    return {"ok": all(ok) and len(ok) == 34, "express": express, "left": left}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_a_round_whose_other_headers_differ_goes_on_as_any_round(np_: int) -> None:
    results = run_ranks(_others_differ, np_, timeout=90)
    for out in results:
        assert out["ok"] is True, out
    r0 = results[0]
    assert int(r0["express"]) >= 5, r0  # type: ignore[call-overload]
    # where rank 1 held b and a, rank 0's express round met its header and went on as a round
    assert int(r0["left"]) >= 1, r0  # type: ignore[call-overload]


def _mismatch(rank: int) -> dict[str, object]:
    import numpy as np

    import hora as hvd

    hvd.init()
    x = np.ones(16, np.float32)
    for _ in range(6):
        hvd.allreduce(x, op=hvd.Sum, output=x, name="m")
    express = _express()
    if rank == 1:
        x = np.ones(16, np.float64)  # the same name, another dtype
    try:
        hvd.allreduce(x, op=hvd.Sum, output=x, name="m")
        err = "completed?!"
    except Exception as e:  # noqa: BLE001 - the error is what the test reads
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "express": express}


@pytest.mark.timeout(120)
def test_a_mismatch_after_the_express_lane_raises_on_every_rank_naming_both_sides() -> None:
    for r in spawn_ranks(_mismatch, 3, timeout=60):
        assert r.ok, r.stderr
        err = str(r.value["error"])
        assert "float32" in err and "float64" in err, err
        assert int(r.value["express"]) >= 1, r.value  # type: ignore[call-overload]


def _peer_dies(rank: int, api: str) -> dict[str, object]:
    import os
    import signal
    import time

    import numpy as np

    if api == "torch":  # hora.torch.allreduce_ of a CPU tensor, through its memory's view
        import torch

        import hora.torch as hvd

        t = torch.ones(8)

        def call() -> None:
            hvd.allreduce_(t, op=hvd.Sum, name="d")
    else:
        import hora as hvd

        x = np.ones(8)

        def call() -> None:
            hvd.allreduce(x, op=hvd.Sum, output=x, name="d")

    hvd.init()
    for _ in range(6):
        call()
    express = _express()
    if rank == 1:
        time.sleep(0.5)  # the others now wait in an express round
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        call()
        err = "completed?!"
    except hvd.HorovodInternalError as e:
        err = str(e)
    return {"error": err, "seconds": time.monotonic() - t0, "express": express}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("np_", "api"), [(2, "numpy"), (3, "numpy"), (2, "torch")])
def test_a_peer_that_dies_during_an_express_round_fails_the_others_quickly(np_: int,
                                                                           api: str) -> None:
    results = spawn_ranks(_peer_dies, np_, args=(api,), timeout=60)
    assert results[1].status == "died" and results[1].returncode == -9
    for r in results[:1] + results[2:]:
        assert r.ok, r.stderr
        assert "rank 1" in str(r.value["error"]), r.value
        assert float(r.value["seconds"]) < 10, r.value
        assert int(r.value["express"]) >= 1, r.value  # type: ignore[call-overload]


def _stall(rank: int, flag: str) -> dict[str, object]:
    import os
    import time

    import numpy as np

    import hora as hvd

    hvd.init()
    x = np.ones(4)
    for _ in range(6):
        hvd.allreduce(x, op=hvd.Sum, output=x, name="s")
    express = _express()
    try:
        if rank == 0:  # the others never call again: rank 0 waits in an express round
            try:
                hvd.allreduce(x, op=hvd.Sum, output=x, name="s")
            finally:
                open(flag, "w").close()
            return {"error": "completed?!"}
        deadline = time.monotonic() + 30
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)  # asleep, not in an op, until rank 0's op is over
        return {"error": "slept"}
    except hvd.HorovodInternalError as e:
        return {"error": str(e), "express": express}
    finally:
        hvd.shutdown()


@pytest.mark.timeout(90)
def test_an_express_round_that_waits_too_long_warns_naming_its_tensor(tmp_path: object) -> None:
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    results = spawn_ranks(_stall, 3, args=(f"{tmp_path}/rank0-done",), timeout=60, env=env)
    r0 = results[0]
    assert r0.ok, r0.stderr
    err = str(r0.value["error"])
    assert "1: [allreduce.s]" in err and "2: [allreduce.s]" in err, err
    assert "STALL_SHUTDOWN" in err, err
    assert int(r0.value["express"]) >= 1, r0.value  # type: ignore[call-overload]
    for r in results[1:]:
        assert r.status in ("ok", "error"), r.stderr


def _threads(rank: int) -> dict[str, object]:
    import threading

    import numpy as np

    import hora as hvd

    hvd.init()
    n = hvd.size()
    wrong: list[str] = []

    def calls(tag: str) -> None:
        x = np.full(32, rank + 1.0)
        for i in range(200):
            x[:] = rank + 1.0
            got = hvd.allreduce(x, op=hvd.Sum, output=x, name=tag)
            if not np.all(got == n * (n + 1) / 2):
                wrong.append(f"{tag} call {i}: {got[0]}")

    threads = [threading.Thread(target=calls, args=(f"thread{k}",)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stuck = sum(t.is_alive() for t in threads)
    left = _express("express_left")
    hvd.shutdown()
    return {"wrong": wrong, "stuck": stuck, "left": left}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_threads_that_call_at_once_meet_in_any_order(np_: int) -> None:
    """Three threads each repeat a blocking allreduce of its own at once: one holds the
    engine's turn while the others' calls queue, in another order on each rank, so an express
    round may meet other headers and go on as a round; every result is right, nothing hangs."""
    for out in run_ranks(_threads, np_, timeout=90):
        assert out["wrong"] == [] and out["stuck"] == 0, out


def _init_again(rank: int) -> dict[str, object]:
    import gc
    import weakref

    import numpy as np

    import hora as hvd
    from hora.core import runtime

    x = np.full(16, rank + 1.0)
    right = []
    for _ in range(2):  # the same call before and after a shutdown and an init
        hvd.init()
        n = hvd.size()
        for _ in range(6):
            x[:] = rank + 1.0
            right.append(bool(np.all(hvd.allreduce(x, op=hvd.Sum, output=x, name="i")
                                     == n * (n + 1) / 2)))
        express = _express()
        engine = weakref.ref(runtime.runtime().engine)
        hvd.shutdown()
    gc.collect()
    # what the thread and the engine remembered keeps neither the engine nor its arena alive
    return {"right": all(right), "express": express, "engine kept": engine() is not None}


@pytest.mark.timeout(120)
def test_a_call_remembered_before_a_shutdown_goes_the_usual_way_after_an_init() -> None:
    for out in run_ranks(_init_again, 3, timeout=90):
        assert out["right"] is True and int(out["express"]) >= 1, out  # type: ignore[call-overload]
        assert out["engine kept"] is False, out


def _torch_in_place(rank: int) -> dict[str, object]:
    import gc
    import weakref

    import torch

    import hora.torch as hvd

    hvd.init()
    n = hvd.size()
    total = n * (n + 1) / 2
    seen: dict[str, object] = {}

    def step(label: str, t: torch.Tensor, times: int = 1, **kw: object) -> None:
        before, ok = _express(), True
        for _ in range(times):
            t.fill_(rank + 1.0)
            got = hvd.allreduce_(t, op=hvd.Sum, name="t", **kw)  # type: ignore[arg-type]
            ok = ok and got is t and bool(torch.all(t == total))
        seen[label] = (ok, _express() - before)

    x = torch.empty(300)
    step("first", x, 4)  # the usual way, then taken by the lane's round and remembered
    step("again", x, 10)
    w = torch.empty(300, requires_grad=True)  # autograd's leaf: reduced through a detached view
    with torch.no_grad():
        step("requires grad", w, 10)
    step("priority", x, 1, priority=1)  # another keyword: the usual way
    step("back", x, 10)
    y = torch.empty(300, 2)[:, 0]  # strided: reduced through a copy, written back
    step("strided", y, 6)
    # a tensor gone leaves nothing alive; one made at its address is another call
    gone = weakref.ref(x)
    del x
    gc.collect()
    z = torch.empty(300)
    step("new tensor", z, 10)
    seen["kept"] = (gone() is None, 0)
    # a new tensor of the same kind each call (a metric made anew each step): the same call
    before, ok = _express(), True
    for _ in range(10):
        fresh = torch.full((300,), rank + 1.0)
        ok = ok and hvd.allreduce_(fresh, op=hvd.Sum, name="t") is fresh
        ok = ok and bool(torch.all(fresh == total))
    seen["fresh each call"] = (ok, _express() - before)
    # hvd.allreduce where nothing is differentiated: a new tensor each call, the input kept
    before, ok = _express(), True
    for _ in range(10):
        fresh = torch.full((300,), rank + 1.0)
        got = hvd.allreduce(fresh, op=hvd.Sum, name="m")
        ok = (ok and got is not fresh and got.dtype == fresh.dtype and got.shape == fresh.shape
              and bool(torch.all(got == total)) and bool(torch.all(fresh == rank + 1.0)))
    seen["new result"] = (ok, _express() - before)
    # another dtype under the name: another request, the usual way
    other = torch.full((300,), rank + 1.0, dtype=torch.float64)
    got = hvd.allreduce_(other, op=hvd.Sum, name="t")
    seen["other dtype"] = (bool(torch.all(got == total)) and got.dtype == torch.float64,
                           0)  # fmt: skip
    hvd.shutdown()
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_torch_tensor_reduced_in_place_again_takes_the_express_lane(np_: int) -> None:
    """``hora.torch.allreduce_`` of the same CPU tensor with the same keywords takes the
    express lane through a view of the tensor's memory, writing the tensor itself, as does a
    new tensor of the same kind each call, and ``hvd.allreduce`` into a new tensor; another
    keyword goes the usual way, and a tensor that is not its own contiguous memory is reduced
    through a copy all the same."""
    for seen in run_ranks(_torch_in_place, np_, timeout=90):
        assert all(right for right, _ in seen.values()), seen  # type: ignore[misc]
        taken = {k: e for k, (_, e) in seen.items()}  # type: ignore[misc]
        # the first calls of a request, and the first after another, go the usual way
        assert taken["again"] == 10 and taken["requires grad"] == 10, taken
        assert taken["back"] >= 5 and taken["new tensor"] >= 5, taken
        # (a call that finds the engine's thread in its turn goes the usual way: not every one)
        assert taken["fresh each call"] >= 5 and taken["new result"] >= 5, taken
        assert taken["priority"] == 0, taken
