"""The shared-memory pair between real processes: framing, both payload paths (single copy and
staged), reducing receives, errors, a killed peer, and hora's collectives over it."""

from __future__ import annotations

from typing import Any

import pytest

from harness import run_ranks, spawn_ranks

MODES = pytest.mark.parametrize("single_copy", [True, False], ids=["single-copy", "staged"])


def _transport(rank: int, single_copy: bool = True, secret: bytes | None = None) -> Any:
    import os

    from hora.transport.shm import ShmTransport

    key = secret or bytes.fromhex(os.environ["HORA_SECRET_KEY"])
    size = int(os.environ["HORA_SIZE"])
    return ShmTransport(rank, size, key, "test/0", connect_timeout=20, single_copy=single_copy)


def _hora_in_dev_shm() -> list[str]:
    import os

    return sorted(n for n in os.listdir("/dev/shm") if "hora" in n.lower())


def _exchange(rank: int, single_copy: bool) -> dict[str, Any]:
    import threading
    import time
    import weakref

    import numpy as np

    from hora.transport.shm.frames import EAGER_LIMIT
    from hora.transport.shm.staging import SLOT_BYTES, SLOTS

    t = _transport(rank, single_copy)
    pair = t.pair(1 - rank)
    sizes = [0, 1, 1000, EAGER_LIMIT, EAGER_LIMIT + 8, SLOT_BYTES * SLOTS * 2 + 24, 5 << 20]
    out: dict[str, Any] = {"repr": repr(pair), "ok": []}

    def data(n: int, who: int) -> np.ndarray:
        return ((np.arange(n, dtype=np.int64) * 7 + who) % 251).astype(np.uint8)

    for n in sizes:
        mine, theirs = data(n, rank), data(n, 1 - rank)
        got = np.empty(n, np.uint8)
        work = pair.isend(memoryview(mine))  # isend, then a blocking receive
        pair.recv_into(memoryview(got))
        work.wait()
        same = bool(np.array_equal(got, theirs))
        got[:] = 0
        posted = pair.irecv(memoryview(got))  # irecv posted first, then isend
        work = pair.isend(memoryview(mine))
        posted.wait()
        work.wait()
        out["ok"].append((n, same and bool(np.array_equal(got, theirs))))
    for dtype in ("float32", "float64", "int8"):  # reducing receives, odd lengths
        for count in (3, 70_001, 1_500_007):
            mine = (np.arange(count) % 11 + rank).astype(dtype)
            acc = (np.arange(count) % 5).astype(dtype)
            work = pair.isend(memoryview(mine))
            pair.recv_reduce(acc, lambda a, b: np.add(a, b, out=a), np.empty(1 << 18, np.uint8))
            work.wait()
            want = (np.arange(count) % 5).astype(dtype) + (np.arange(count) % 11 + 1 - rank)
            out["ok"].append((f"reduce {dtype} {count}", bool(np.array_equal(acc, want))))
    for count in (10, 70_001, 1_500_007):  # gathered sends, scattered and reducing receives
        cuts = sorted([0, 3, count // 3, count // 3, count // 2 + 7])  # with an empty part
        mine = (np.arange(count) % 13 + rank).astype(np.float32)
        parts = [p.copy() for p in np.split(mine, cuts)]  # separate buffers
        into = [np.empty_like(p) for p in np.split(mine, cuts[::2])]
        work = pair.isend_parts([memoryview(p) for p in parts])
        pair.recv_parts_into([memoryview(p) for p in into])
        work.wait()
        theirs = (np.arange(count) % 13 + 1 - rank).astype(np.float32)
        ok = bool(np.array_equal(np.concatenate(into), theirs))
        acc = [np.ones_like(p) for p in np.split(mine, cuts[1::2])]
        work = pair.isend_parts([memoryview(p) for p in parts])
        pair.recv_reduce_parts(acc, lambda a, b: np.add(a, b, out=a), np.empty(0, np.uint8))
        work.wait()
        ok = ok and bool(np.array_equal(np.concatenate(acc), theirs + 1))
        out["ok"].append((f"parts {count}", ok))
    many = [np.full(3, i % 250 + rank, np.uint8) for i in range(1500)]  # more than IOV_MAX
    into = [np.empty(4500, np.uint8)]
    work = pair.isend_parts([memoryview(p) for p in many])
    pair.recv_parts_into([memoryview(p) for p in into])
    work.wait()
    want = np.repeat(np.arange(1500) % 250 + 1 - rank, 3).astype(np.uint8)
    out["ok"].append(("1500 parts inline", bool(np.array_equal(into[0], want))))
    # a finished transfer's buffer is let go (by the acknowledgement thread on the single-copy
    # path, the send lane on the staged one); closing (below) ends every thread of the pair
    big = np.full(5 << 20, rank, np.uint8)
    ref = weakref.ref(big)
    work = pair.isend(memoryview(big))
    pair.recv_into(memoryview(np.empty_like(big)))
    work.wait()
    del big, work
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    out["buffer_let_go"] = ref() is None
    pair.send_msg(b"message from %d" % rank)  # messages and data frames keep their order
    pair.send(b"x" * 10)
    out["msg"] = pair.recv_msg()
    tail = bytearray(10)
    pair.recv_into(tail)
    out["tail"] = bytes(tail)
    with open("/proc/self/maps") as f:
        maps = f.read()
    out["memfd_mapped"] = "memfd:hora-staging" in maps
    out["dev_shm"] = _hora_in_dev_shm()
    t.close()
    pair_threads = ("hora-shm-send", "hora-shm-recv", "hora-shm-ack")
    out["threads_left"] = [
        th.name for th in threading.enumerate() if th.name.startswith(pair_threads)
    ]
    return out


@pytest.mark.timeout(120)
@MODES
def test_frames_of_every_size_arrive_whole_and_in_order(single_copy: bool) -> None:
    results = run_ranks(_exchange, 2, args=(single_copy,), timeout=100)
    for rank, out in enumerate(results):
        assert ("single-copy" if single_copy else "staged") in out["repr"], out["repr"]
        bad = [what for what, ok in out["ok"] if not ok]
        assert not bad, f"rank {rank}: wrong data for {bad}"
        assert out["msg"] == b"message from %d" % (1 - rank)
        assert out["tail"] == b"x" * 10
        # the staging area is an anonymous memfd: mapped, yet never a file in /dev/shm
        assert out["memfd_mapped"] is (not single_copy)
        assert out["dev_shm"] == []
        assert out["buffer_let_go"], f"rank {rank}: a pair thread still holds a sent buffer"
        assert out["threads_left"] == [], f"rank {rank}: pair threads left after close"


def _mismatch(rank: int, single_copy: bool, size: int) -> str:
    import contextlib

    from hora.errors import TransportError

    t = _transport(rank, single_copy)
    pair = t.pair(1 - rank)
    if rank == 0:
        pair.isend(b"\1" * size)
        with contextlib.suppress(TransportError):
            pair.recv_into(bytearray(1))  # until rank 1 drops the pair
        return "sent"
    try:
        pair.recv_into(bytearray(size // 2))
        return "accepted a frame of the wrong length"
    except TransportError as e:
        first = str(e)
    try:
        pair.recv_into(bytearray(1))
        return "the pair stayed open"
    except TransportError:
        return first


@pytest.mark.timeout(90)
@MODES
@pytest.mark.parametrize("size", [1000, 3 << 20], ids=["inline", "bulk"])
def test_a_frame_of_the_wrong_length_fails_and_closes_the_pair(
    single_copy: bool, size: int
) -> None:
    out = run_ranks(_mismatch, 2, args=(single_copy, size), timeout=60)[1]
    assert "malformed frame from rank 0" in out, out
    assert f"{size // 2} bytes" in out, out


def _killed(rank: int, single_copy: bool, blocked_in: str) -> str:
    import os
    import signal

    import numpy as np

    from hora.errors import TransportError

    t = _transport(rank, single_copy)
    pair = t.pair(1 - rank)
    pair.send(b"ready")  # both sides connected
    pair.recv_into(bytearray(5))
    if rank == 1:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        signal.pause()  # killed meanwhile, taking nothing from the pair
    try:
        if blocked_in == "recv":
            pair.recv_into(bytearray(8))
        else:  # a bulk send that the peer never takes
            pair.isend(np.ones(16 << 20, np.uint8)).wait()  # more than the staging area
        return "no error"
    except TransportError as e:
        return str(e)


@pytest.mark.timeout(90)
@MODES
@pytest.mark.parametrize("blocked_in", ["recv", "send"])
def test_a_killed_peer_fails_blocked_operations(single_copy: bool, blocked_in: str) -> None:
    results = spawn_ranks(_killed, 2, args=(single_copy, blocked_in), timeout=60)
    assert results[1].status == "died" and results[1].returncode == -9
    assert results[0].ok, results[0].stderr
    assert "rank 1" in results[0].value and "killed" in results[0].value, results[0].value


def _stranger(rank: int) -> str:
    import os
    import socket

    from hora.errors import AuthenticationError
    from hora.transport.shm.transport import socket_name
    from hora.transport.tcp.auth import connect_handshake

    t = _transport(rank)
    pair = t.pair(1 - rank)
    got = bytearray(1)
    pair.send(b"%d" % rank)
    pair.recv_into(got)
    if rank == 1:  # knock on rank 0's socket: garbage, then a handshake with the wrong secret
        name = socket_name(bytes.fromhex(os.environ["HORA_SECRET_KEY"]), "test/0", 0)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(name)
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(name)
            try:
                connect_handshake(s, b"not the job secret", b"hora-shm/1\0")
                return "a stranger got in"
            except AuthenticationError:
                pass
    pair.send(b"%d" % rank)  # the job goes on
    pair.recv_into(got)
    if rank == 0:
        pair.recv_into(got)  # rank 1 is done knocking
    else:
        pair.send(b"k")
    return got.decode()


@pytest.mark.timeout(60)
def test_a_connection_without_the_secret_is_dropped_and_the_job_goes_on() -> None:
    results = spawn_ranks(_stranger, 2, timeout=40)
    assert [r.value for r in results] == ["k", "0"], results
    assert results[0].stderr.count("dropped a shared-memory connection") == 2, results[0].stderr


def _close_wakes(rank: int) -> str:
    import threading

    from hora.errors import TransportError

    t = _transport(rank)
    pair = t.pair(1 - rank)
    pair.send(b"r")
    pair.recv_into(bytearray(1))
    if rank == 1:
        pair.recv_into(bytearray(1))  # rank 0 closes without sending: EOF
        return "eof seen"
    threading.Timer(0.2, t.close).start()
    try:
        pair.recv_into(bytearray(4))
        return "no error"
    except TransportError as e:
        return str(e)


@pytest.mark.timeout(60)
def test_close_wakes_a_blocked_receive() -> None:
    results = spawn_ranks(_close_wakes, 2, timeout=40)
    assert results[0].ok and "closed by this rank" in results[0].value, results[0]
    assert not results[1].ok and "rank 0" in str(results[1].value), results[1]


def _write_back(rank: int, single_copy: bool) -> dict[str, Any]:
    import numpy as np

    from hora.collectives.hierarchical import _allreduce_pair
    from hora.transport.shm.frames import WRITE_BACK_MIN

    t = _transport(rank, single_copy)
    pair = t.pair(1 - rank)
    add = lambda a, b, out=None: np.add(a, b, out=a if out is None else out)  # noqa: E731
    scratch = np.empty(1 << 18, np.uint8)
    out: dict[str, Any] = {"ok": [], "back": []}
    # each rank sends the block the peer owns and folds the peer's block into its own; then
    # into separate buffers (WRITE_APART over single copy), the inputs only read
    cases = [(c, False) for c in (WRITE_BACK_MIN // 4, WRITE_BACK_MIN // 4 + 1, 1_500_007)]
    for count, apart in cases + [(WRITE_BACK_MIN // 4, True), (1_500_007, True)]:
        theirs = (np.arange(count) % 7 + rank).astype(np.float32)
        mine = (np.arange(count) % 5 + 10 * rank).astype(np.float32)
        theirs_in, mine_in = theirs.copy(), mine.copy()
        if apart:
            theirs, mine = np.zeros_like(theirs), np.zeros_like(mine)
            work, back = pair.isend_reduce([memoryview(theirs_in)], memoryview(theirs))
            wrote = pair.recv_reduce_parts([mine], add, scratch, [mine_in])
        else:
            work, back = pair.isend_reduce([memoryview(theirs)])
            wrote = pair.recv_reduce(mine, add, scratch)
        answer = None if wrote else pair.isend(memoryview(mine))
        if not back:  # a plain frame: the owner answers with its reduced block
            pair.recv_into(memoryview(theirs))
        for w in (work, answer):
            if w is not None:
                w.wait()
        sums = [(np.arange(count) % 5 + 10 * r + np.arange(count) % 7 + 1 - r) for r in (0, 1)]
        ok = np.array_equal(mine, sums[rank]) and np.array_equal(theirs, sums[1 - rank])
        if apart:  # the inputs as they were
            ok = ok and np.array_equal(theirs_in, np.arange(count) % 7 + rank)
            ok = ok and np.array_equal(mine_in, np.arange(count) % 5 + 10 * rank)
        out["ok"].append((f"{'apart' if apart else 'block'} {count}", bool(ok)))
        out["back"].append((count, back, wrote))
    # blocks of different sizes: rank 1's (large) is written back, rank 0's (inline) is
    # answered; each side learns which from the frame kinds, over parts and single buffers
    sizes = (1000, 900_001)
    full = [(np.arange(sum(sizes)) % 9 + r).astype(np.float64) for r in (0, 1)]
    blocks = [np.split(f, [sizes[0]]) for f in full]  # blocks[rank][owner]
    cut = [0, 5, sizes[1] // 2, sizes[1] // 2]  # rank 1's block in parts, one of them empty
    mine = [blocks[rank][rank].copy()] if rank == 0 else np.split(blocks[1][1], cut)
    theirs = np.split(blocks[0][1], cut) if rank == 0 else [blocks[1][0].copy()]
    mine, theirs = [p.copy() for p in mine], [p.copy() for p in theirs]
    _allreduce_pair(pair, theirs, mine, add, scratch)
    want = np.split((np.arange(sum(sizes)) % 9) * 2 + 1.0, [sizes[0]])
    ok = np.array_equal(np.concatenate(mine), want[rank])
    ok = ok and np.array_equal(np.concatenate(theirs), want[1 - rank])
    out["ok"].append(("mixed", bool(ok)))
    t.close()
    return out


@pytest.mark.timeout(120)
@MODES
def test_reduced_blocks_are_written_back_into_the_senders_buffer(single_copy: bool) -> None:
    """``isend_reduce``: over single copy, the peer writes each reduced piece back into the
    sender's buffer (no second phase); inline and staged frames fall back to a plain frame
    answered with the reduced block, and the two kinds mix within one allreduce."""
    from hora.transport.shm.frames import WRITE_BACK_MIN

    results = run_ranks(_write_back, 2, args=(single_copy,), timeout=100)
    for rank, out in enumerate(results):
        bad = [what for what, ok in out["ok"] if not ok]
        assert not bad, f"rank {rank}: wrong data for {bad}"
        for count, back, wrote in out["back"]:
            large = count * 4 > WRITE_BACK_MIN
            assert back == wrote == (single_copy and large), (rank, count, back, wrote)


def _collectives(rank: int, single_copy: bool) -> dict[str, bool]:
    import numpy as np

    from hora.collectives import hierarchical, registry
    from hora.collectives.base import GroupComm
    from hora.collectives.reduce_ops import MAX, SUM, reducer

    t = _transport(rank, single_copy)
    comm = GroupComm(t)
    n = comm.size
    out: dict[str, bool] = {}
    for count in (5, 40_000, 1_000_003):
        base = np.arange(count, dtype=np.float64) % 17
        for name, op, want in (("sum", SUM, base * n + sum(range(n))), ("max", MAX, base + n - 1)):
            buf = base + rank
            registry.allreduce(comm, buf, "float64", op)
            out[f"allreduce {name} {count}"] = bool(np.array_equal(buf, want))
            buf = base + rank
            hierarchical.allreduce_direct(comm, buf, reducer(op, "float64"))
            out[f"direct {name} {count}"] = bool(np.array_equal(buf, want))
            src = base + rank  # into a separate output, the input only read
            res = np.full_like(src, -1.0)
            hierarchical.allreduce_direct(comm, src, reducer(op, "float64"), out=res)
            kept = np.array_equal(src, base + rank)
            out[f"direct apart {name} {count}"] = bool(np.array_equal(res, want) and kept)
            parts = np.split(base + rank, sorted([0, 3, count // 3, count // 3, count // 2 + 1]))
            parts = [p.copy() for p in parts]  # separate buffers, one of them empty
            hierarchical.allreduce_direct(comm, parts, reducer(op, "float64"))
            out[f"direct parts {name} {count}"] = bool(np.array_equal(np.concatenate(parts), want))
        counts = [count // 3 + r for r in range(n)]
        recv = np.empty(sum(counts), np.int32)
        registry.allgatherv_ring(comm, np.full(counts[rank], rank, np.int32), recv, counts)
        out[f"allgather {count}"] = bool(np.array_equal(recv, np.repeat(np.arange(n), counts)))
        buf = np.full(count, rank, np.float32)
        registry.broadcast_tree(comm, buf, 1)
        out[f"broadcast {count}"] = bool((buf == 1).all())
        send = np.concatenate([np.full(count // 4 + r, rank, np.int64) for r in range(n)])
        sends = [count // 4 + r for r in range(n)]
        recvs = [count // 4 + rank] * n
        got = np.empty(sum(recvs), np.int64)
        registry.alltoallv_pairwise(comm, send, sends, got, recvs)
        out[f"alltoall {count}"] = bool(np.array_equal(got, np.repeat(np.arange(n), recvs)))
    registry.barrier(comm)
    t.close()
    return out


@pytest.mark.timeout(150)
@MODES
@pytest.mark.parametrize("size", [2, 3])
def test_hora_collectives_run_over_shared_memory_pairs(single_copy: bool, size: int) -> None:
    """At 2 ranks the direct allreduce runs in one round (written back over single copy)."""
    for rank, out in enumerate(run_ranks(_collectives, size, args=(single_copy,), timeout=120)):
        bad = [k for k, ok in out.items() if not ok]
        assert not bad, f"rank {rank}: wrong results for {bad}"


def test_a_pulled_piece_lands_at_its_sources_offset_in_a_page() -> None:
    """A reducing receive pulls each piece into scratch at the sender's offset in a 4 KiB
    page (to an element), so the copy never stalls on 4K aliasing."""
    import numpy as np

    from hora.transport.shm.fold import beside as _beside
    from hora.transport.shm.frames import EAGER_LIMIT, REDUCE_CHUNK

    scratch = np.empty(max(REDUCE_CHUNK + 4096, EAGER_LIMIT), np.uint8)  # as recv_reduce has
    base = scratch.ctypes.data
    for addr in (base, base + 16, base + 4095 * 4, 0x7F0000000000, 0x7F0000000010 + 3):
        for per in (1, 2, 4, 8):
            piece = _beside(scratch, addr, per)
            lag = (addr - piece.ctypes.data) % 4096
            assert lag == (addr - base) % 4096 % per, (addr, per)
            assert piece.nbytes >= REDUCE_CHUNK


def test_only_the_data_channel_travels_over_shared_memory() -> None:
    import secrets

    from hora.transport.base import CONTROL
    from hora.transport.shm import ShmTransport

    with ShmTransport(0, 2, secrets.token_bytes(16), "test/unit") as t:
        with pytest.raises(ValueError, match="DATA channel"):
            t.pair(1, CONTROL)
        with pytest.raises(ValueError, match="another rank"):
            t.pair(0)
    with pytest.raises(ValueError, match="outside"):
        ShmTransport(2, 2, b"k", "test/unit")


def test_a_pulled_frame_is_cut_into_steps_of_pieces_contiguous_on_both_sides() -> None:
    """How a reducing receive walks a gathered frame: steps of ``step`` bytes (the last one
    shorter), each a list of pieces that never cross a part boundary on either side, covering
    every byte once and in order."""
    from hora.transport.shm.cma import matched, steps

    local = [(1000, 24), (5000, 8), (9000, 40)]  # three parts here, 72 bytes
    remote = [(100, 16), (300, 56)]  # two parts in the sender, the same 72 bytes
    cut = list(steps(local, remote, 32))
    assert [sum(n for *_, n in s) for s in cut] == [32, 32, 8]
    pieces = [p for s in cut for p in s]
    assert pieces == [
        (0, 0, 100, 16),  # local part 0 and remote part 0 both start here
        (0, 16, 300, 8),  # local part 0 goes on; remote part 1 starts
        (1, 0, 308, 8),  # the first step ends with local part 1
        (2, 0, 316, 32),  # local part 2 spans two steps
        (2, 32, 348, 8),
    ]
    # matched: the same walk in one step, as (local address, remote address, bytes)
    assert matched(local, remote) == [
        (1000, 100, 16),
        (1016, 300, 8),
        (5000, 308, 8),
        (9000, 316, 40),
    ]
