"""``init_process_group(backend="hora")`` on real ranks, against Gloo in the same processes.

One job per world size (2 and 3) runs the whole battery: every collective, DDP training of the
scaling lab's MLP and CNN (with and without comm hooks) and FSDP2, first on ``backend="hora"``,
then, after ``destroy_process_group``, on ``backend="gloo"`` in the same processes with the same
inputs; the test compares the two and checks analytically what Gloo lacks (AVG, the calls hora
refuses). Each job writes hora's timeline, which must hold the torch calls' ops. A job of 3
ranks checks failures: a shape mismatch raises on every rank and leaves the group usable, a rank
killed mid-step makes the survivors' backward raise. A job started as torchrun starts it (no
``hora run`` variables) exercises hora's start through torch's store, and torch's entry-point
mechanism registers the name with no import of hora.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import run_ranks, spawn_ranks

SIZES = [2, 3]
REPO = Path(__file__).resolve().parents[2]


# -- what both backends run -----------------------------------------------------------------
def collectives(r: int, n: int, backend: str) -> dict[str, list[torch.Tensor]]:
    """Every collective torch offers that hora runs, on inputs each rank can predict."""
    import torch.distributed as dist

    def x(*shape: int, k: float = 0.0) -> torch.Tensor:
        shape = shape or (5,)
        return torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 10 * r + k + 1

    out: dict[str, list[torch.Tensor]] = {}
    for op in ("SUM", "MIN", "MAX", "PRODUCT"):
        t = x(2, 3)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce.{op}"] = [t]
    ts = [x(4), x(2, 2, k=5)]
    dist.all_reduce_coalesced(ts)
    out["all_reduce_coalesced"] = ts
    t = x(3)
    dist.broadcast(t, src=n - 1)
    out["broadcast"] = [t]
    outs = [torch.zeros(2, 3) for _ in range(n)]
    dist.all_gather(outs, x(2, 3))
    out["all_gather"] = outs
    o = torch.zeros(n * 4)
    dist.all_gather_into_tensor(o, x(4))
    out["all_gather_into_tensor"] = [o]
    o = torch.zeros(3)
    dist.reduce_scatter(o, [x(3, k=i) for i in range(n)])
    out["reduce_scatter"] = [o]
    o = torch.zeros(2, 2)
    dist.reduce_scatter_tensor(o, x(2 * n, 2))
    out["reduce_scatter_tensor"] = [o]
    o = torch.zeros(n * 2)
    dist.all_to_all_single(o, x(n * 2))
    out["all_to_all_single"] = [o]
    # uneven: rank r sends j+1 rows to rank j, so it receives r+1 rows from each
    send = x(sum(range(1, n + 1)), 2)
    o = torch.zeros(n * (r + 1), 2)
    dist.all_to_all_single(o, send, [r + 1] * n, [j + 1 for j in range(n)])
    out["all_to_all_single.uneven"] = [o]
    work = dist.all_reduce(x(6), async_op=True)
    got = work.get_future().wait()
    out["async.future"] = list(got)
    assert work.wait() and work.is_completed()
    dist.barrier()
    sub = dist.new_group([0, n - 1])
    if r in (0, n - 1):
        t = x(3)
        dist.all_reduce(t, group=sub)
        out["new_group.all_reduce"] = [t]
    return out


def analytic_checks(r: int, n: int) -> None:
    """What Gloo does not offer: AVG, all_to_all of lists, a refused reduce op (the rooted and
    point-to-point calls are tested in test_torch_p2p_rooted.py)."""
    import torch.distributed as dist

    t = torch.full((3,), float(r))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    torch.testing.assert_close(t, torch.full((3,), (n - 1) / 2))
    outs = [torch.zeros(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((2,), 10.0 * r + j) for j in range(n)])
    for j, o in enumerate(outs):
        torch.testing.assert_close(o, torch.full((2,), 10.0 * j + r))
    assert dist.get_backend() == "hora"
    try:
        dist.all_reduce(torch.ones(1), op=dist.ReduceOp.BAND)
    except ValueError as e:
        assert "hora backend" in str(e) and "BAND" in str(e), str(e)
    else:
        raise AssertionError("ReduceOp.BAND did not raise")


def train(r: int, n: int, model: str, hook: str | None, steps: int = 3) -> list[torch.Tensor]:
    """DDP on the scaling lab's model, each rank its own batch: the losses, then the params."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hora.lab.train_worker import TrainSpec, build

    net, batches, loss_fn = build(TrainSpec(model, 4, steps, 0), r, n)
    ddp = DDP(net, bucket_cap_mb=1)  # several buckets in flight at once
    if hook == "future":  # a Python hook built on the Work's future

        def average(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0].div_(n))

        ddp.register_comm_hook(None, average)
    elif hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        x, y = batches()
        opt.zero_grad()
        loss = loss_fn(ddp(x * (1 + 0.25 * r)), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().reshape(1))
    return losses + [p.detach().clone() for p in ddp.module.parameters()]


def fsdp(r: int, n: int) -> list[torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (m[0], m[2]):
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    torch.manual_seed(1 + r)
    losses = []
    for _ in range(3):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().reshape(1))
    return losses


def runs(r: int, n: int, backend: str) -> dict[str, Any]:
    got: dict[str, Any] = {"collectives": collectives(r, n, backend)}
    for model in ("mlp", "cnn"):
        got[f"ddp.{model}"] = train(r, n, model, None)
    got["ddp.mlp.hook.future"] = train(r, n, "mlp", "future")
    got["ddp.mlp.hook.fp16"] = train(r, n, "mlp", "fp16")
    got["fsdp"] = fsdp(r, n)
    return got


def battery(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    import hora.torch as hvd
    import hora.torch.distributed  # noqa: F401 - the one extra line

    torch.set_num_threads(1)
    n = int(os.environ["HORA_SIZE"])
    dist.init_process_group(backend="hora")
    results: dict[str, Any] = {}
    try:
        hora_runs = runs(rank, n, "hora")
        analytic_checks(rank, n)
        results["analytic"] = "ok"
    except Exception:
        return {"hora": traceback.format_exc()}
    results["engine_initialized"] = hvd.is_initialized()
    port = hvd.broadcast_object(_free_port() if rank == 0 else None, 0)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)  # fmt: skip
    gloo_runs = runs(rank, n, "gloo")
    dist.destroy_process_group()
    results["compare"] = compare(hora_runs, gloo_runs)
    return results


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def compare(hora_runs: dict[str, Any], gloo_runs: dict[str, Any]) -> dict[str, str]:
    flat_h = {**hora_runs.pop("collectives"), **hora_runs}
    flat_g = {**gloo_runs.pop("collectives"), **gloo_runs}
    verdict = {}
    for key, got in flat_h.items():
        tol = 2e-3 if "fp16" in key else 1e-5
        try:
            want = flat_g[key]
            assert len(got) == len(want), f"{len(got)} tensors against {len(want)}"
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=tol, rtol=tol)
            verdict[key] = "ok"
        except Exception as e:  # noqa: BLE001 - reported per key
            verdict[key] = f"{type(e).__name__}: {e}"
    return verdict


KEYS = [
    *(f"all_reduce.{op}" for op in ("SUM", "MIN", "MAX", "PRODUCT")),
    "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "all_to_all_single.uneven",
    "async.future", "ddp.mlp", "ddp.cnn", "ddp.mlp.hook.future", "ddp.mlp.hook.fp16", "fsdp",
]  # fmt: skip


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"np{n}")
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    n = request.param
    timeline = str(tmp_path_factory.mktemp("timeline") / "timeline.json")
    return n, run_ranks(battery, n, timeout=240, env={"HORA_TIMELINE": timeline}), timeline


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", KEYS)
def test_same_results_as_gloo(job: Any, key: str) -> None:
    n, per_rank, _ = job
    for rank, res in enumerate(per_rank):
        assert "hora" not in res, f"rank {rank} failed on backend hora:\n{res['hora']}"
        assert res["compare"].get(key) == "ok", f"np={n} rank {rank}: {res['compare'].get(key)}"


@pytest.mark.timeout(300)
def test_subgroup_avg_all_to_all_and_a_refused_op(job: Any) -> None:
    n, per_rank, _ = job
    for rank, res in enumerate(per_rank):
        assert res.get("analytic") == "ok", f"np={n} rank {rank}: {res}"
        members = rank in (0, n - 1)
        assert (res["compare"].get("new_group.all_reduce") == "ok") == members, res["compare"]
        assert res["engine_initialized"]


@pytest.mark.timeout(300)
def test_timeline_shows_the_torch_calls(job: Any) -> None:
    _, _, timeline = job
    text = Path(timeline).read_text()
    json.loads(text if text.rstrip().endswith("]") else text.rstrip().rstrip(",") + "]")
    for op in ("allreduce.c10d.", "allgather.c10d.", "broadcast.c10d.", "reducescatter.c10d."):
        assert op in text, f"{op} not in the timeline"


# -- failures -------------------------------------------------------------------------------
def faults(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    import hora.torch.distributed  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(backend="hora")
    out: dict[str, Any] = {}
    try:
        dist.all_reduce(torch.ones(rank + 2))
        out["mismatch"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["mismatch"] = (type(e).__name__, str(e))
    t = torch.ones(3)
    dist.all_reduce(t)
    out["after"] = t.tolist()
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    for step in range(4):
        loss = ddp(torch.randn(2, 4)).sum()
        if step == 2 and rank == 2:
            os._exit(3)  # dies between forward and backward
        try:
            loss.backward()
        except Exception as e:  # noqa: BLE001
            out["killed"] = (type(e).__name__, str(e), step)
            break
    return out


@pytest.mark.timeout(150)
def test_mismatch_and_lost_peer_raise_on_every_rank() -> None:
    results = spawn_ranks(faults, 3, timeout=120)
    assert results[2].returncode == 3, results[2].stderr[-2000:]
    for res in results[:2]:
        assert res.ok, f"rank {res.rank}: {res.status}\n{res.value}\n{res.stderr[-3000:]}"
        kind, text = res.value["mismatch"]
        assert kind == "DistBackendError" and "hora backend: allreduce" in text, text
        assert "shape" in text, text
        assert res.value["after"] == [3.0, 3.0, 3.0]
        kind, text, step = res.value["killed"]
        assert step == 2, res.value
        assert kind in ("DistBackendError", "RuntimeError"), res.value["killed"]
        assert "hora backend" in text and "2" in text, text


# -- torchrun's environment, torch's entry points -------------------------------------------
TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    import hora.torch as hvd
    import hora.torch.distributed
    dist.init_process_group(backend="hora")
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    g = dist.new_group([0, 1])
    u = torch.ones(2)
    dist.all_reduce(u, group=g)
    print("RESULT", r, n, hvd.rank(), hvd.size(), t.tolist(), u.tolist(), flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(120)
def test_torchrun_environment_starts_hora_through_torchs_store(tmp_path: Path) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_"))}  # fmt: skip
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, "-c", TORCHRUN_SCRIPT],
                         env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out[-3000:]
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
        assert line == f"RESULT {r} 2 {r} 2 [3.0, 3.0, 3.0] [2.0, 2.0]", line


@pytest.mark.timeout(120)
def test_hora_run_fills_torchs_environment(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    launcher = [sys.executable, "-c", "import sys; from hora.launch.cli import main; "
                "sys.exit(main())"]  # fmt: skip
    out = subprocess.run([*launcher, "run", "-np", "2", sys.executable, str(script)], env=env,
                         capture_output=True, text=True, timeout=100)  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    lines = sorted(ln.split("RESULT ", 1)[1] for ln in out.stdout.splitlines() if "RESULT" in ln)
    assert lines == [f"{r} 2 {r} 2 [3.0, 3.0, 3.0] [2.0, 2.0]" for r in range(2)], out.stdout


def test_torch_entry_point_registers_hora_without_importing_it(tmp_path: Path) -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    section = pyproject.split('[project.entry-points."torch.backends"]', 1)[1].split("[", 1)[0]
    target = "hora_torch_plugin:plugin"
    assert f'hora = "{target}"' in section, section
    # torch finds entry points in any distribution's metadata on the path
    meta = tmp_path / "hora_probe-0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: hora-probe\nVersion: 0\n")
    (meta / "entry_points.txt").write_text(f"[torch.backends]\nhora = {target}\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO / "src")])
    code = (
        "import sys, torch, torch.distributed as d\n"
        "print(d.Backend('hora'), 'HORA' in d.Backend._plugins, 'hora' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["hora", "True", "False"], out.stdout + out.stderr[-2000:]


# -- hora bench ddp -------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_bench_ddp_runs_the_script_on_both_backends() -> None:
    from hora.lab.ddp import render, run_ddp_bench

    result = run_ddp_bench(["mlp"], [4096], np_=2, steps=2, warmup=1, iters=3, timeout=180)
    for backend in ("gloo", "hora"):
        got = result["results"][backend]
        assert got["backend"] == backend and got["np"] == 2
        assert got["train"]["mlp"]["img_per_s"] > 0
        assert [row["bytes"] for row in got["allreduce"]] == [4096]
        # hora's own API on the same tensor, in the hora run only
        assert ("api_p50_us" in got["allreduce"][0]) == (backend == "hora")
    text = render(result)
    assert "mlp" in text and "4 KiB" in text and "hora/gloo" in text and "hora/API" in text
