"""Time the collective algorithms over the real TCP transport (run by hand, not collected).

    python tests/unit/collectives/tcp_bench.py -n 2 -a registry -s 4K,64K,1M,16M,64M
    python tests/unit/collectives/tcp_bench.py -n 4 -a ring --segment 1M

One process per rank on this host. Prints, per size, the median time of one collective on
rank 0 and the algorithm bandwidth (bytes / time).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hora.collectives import registry
from hora.collectives.base import GroupComm
from hora.collectives.reduce_ops import MAX
from hora.rendezvous import RendezvousServer, StoreClient
from hora.transport.tcp import TcpTransport

SECRET = b"collective-bench"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def operation(args: argparse.Namespace, comm: GroupComm, nbytes: int) -> Callable[[], Any]:
    buf = np.ones(nbytes // 4, np.float32)
    seg = {"segment_bytes": args.segment} if args.segment else {}
    if args.algorithm == "registry":
        return lambda: registry.allreduce(comm, buf, "float32", MAX)
    if args.algorithm == "ring":
        return lambda: registry.allreduce_ring(comm, buf, "float32", MAX, **seg)
    if args.algorithm == "rd":
        return lambda: registry.allreduce_recursive_doubling(comm, buf, "float32", MAX)
    if args.algorithm == "allgather":
        part = buf[: buf.size // comm.size]
        out = np.empty(part.size * comm.size, np.float32)
        counts = [part.size] * comm.size
        return lambda: registry.allgatherv_ring(comm, part, out, counts, **seg)
    if args.algorithm == "broadcast":
        return lambda: registry.broadcast_tree(comm, buf, 0, **seg)
    if args.algorithm == "adasum":
        return lambda: registry.adasum(comm, buf, "float32", [(0, buf.size)])
    raise ValueError(f"unknown algorithm {args.algorithm}")


def rank_main(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    store = StoreClient("127.0.0.1", port, SECRET)
    transport = TcpTransport(rank, args.np, SECRET, store, "bench")
    comm = GroupComm(transport)
    rows = []
    for nbytes in args.sizes:
        run = operation(args, comm, nbytes)
        repeats = max(5, min(args.max_repeats, (512 << 20) // max(nbytes, 1)))
        for _ in range(3):
            run()
        times = []
        for _ in range(repeats):
            registry.barrier(comm)
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        rows.append((nbytes, statistics.median(times)))
    registry.barrier(comm)
    if rank == 0:
        queue.put(rows)
    transport.close()
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", "--np", type=int, default=2)
    parser.add_argument("-a", "--algorithm", default="registry")
    parser.add_argument("-s", "--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--segment", type=parse_size, default=0)
    parser.add_argument("--max-repeats", type=int, default=2000)
    args = parser.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with RendezvousServer(SECRET, "127.0.0.1") as server:
        procs = [
            ctx.Process(target=rank_main, args=(r, args, server.port, queue))
            for r in range(args.np)
        ]
        for p in procs:
            p.start()
        rows = queue.get(timeout=600)
        for p in procs:
            p.join(60)
    for nbytes, seconds in rows:
        print(
            f"{args.algorithm:>10} np={args.np} {nbytes:>11,d} B {seconds * 1e6:11.1f} us "
            f"{nbytes / seconds / 1e9:6.2f} GB/s"
        )


if __name__ == "__main__":
    main()
