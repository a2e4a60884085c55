"""ShmPair: the Pair contract (transport/base.py) between two ranks of one host.

Each pair has two Unix stream sockets, one per direction. On the socket of a direction the
sender writes frames (a 24-byte header, then for small payloads the payload) and reads one
acknowledgement byte per bulk frame; the receiver reads frames and writes acknowledgements.
A payload of at most ``EAGER_LIMIT`` bytes travels inside the socket. A larger one travels in
one of two ways, chosen per direction when the pair was made:

* **single copy** (``PULL`` frame): the header carries the address of the sender's buffer and
  the receiver copies straight out of it with ``process_vm_readv``, then acknowledges; the
  sender's ``isend`` is done at that acknowledgement.
* **staged** (``STAGED`` frames): the sender copies the payload, slot by slot, into a
  shared-memory staging area (:mod:`~hora.transport.shm.staging`); the receiver copies each
  slot out and acknowledges it, which frees the slot. ``isend`` is done once the last slot is
  written.

:meth:`ShmPair.recv_reduce` receives a frame and reduces it into a typed buffer in the same
pass (cache-sized pieces of a pulled payload, or straight out of a staging slot), which saves
a whole copy against ``recv_into`` followed by a reduction. A single-copy frame sent with
:meth:`ShmPair.isend_reduce` carries ``WRITE_BACK``: the receiver reduces it into its own block
and writes each reduced piece back over the sender's buffer (``process_vm_writev``) before it
acknowledges, so a two-rank allreduce needs no second phase.

Threads: the engine thread issues the operations. Like the TCP pair, ``irecv`` and any send
that cannot finish at once run on two daemon lane threads of the pair (FIFO, so order holds); a
third daemon thread reads acknowledgements. A dead peer closes its sockets, so every waiting
operation fails at once. ``close`` is safe from any thread.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from hora.errors import TransportError
from hora.transport import tally
from hora.transport.base import MAX_MESSAGE, Buffer
from hora.transport.lanes import Completion, Lane, join_thread
from hora.transport.shm import cma
from hora.transport.shm.fold import (
    Fold,
    Reduce,
    beside,
    fold_into,
    fold_piece,
    offsets_of_parts,
    ranges,
)
from hora.transport.shm.frames import (
    ACK,
    DEST,
    EAGER,
    EAGER_LIMIT,
    HEADER,
    KIND_NAMES,
    MAX_SPANS,
    MSG,
    PULL,
    PULLV,
    REDUCE_CHUNK,
    SPAN,
    STAGED,
    WRITE_APART,
    WRITE_BACK,
    WRITE_BACK_MIN,
    as_bytes,
    inline_frame,
    tally_frame,
)
from hora.transport.shm.staging import SLOT_BYTES, SLOTS, Staging
from hora.transport.shm.waiting import poll_yielding, waiting_spin
from hora.transport.tcp.pair import byte_view
from hora.transport.tcp.wire import hard_close, recv_exact, recv_exact_into

_DONE = Completion(done=True)  # shared by every isend that completed at once


def _views(bufs: Sequence[Buffer], writable: bool = False) -> list[memoryview]:
    """Flat byte views of the non-empty ``bufs``."""
    return [v for v in (byte_view(b, writable=writable) for b in bufs) if v.nbytes]


@dataclass
class Link:
    """One direction of a pair, as agreed when the pair was made."""

    sock: socket.socket
    single_copy: bool  # the receiver reads the sender's memory (else: staging)
    staging: Staging | None = None
    pid: int = 0  # on the receiving side: the sender's pid, for single-copy reads


class ShmPair:
    """This rank's DATA connection to rank ``peer`` on the same host."""

    def __init__(self, peer: int, out: Link, inn: Link) -> None:
        self.peer = peer
        self._out = out
        self._in = inn
        self._what = f"rank {peer} (shared memory)"
        self._header = bytearray(HEADER.size)
        self._lock = threading.Condition()  # guards the fields below
        self._closed = False
        self._error: TransportError | None = None
        self._unacked: deque[tuple[Completion | None, object]] = deque()  # frame order
        self._free_slots = SLOTS
        self._next_slot = 0
        self._acker: threading.Thread | None = None
        self._out_gone = False  # the peer closed its end while owing no acknowledgement
        self._sender = Lane(f"hora-shm-send-{peer}", self._closed_error)
        self._receiver = Lane(f"hora-shm-recv-{peer}", self._closed_error)

    def __repr__(self) -> str:
        mode = "single-copy" if self._out.single_copy else "staged"
        return f"ShmPair({self._what}, {mode}, {'closed' if self._closed else 'open'})"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def single_copy(self) -> bool:
        """Whether both directions read the sender's memory (else one of them is staged)."""
        return self._out.single_copy and self._in.single_copy

    # -- sending (engine thread, or the send lane) -------------------------------------------

    def send(self, buf: Buffer) -> None:
        views = _views([buf])
        self._sender.drain()
        self._send_blocking(views)

    def isend(self, buf: Buffer) -> Completion:
        return self.isend_parts([buf])

    def isend_parts(self, bufs: Sequence[Buffer]) -> Completion:
        """Send the concatenation of ``bufs`` as one data frame. On the single-copy path nothing
        is copied: the receiver reads every part where it lies (a gather)."""
        views = _views(bufs)
        total = sum(v.nbytes for v in views)
        if self._closed or not self._sender.idle():
            return self._sender.submit(partial(self._send_blocking, views))
        if total <= EAGER_LIMIT:
            tally_frame(tally.INLINE, tally.SENT, total, total)
            return self._write_soon(inline_frame(total, views))
        if self._out.single_copy:
            tally_frame(tally.SINGLE_COPY, tally.SENT, total, 0)
            return self._pulled(views)
        return self._sender.submit(partial(self._send_blocking, views))

    def _pulled(
        self, views: list[memoryview], flags: int = 0, dest: memoryview | None = None
    ) -> Completion:
        """Announce a single-copy frame; its Work is done at the peer's acknowledgement."""
        try:
            acked, head = self._announce(views, flags, dest)
        except TransportError as e:
            return Completion(e)
        written = self._write_soon(head, then=acked.wait)
        return acked if written.done() else written

    def isend_reduce(
        self, bufs: Sequence[Buffer], into: Buffer | None = None
    ) -> tuple[Completion, bool]:
        """Send ``bufs`` (as :meth:`isend_parts`) for the peer to reduce into its own block.

        When the second value is True the frame is single-copy with ``WRITE_BACK``: the peer
        reads the parts, reduces them into its block and writes the reduced values back into
        ``bufs`` (with ``into``, a writable buffer of their size, into ``into`` instead:
        ``WRITE_APART``, one part only; ``bufs`` stay as they are), all before the Completion
        is done, so the caller need not receive the result. False: a plain frame, and the peer
        sends the result back as usual. Only buffers larger than ``WRITE_BACK_MIN`` on an idle
        single-copy link go back this way.
        """
        views = _views(bufs)
        total = sum(v.nbytes for v in views)
        dest = None if into is None else byte_view(into, writable=True)
        if (
            self._closed
            or not self._out.single_copy
            or total <= WRITE_BACK_MIN
            or not self._sender.idle()
            or (dest is None and any(v.readonly for v in views))
            or (dest is not None and (len(views) != 1 or dest.nbytes != total))
        ):
            return self.isend_parts(views), False
        tally_frame(tally.SINGLE_COPY, tally.SENT, total, 0)  # the peer reads it, then writes
        tally_frame(tally.SINGLE_COPY, tally.RECEIVED, total, 0)  # the result back into it
        return self._pulled(views, WRITE_BACK if dest is None else WRITE_APART, dest), True

    def send_msg(self, payload: bytes) -> None:
        view = byte_view(payload)
        if view.nbytes > MAX_MESSAGE:
            raise ValueError(f"message of {view.nbytes} bytes exceeds MAX_MESSAGE={MAX_MESSAGE}")
        self._sender.drain()
        self._write([HEADER.pack(MSG, 0, 0, view.nbytes, 0), view])

    def _send_blocking(self, views: list[memoryview]) -> None:
        """Send one data frame on this thread; return when the sender's buffers are free."""
        total = sum(v.nbytes for v in views)
        if total <= EAGER_LIMIT:
            tally_frame(tally.INLINE, tally.SENT, total, total)
            self._write(inline_frame(total, views))
        elif self._out.single_copy:
            tally_frame(tally.SINGLE_COPY, tally.SENT, total, 0)
            acked, head = self._announce(views)
            self._write(head)
            acked.wait()
        else:
            tally_frame(tally.STAGED, tally.SENT, total, total)
            staging = self._out.staging
            assert staging is not None
            offsets = offsets_of_parts([v.nbytes for v in views])
            for start in range(0, total, SLOT_BYTES):
                chunk = min(SLOT_BYTES, total - start)
                slot = self._take_slot()
                dst = staging.slot(slot, chunk)
                at = 0
                for i, off, n in ranges(offsets, start, chunk):
                    dst[at : at + n] = np.frombuffer(views[i], np.uint8, n, off)
                    at += n
                self._write([HEADER.pack(STAGED, slot, chunk, total, 0)])

    def _write_soon(
        self, parts: list[bytes | memoryview], then: Callable[[], None] | None = None
    ) -> Completion:
        """Write what the socket takes now; the send lane writes the rest, then runs ``then``."""
        size = sum(memoryview(p).nbytes for p in parts)
        try:
            sent = self._out.sock.sendmsg(parts, (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            return Completion(self._fail(e))
        if sent == size:
            return _DONE
        return self._sender.submit(partial(self._write, parts, sent, then))

    def _write(
        self, parts: list[bytes | memoryview], skip: int = 0, then: Callable[[], None] | None = None
    ) -> None:
        if self._closed:
            raise self._closed_error()
        try:
            if not skip:  # one system call for a whole small frame (one wake-up of the peer)
                skip = self._out.sock.sendmsg(parts)
            for part in parts:
                part = memoryview(part).cast("B")
                if skip >= part.nbytes:
                    skip -= part.nbytes
                    continue
                self._out.sock.sendall(part[skip:])
                skip = 0
        except OSError as e:
            raise self._fail(e) from e
        if then is not None:
            then()

    # -- acknowledgements (the ack thread) ----------------------------------------------------

    def _announce(
        self, views: list[memoryview], flags: int = 0, dest: memoryview | None = None
    ) -> tuple[Completion, list[bytes | memoryview]]:
        """Register a single-copy frame of ``views``: its Work (done when acknowledged), and
        what to write (the header, then for several parts their addresses and lengths, or for
        ``WRITE_APART`` the address of ``dest``)."""
        work = Completion()
        self._expect_ack(work, (views, dest))
        total = sum(v.nbytes for v in views)
        if len(views) == 1:
            head = HEADER.pack(PULL, flags, 0, total, cma.address(views[0]))
            if dest is None:
                return work, [head]
            return work, [head + DEST.pack(cma.address(dest))]
        spans = b"".join(SPAN.pack(cma.address(v), v.nbytes) for v in views)
        return work, [HEADER.pack(PULLV, flags, len(views), total, 0), spans]

    def _expect_ack(self, work: Completion | None, keep: object = None) -> None:
        """Register a frame the peer will acknowledge, before it is written: a single-copy
        frame (its Work, and its buffer kept alive until then) or a staging slot (None)."""
        with self._lock:
            gone = self._out_gone
            if not self._closed and not gone:
                self._unacked.append((work, keep))
                if self._acker is None:
                    self._acker = threading.Thread(
                        target=self._ack_loop, name=f"hora-shm-ack-{self.peer}", daemon=True
                    )
                    self._acker.start()
                return
        raise self._fail(EOFError()) if gone else self._closed_error()

    def _take_slot(self) -> int:
        """Wait for a free staging slot and claim it; raises once the pair is closed."""
        slot = -1
        with self._lock:
            while self._free_slots == 0 and not self._closed and not self._out_gone:
                self._lock.wait()
            if self._free_slots > 0:
                self._free_slots -= 1
                slot = self._next_slot
                self._next_slot = (slot + 1) % SLOTS
        self._expect_ack(None)  # raises if the wait ended without a slot
        return slot

    def _ack_loop(self) -> None:
        buf = bytearray(256)
        while True:
            reason: BaseException = EOFError()
            try:
                got = self._out.sock.recv_into(buf)
            except OSError as e:
                got, reason = 0, e
            if got == 0:
                with self._lock:  # a peer that closed owing nothing is no failure yet
                    self._out_gone = not self._unacked
                    if self._out_gone:
                        return
                self._fail(reason)
                return
            done = []
            with self._lock:
                if got > len(self._unacked) or buf[:got].count(ACK) != got:
                    problem = "an unexpected acknowledgement"
                else:
                    problem = ""
                    for _ in range(got):
                        work = self._unacked.popleft()[0]  # its buffer is let go here
                        if work is None:
                            self._free_slots += 1
                        else:
                            done.append(work)
                    self._lock.notify_all()
            if problem:
                self._fail(f"malformed frame from {self._what}: {problem}")
                return
            for work in done:
                work.finish()

    # -- receiving (engine thread, or the receive lane) ---------------------------------------

    def recv_into(self, buf: memoryview | bytearray) -> None:
        self.recv_parts_into([buf])

    def recv_parts_into(self, bufs: Sequence[memoryview | bytearray]) -> None:
        """Receive one data frame into the concatenation of ``bufs`` (a scatter)."""
        views = _views(bufs, writable=True)
        self._receiver.drain()
        self._recv(views, None)

    def irecv(self, buf: memoryview | bytearray) -> Completion:
        views = _views([buf], writable=True)
        return self._receiver.submit(partial(self._recv, views, None))

    def recv_reduce(self, buf: np.ndarray, reduce: Reduce, scratch: np.ndarray) -> bool:
        """Receive one data frame of ``buf.nbytes`` and fold it in: ``reduce(buf, frame)``.

        ``buf`` is a 1-D C-contiguous typed array; ``scratch`` (any dtype, C-contiguous) holds
        pieces of the frame when it has ``REDUCE_CHUNK`` bytes, else scratch is allocated.
        Returns True when the frame was a :meth:`isend_reduce` write-back frame: the reduced
        values are then already in the sender's buffer, piece by piece as they were made.
        """
        return self.recv_reduce_parts([buf], reduce, scratch)

    def recv_reduce_parts(
        self,
        parts: Sequence[np.ndarray],
        reduce: Reduce,
        scratch: np.ndarray,
        sources: Sequence[np.ndarray] | None = None,
    ) -> bool:
        """:meth:`recv_reduce` into the concatenation of ``parts`` (1-D, one dtype); with
        ``sources`` (one per part, of its size), each part gets ``source (op) frame`` and its
        own values are not read (an out-of-place reduction, in the same pass)."""
        if scratch.nbytes < max(REDUCE_CHUNK + 4096, EAGER_LIMIT):
            scratch = np.empty(max(REDUCE_CHUNK + 4096, EAGER_LIMIT), np.uint8)
        tmp = scratch.reshape(-1).view(np.uint8)
        keep = [i for i, p in enumerate(parts) if p.size]
        arrays = [parts[i] for i in keep]
        froms = None if sources is None else [sources[i] for i in keep]
        self._receiver.drain()
        return self._recv([as_bytes(a) for a in arrays], (arrays, reduce, tmp, froms))

    def recv_msg(self) -> bytes:
        self._receiver.drain()
        kind, _, _, total, _ = self._read_header()
        if kind != MSG or total > MAX_MESSAGE:
            raise self._malformed(f"expected a message, got {KIND_NAMES.get(kind, kind)}")
        try:
            return recv_exact(self._in.sock, total)
        except (OSError, EOFError) as e:
            raise self._fail(e) from e

    def _recv(self, views: list[memoryview], fold: Fold | None) -> bool:
        """Receive one data frame into ``views`` (or fold it in); True if it was written back."""
        mine = sum(v.nbytes for v in views)
        kind, slot, chunk, total, addr = self._read_header()
        if kind not in (EAGER, PULL, PULLV, STAGED) or total != mine:
            got = KIND_NAMES.get(kind, kind)
            raise self._malformed(f"expected {mine} bytes of data, got {got} of {total}")
        back = kind in (PULL, PULLV) and slot in (WRITE_BACK, WRITE_APART)
        if back and fold is None:
            raise self._malformed("a frame to reduce and write back arrived at a plain receive")
        shift = 0  # from the sender's input to where its result goes
        if back and slot == WRITE_APART:
            if kind != PULL:
                raise self._malformed("a gathered frame to write apart")
            raw = bytearray(DEST.size)
            self._read_exact(memoryview(raw))
            shift = DEST.unpack(raw)[0] - addr
        offsets = offsets_of_parts([v.nbytes for v in views])
        path = {EAGER: tally.INLINE, STAGED: tally.STAGED}.get(kind, tally.SINGLE_COPY)
        tally_frame(path, tally.RECEIVED, total, 0 if kind == STAGED and fold else total)
        if back:  # the reduced frame written back into the peer's memory
            tally_frame(path, tally.SENT, total, total)
        if kind == EAGER:
            if fold is None:
                for view in views:
                    self._read_exact(view)
            else:
                self._read_exact(as_bytes(fold[2][:total]))
                fold_into(fold, offsets, 0, fold[2][:total])
        elif kind in (PULL, PULLV):
            remote = [(addr, total)] if kind == PULL else self._read_spans(chunk, total)
            self._pull(views, remote, fold, back, shift)
            self._ack()
        else:
            done = 0
            while True:
                if not 0 < chunk <= total - done:
                    raise self._malformed(f"a staged piece of {chunk} bytes at {done} of {total}")
                self._unstage(views, offsets, done, slot, chunk, fold)
                self._ack()
                done += chunk
                if done == total:
                    break
                kind, slot, chunk, again, _ = self._read_header()
                if kind != STAGED or again != total:
                    raise self._malformed("a staged payload was cut short")
        return back

    def _read_spans(self, count: int, total: int) -> list[cma.Span]:
        """The parts of a gathered single-copy frame: ``count`` (address, bytes) adding up to
        ``total``."""
        if not 0 < count <= min(total, MAX_SPANS):
            raise self._malformed(f"a gathered frame of {count} parts")
        raw = bytearray(count * SPAN.size)
        self._read_exact(memoryview(raw))
        spans = [(int(a), int(n)) for a, n in SPAN.iter_unpack(raw)]
        if sum(n for _, n in spans) != total:
            raise self._malformed("a gathered frame whose parts do not add up")
        return spans

    def _pull(
        self,
        views: list[memoryview],
        remote: list[cma.Span],
        fold: Fold | None,
        back: bool = False,
        shift: int = 0,
    ) -> None:
        """Copy the sender's parts ``remote`` into ``views``, or fold them in piece by piece;
        with ``back``, each reduced piece is written back over the sender's, still in cache
        (``shift`` bytes further on in the sender's memory: its result apart from its input)."""
        pid = self._in.pid
        try:
            local = [(cma.address(v), v.nbytes) for v in views]
            if fold is None:
                cma.read_spans(pid, local, remote)
                return
            per = fold[0][0].itemsize
            for pieces in cma.steps(local, remote, REDUCE_CHUNK - REDUCE_CHUNK % per):
                tmp = beside(fold[2], pieces[0][2], per)
                base, at, reads = tmp.ctypes.data, 0, []
                for _, _, there, n in pieces:
                    reads.append((base + at, there, n))
                    at += n
                cma.transfer(pid, reads)
                at = 0
                for i, off, _, n in pieces:
                    fold_piece(fold, i, off, n, tmp[at : at + n])
                    at += n
                if back:
                    writes = [(local[i][0] + off, t + shift, n) for i, off, t, n in pieces]
                    cma.transfer(pid, writes, True)
        except OSError as e:
            raise self._fail(f"single-copy transfer with {self._what} failed: {e}") from e

    def _unstage(
        self,
        views: list[memoryview],
        offsets: list[int],
        start: int,
        slot: int,
        chunk: int,
        fold: Fold | None,
    ) -> None:
        staging = self._in.staging
        if staging is None or not 0 <= slot < SLOTS or chunk > SLOT_BYTES:
            raise self._malformed(f"staged data in slot {slot} of {chunk} bytes")
        src = staging.slot(slot, chunk)
        if fold is not None:
            fold_into(fold, offsets, start, src)
            return
        at = 0
        for i, off, n in ranges(offsets, start, chunk):
            np.frombuffer(views[i], np.uint8, n, off)[...] = src[at : at + n]
            at += n

    def _ack(self) -> None:
        try:
            self._in.sock.sendall(ACK)
        except (BrokenPipeError, ConnectionResetError):
            # The sender closed its end: a staged send is done once written, so a peer that
            # finished its op may leave before its last slots are read. What it sent arrived;
            # the next read reports it gone.
            pass
        except OSError as e:
            raise self._fail(e) from e

    def _read_header(self) -> tuple[int, int, int, int, int]:
        if self._closed:
            raise self._closed_error()
        spin = waiting_spin()
        if spin:
            poll_yielding(self._in.sock, spin)
        self._read_exact(memoryview(self._header))
        kind, slot, chunk, total, addr = HEADER.unpack(self._header)
        return int(kind), int(slot), int(chunk), int(total), int(addr)

    def _read_exact(self, view: memoryview) -> None:
        try:
            recv_exact_into(self._in.sock, view)
        except (OSError, EOFError) as e:
            raise self._fail(e) from e

    # -- state -------------------------------------------------------------------------------

    def fileno(self) -> int:
        """The receiving socket: readable once a frame has started to arrive (or on close)."""
        return self._in.sock.fileno()

    def close(self) -> None:
        """Close both directions; blocked and later operations raise TransportError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._error is None:
                self._error = TransportError(f"connection to {self._what} was closed by this rank")
            pending = [work for work, _ in self._unacked if work is not None]
            self._unacked.clear()
            self._lock.notify_all()
        self._sender.close()
        self._receiver.close()
        hard_close(self._out.sock)
        hard_close(self._in.sock)
        for work in pending:
            work.finish(self._closed_error())
        self._sender.join()
        self._receiver.join()
        join_thread(self._acker)

    def _closed_error(self) -> TransportError:
        return TransportError(str(self._error or f"connection to {self._what} is closed"))

    def _malformed(self, problem: str) -> TransportError:
        return self._fail(f"malformed frame from {self._what}: {problem}")

    def _fail(self, reason: str | BaseException) -> TransportError:
        """Record why the pair broke, close it, and return the error to raise."""
        with self._lock:
            if self._error is None and not self._closed:
                if isinstance(reason, (EOFError, ConnectionResetError, BrokenPipeError)):
                    reason = f"connection to {self._what} closed (peer exited or was killed)"
                elif isinstance(reason, OSError):
                    reason = f"connection to {self._what} failed: {reason}"
                self._error = TransportError(str(reason))
        self.close()
        return self._closed_error()
