"""``hora bench ddp``: the same DDP script on ``backend="gloo"`` and ``backend="hora"``.

For each backend this module starts ``--np`` fresh worker processes on this host, as torchrun
would (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), and each
runs the one script below with only the ``backend=`` string changed: ``DistributedDataParallel``
training of the scaling lab's models (:func:`hora.lab.train_worker.build`: mlp, cnn, ... on
synthetic batches, SGD), then ``dist.all_reduce`` of float32 buffers size by size (on hora,
in turns of :data:`BLOCK` calls with ``hora.torch.allreduce_`` on the same tensor, hora's own
API). Rank 0
reports images per second for each model and the median latency and bus bandwidth of each size;
the table puts the two backends side by side with their ratio (hora over Gloo: above 1, hora
is faster). ``--repeat R`` runs the backends R times in turn and keeps each measurement's best
round, so both see the same moments of a shared machine.

The parent runs in the caller's thread and blocks while the workers run; a worker is this
module run as ``python -m hora.lab.ddp --worker PLAN`` (its main thread).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from hora.lab.allreduce import parse_sizes
from hora.lab.procs import base_env, free_port, tail

BACKENDS = ("gloo", "hora")
DEFAULT_MODELS = ("mlp", "cnn")
DEFAULT_SIZES = "4K,64K,1M,16M"
EXAMPLES = """examples:
  hora bench ddp                              mlp and cnn, then all_reduce 4 KiB to 16 MiB, np=2
  hora bench ddp --repeat 3 --json ddp.json   best of three interleaved rounds, saved
  hora bench ddp --models mlp --sizes 1M --steps 50
"""

# dist.all_reduce and hora's own API take turns by blocks of this many calls, not call by call:
# a rank that leaves a call later than its peer makes the peer's next call wait for it, so call
# by call one of the two would take all of that wait (at 1 MiB, dist.all_reduce measured 4.6x
# the API's time in one run); in blocks only a block's first call does
BLOCK = 10


def default_iters(nbytes: int) -> int:
    return 200 if nbytes <= 1 << 20 else 30


# -- the worker: the one DDP script, either backend --------------------------------------------
def worker(plan: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hora.lab.train_worker import DEFAULT_BATCH, TrainSpec, build

    backend = plan["backend"]
    if backend == "hora":
        import hora.torch.distributed  # noqa: F401 - registers backend="hora"
    torch.set_num_threads(1)
    dist.init_process_group(backend=backend)  # the only line that differs
    rank, size = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"backend": backend, "np": size, "train": {}, "allreduce": []}
    for model in plan["models"]:
        batch = int(plan["batch"].get(model) or DEFAULT_BATCH[model])
        spec = TrainSpec(model, batch, int(plan["steps"]), int(plan["warmup"]))
        net, batches, loss_fn = build(spec, rank, size)
        ddp = DDP(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step(ddp: Any = ddp, opt: Any = opt, batches: Any = batches,
                 loss_fn: Any = loss_fn) -> float:  # fmt: skip
            x, y = batches()
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            return float(loss.detach())

        for _ in range(spec.warmup):
            step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(spec.steps):
            loss = step()
        elapsed = time.perf_counter() - start
        out["train"][model] = {
            "batch": batch,
            "steps": spec.steps,
            "img_per_s": batch * size * spec.steps / elapsed,
            "loss": loss,
        }
    for nbytes in plan["sizes"]:
        x = torch.zeros(max(1, nbytes // 4))
        iters = int(plan["iters"] or default_iters(nbytes))
        calls: list[Callable[[], Any]] = [partial(dist.all_reduce, x)]
        if backend == "hora":  # hora's own API on the same tensor, in turns of BLOCK calls
            import hora.torch as hvd

            calls.append(partial(hvd.allreduce_, x, op=hvd.Sum, name=f"lab.ddp.{nbytes}"))
        times: list[list[float]] = [[] for _ in calls]
        for _ in range(max(2, iters // 10)):
            for call in calls:
                call()
        dist.barrier()
        for _ in range(0, iters, BLOCK):
            for call, took in zip(calls, times):
                for _ in range(min(BLOCK, iters - len(took))):
                    t0 = time.perf_counter()
                    call()
                    took.append(time.perf_counter() - t0)
        p50 = statistics.median(times[0])
        busbw = nbytes / p50 * 2 * (size - 1) / size / 1e9
        row = {"bytes": nbytes, "p50_us": p50 * 1e6, "busbw_gbs": busbw}
        if len(times) > 1:
            row["api_p50_us"] = statistics.median(times[1]) * 1e6
        out["allreduce"].append(row)
    dist.barrier()
    if rank == 0:
        with open(plan["out"] + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(plan["out"] + ".tmp", plan["out"])
    dist.destroy_process_group()


# -- the parent ---------------------------------------------------------------------------------
def run_backend(plan: dict[str, Any], np_: int, tmp: str, timeout: float,
                module: str = "hora.lab.ddp") -> dict[str, Any]:  # fmt: skip
    """One backend's workers, torchrun-style, each ``python -m <module> --worker PLAN``; rank
    0's results (RuntimeError on failure)."""
    backend = plan["backend"]
    plan = dict(plan, out=os.path.join(tmp, f"{backend}.json"))
    plan_path = os.path.join(tmp, f"{backend}.plan.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    env = base_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(np_),
               LOCAL_WORLD_SIZE=str(np_))  # fmt: skip
    procs, logs = [], []
    try:
        for rank in range(np_):
            log = os.path.join(tmp, f"{backend}.{rank}.log")
            logs.append(log)
            with open(log, "wb") as f:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", module, "--worker", plan_path],
                    env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                    stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                    start_new_session=True,
                ))  # fmt: skip
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{backend}: no result within {timeout:g} s\n{tail(logs[0])}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
    if bad or not os.path.exists(plan["out"]):
        rank = bad[0][0] if bad else 0
        raise RuntimeError(f"{backend}: rank {rank} failed\n{tail(logs[rank])}")
    with open(plan["out"]) as f:
        return dict(json.load(f))


def _best(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Each measurement's best of two rounds of one backend."""
    if a is None:
        return b
    for model, row in b["train"].items():
        if row["img_per_s"] > a["train"][model]["img_per_s"]:
            a["train"][model] = row
    for i, row in enumerate(b["allreduce"]):
        old = a["allreduce"][i]
        best = dict(row if row["p50_us"] < old["p50_us"] else old)
        if "api_p50_us" in row:  # the API's best round, kept apart
            best["api_p50_us"] = min(row["api_p50_us"], old["api_p50_us"])
        a["allreduce"][i] = best
    return a


def run_ddp_bench(models: list[str], sizes: list[int], np_: int = 2, steps: int = 30,
                  warmup: int = 5, batch: dict[str, int] | None = None, iters: int = 0,
                  repeat: int = 1, timeout: float = 600.0,
                  backends: tuple[str, ...] = BACKENDS) -> dict[str, Any]:  # fmt: skip
    """Run the DDP script on each backend ``repeat`` times in turn; the best round of each."""
    plan = {"models": models, "sizes": sizes, "steps": steps, "warmup": warmup,
            "batch": batch or {}, "iters": iters}  # fmt: skip
    best: dict[str, dict[str, Any] | None] = {b: None for b in backends}
    tmp = tempfile.mkdtemp(prefix="hora-bench-ddp-")
    try:
        for r in range(repeat):
            for backend in backends:
                sys.stderr.write(f"hora bench ddp: {backend}, round {r + 1} of {repeat}\n")
                got = run_backend(dict(plan, backend=backend), np_, tmp, timeout)
                best[backend] = _best(best[backend], got)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"np": np_, "models": models, "sizes": sizes, "results": best}


def render(result: dict[str, Any]) -> str:
    res = result["results"]
    g, h = res.get("gloo"), res.get("hora")
    lines = [f"DDP on backend='gloo' and backend='hora', np={result['np']} (this host)", ""]
    lines.append(f"{'model':<8}{'batch':>6}{'gloo img/s':>13}{'hora img/s':>13}{'hora/gloo':>11}")
    for model in result["models"]:
        gi, hi = g["train"][model]["img_per_s"], h["train"][model]["img_per_s"]
        lines.append(f"{model:<8}{g['train'][model]['batch']:>6}{gi:>13.1f}{hi:>13.1f}"
                     f"{hi / gi:>10.2f}x")  # fmt: skip
    lines += ["", f"{'all_reduce':<11}{'gloo p50 us':>12}{'hora p50 us':>12}"
              f"{'gloo GB/s':>11}{'hora GB/s':>11}{'hora/gloo':>11}"
              f"{'API p50 us':>12}{'hora/API':>10}"]  # fmt: skip
    for ga, ha in zip(g["allreduce"], h["allreduce"]):
        api = ha.get("api_p50_us")
        lines.append(f"{_human(ga['bytes']):<11}{ga['p50_us']:>12.1f}{ha['p50_us']:>12.1f}"
                     f"{ga['busbw_gbs']:>11.3f}{ha['busbw_gbs']:>11.3f}"
                     f"{ga['p50_us'] / ha['p50_us']:>10.2f}x"
                     + (f"{api:>12.1f}{ha['p50_us'] / api:>9.2f}x" if api else ""))  # fmt: skip
    lines += ["", "hora/gloo: hora's speed over Gloo's (img/s, or the inverse of p50 latency); "
              "bus bandwidth = size / p50 * 2(n-1)/n",
              f"API: hora.torch.allreduce_ on the same tensor in the hora run, in turns of {BLOCK} "
              "calls with dist.all_reduce; hora/API: dist.all_reduce's p50 over it"]  # fmt: skip
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--np", type=int, default=2, help="processes per backend (default 2)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="models to train, comma-separated (default mlp,cnn)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=30, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=0,
                        help="per-process batch size (default: the scaling lab's per model)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"all_reduce sizes, comma-separated (default {DEFAULT_SIZES})")
    parser.add_argument("--iters", type=int, default=0,
                        help="timed all_reduce calls per size (default 200 up to 1 MiB, then 30)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of both backends in turn; each measurement's best is kept")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per backend run")
    parser.add_argument("--json", default=None, help="also write the results to this file")


def command(args: argparse.Namespace) -> int:
    from hora.lab.train_worker import MODELS

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise SystemExit(f"hora bench ddp: unknown model(s) {unknown}: choose from {MODELS}")
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as e:
        raise SystemExit(f"hora bench ddp: {e}") from None
    batch = {m: args.batch for m in models} if args.batch else None
    return report(
        "ddp",
        partial(run_ddp_bench, models, sizes, args.np, args.steps, args.warmup, batch,
                args.iters, max(1, args.repeat), args.timeout),
        render, args.json,
    )  # fmt: skip


def report(name: str, run: Callable[[], dict[str, Any]],
           render: Callable[[dict[str, Any]], str], json_path: str | None) -> int:  # fmt: skip
    """Run a benchmark of torch's backends, print its table and save its results to
    ``json_path``; 1, saying why, when a run failed."""
    try:
        result = run()
    except RuntimeError as e:
        sys.stderr.write(f"hora bench {name}: {e}\n")
        return 1
    print(render(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def script_main(argv: list[str] | None, module: str, worker: Callable[[dict[str, Any]], None],
                configure: Callable[[argparse.ArgumentParser], None],
                command: Callable[[argparse.Namespace], int], examples: str) -> int:  # fmt: skip
    """``python -m <module>``: the benchmark, or with ``--worker PLAN`` one of its workers."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"] and len(argv) == 2:
        with open(argv[1]) as f:
            worker(json.load(f))
        # No interpreter finalizers: a DDP model still holds its Gloo group after
        # destroy_process_group(), and freeing that group while the interpreter is torn down
        # aborts ("terminate called without an active exception") or hangs with the GIL held.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    parser = argparse.ArgumentParser(prog=f"python -m {module}", epilog=examples,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    return command(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    return script_main(argv, "hora.lab.ddp", worker, configure, command, EXAMPLES)


if __name__ == "__main__":
    sys.exit(main())
