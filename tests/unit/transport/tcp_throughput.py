"""Measure one TcpPair over loopback between two processes (run by hand, not collected).

    python tests/unit/transport/tcp_throughput.py [--raw]

Prints GB/s for large buffers and the round-trip time of a 4 KiB ping-pong. ``--raw`` measures
plain sockets (sendall/recv_into) on the same path for comparison.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time

import numpy as np

from hora.rendezvous import RendezvousServer, StoreClient
from hora.transport.base import CONTROL, DATA
from hora.transport.tcp import TcpTransport
from hora.transport.tcp.wire import recv_exact_into

SIZES = [1 << 20, 16 << 20, 64 << 20, 256 << 20]
PINGS = 5000
SECRET = b"throughput"


def repeats(size: int) -> int:
    return max(3, (1 << 30) // size)


def pair_rank(rank: int, port: int, channel: int = DATA) -> None:
    store = StoreClient("127.0.0.1", port, SECRET)
    transport = TcpTransport(rank, 2, SECRET, store, "bench")
    data = transport.pair(1 - rank, DATA)
    ctrl = transport.pair(1 - rank, CONTROL)
    buf = np.ones(max(SIZES), dtype=np.uint8)
    for size in SIZES:
        view = memoryview(buf)[:size]
        ctrl.send_msg(b"go") if rank == 0 else ctrl.recv_msg()
        start = time.perf_counter()
        for _ in range(repeats(size)):
            data.send(view) if rank == 0 else data.recv_into(view)
        ctrl.recv_msg() if rank == 0 else ctrl.send_msg(b"done")
        if rank == 0:
            seconds = time.perf_counter() - start
            print(f"TcpPair  {size >> 20:4d} MiB: {size * repeats(size) / seconds / 1e9:.2f} GB/s")
    small = memoryview(buf)[:4096]
    for rounds in (100, PINGS):
        start = time.perf_counter()
        for _ in range(rounds):
            if rank == 0:
                data.send(small)
                data.recv_into(small)
            else:
                data.recv_into(small)
                data.send(small)
    if rank == 0:
        print(f"TcpPair  4 KiB round trip: {(time.perf_counter() - start) / PINGS * 1e6:.1f} us")
    transport.close()
    store.close()


def raw_rank(rank: int, port: int) -> None:
    if rank == 0:
        listener = socket.create_server(("127.0.0.1", port))
        sock, _ = listener.accept()
    else:
        time.sleep(0.5)
        sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.ones(max(SIZES), dtype=np.uint8)
    ack = memoryview(bytearray(1))
    for size in SIZES:
        view = memoryview(buf)[:size]
        start = time.perf_counter()
        for _ in range(repeats(size)):
            sock.sendall(view) if rank == 0 else recv_exact_into(sock, view)
        sock.recv_into(ack) if rank == 0 else sock.sendall(b"x")
        if rank == 0:
            seconds = time.perf_counter() - start
            print(f"raw      {size >> 20:4d} MiB: {size * repeats(size) / seconds / 1e9:.2f} GB/s")
    small = memoryview(buf)[:4096]
    start = time.perf_counter()
    for _ in range(PINGS):
        if rank == 0:
            sock.sendall(small)
            recv_exact_into(sock, small)
        else:
            recv_exact_into(sock, small)
            sock.sendall(small)
    if rank == 0:
        print(f"raw      4 KiB round trip: {(time.perf_counter() - start) / PINGS * 1e6:.1f} us")
    sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--raw", action="store_true", help="plain sockets instead of TcpPair")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with RendezvousServer(SECRET, "127.0.0.1") as server:
        port = 20000 + os.getpid() % 20000 if args.raw else server.port
        target = raw_rank if args.raw else pair_rank
        procs = [ctx.Process(target=target, args=(r, port)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)


if __name__ == "__main__":
    main()
