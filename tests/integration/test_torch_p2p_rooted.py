"""``backend="hora"``'s rooted and point-to-point calls on real ranks, against Gloo in the same
processes, and the clients that need them.

One job per world size (2 and 3) runs every call first on ``backend="hora"``, then, after
``destroy_process_group``, on ``backend="gloo"`` with the same inputs, and compares: ``reduce``,
``gather``, ``scatter``, ``gather_object``, ``scatter_object_list``, ``send``/``recv`` (tags
taken out of order, a 4 MiB message, from any sender, a subgroup), ``isend``/``irecv`` and
``batch_isend_irecv``. At np=2 the same job saves an FSDP2 model's sharded state with
``torch.distributed.checkpoint`` and loads it back (and loads the other backend's checkpoint),
and trains a two-stage ``torch.distributed.pipelining`` GPipe schedule. A job of 3 ranks checks
failures: mismatched sizes, roots and shapes raise on both sides naming both, a root's unfit
``scatter_list`` fails every rank (not only the root), the group stays usable, and a peer
killed while others wait on it makes them raise, naming it.
"""

from __future__ import annotations

import os
import re
import time
import traceback
from typing import Any

import pytest
import torch

from harness import run_ranks, spawn_ranks
from hora.lab.procs import free_port

SIZES = [2, 3]


def _x(r: int, *shape: int, k: float = 0.0) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 10 * r + k + 1


# -- what both backends run -----------------------------------------------------------------
def rooted(r: int, n: int) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for op in ("SUM", "MAX"):
        t = _x(r, 2, 3)
        dist.reduce(t, dst=n - 1, op=getattr(dist.ReduceOp, op))
        out[f"reduce.{op}"] = [t] if r == n - 1 else []  # other ranks' tensors: unspecified
    for root in (0, n - 1):
        got = [torch.zeros(2, 2) for _ in range(n)] if r == root else None
        dist.gather(_x(r, 2, 2), got, dst=root)
        out[f"gather.{root}"] = got or []
    o = torch.zeros(3, dtype=torch.int64)
    pieces = [torch.full((3,), 100 + i) for i in range(n)] if r == n - 1 else None
    dist.scatter(o, pieces, src=n - 1)
    out["scatter"] = [o]
    objs: list[Any] | None = [None] * n if r == 0 else None
    dist.gather_object({"rank": r, "data": list(range(r + 2))}, objs, dst=0)
    out["gather_object"] = objs or []
    got_obj: list[Any] = [None]
    dist.scatter_object_list(got_obj, [f"piece {i}" * (i + 1) for i in range(n)] if r == 1
                             else None, src=1)  # fmt: skip
    out["scatter_object_list"] = got_obj
    return out


def point_to_point(r: int, n: int) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    nxt, prv = (r + 1) % n, (r - 1) % n
    # a ring of isends with two tags, received in the other order
    sends = [dist.isend(_x(r, 4, k=1), nxt, tag=1), dist.isend(_x(r, 6, k=2), nxt, tag=2)]
    b, a = torch.zeros(6), torch.zeros(4)
    recvs = [dist.irecv(b, prv, tag=2), dist.irecv(a, prv, tag=1)]
    for w in sends + recvs:
        w.wait()
    out["isend_irecv.tags"] = [a, b]
    # batch_isend_irecv both ways round the ring
    got = [torch.zeros(3, dtype=torch.float64) for _ in range(2)]
    ops = [dist.P2POp(dist.isend, _x(r, 3).double(), nxt), dist.P2POp(dist.irecv, got[0], prv),
           dist.P2POp(dist.isend, _x(r, 3, k=7).double(), prv),
           dist.P2POp(dist.irecv, got[1], nxt)]  # fmt: skip
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["batch_isend_irecv"] = got
    # blocking send and recv between the first two ranks: in order, one large
    big = torch.zeros(1 << 20)
    if r == 0:
        dist.send(_x(r, 5), 1)
        dist.send(torch.arange(float(1 << 20)), 1, tag=9)
        dist.recv(big, 1)
    elif r == 1:
        t = torch.zeros(5)
        dist.recv(t, 0)
        dist.recv(big, 0, tag=9)
        dist.send(big * 2, 0)
        out["send_recv"] = [t]
    out["send_recv.large"] = [big] if r < 2 else []
    # from any sender: rank 0 takes every other rank's message in whatever order they come,
    # sources named; a message with another tag waits for its own receive
    if r == 0:
        firsts = {}
        for _ in range(n - 1):
            t = torch.zeros(3)
            src = dist.recv(t, tag=4)
            firsts[src] = t
        t = torch.zeros(3)
        work = dist.irecv(t, tag=5)
        work.wait()
        late = [torch.tensor([float(work._source_rank())]), t]
        out["recv_any"] = [firsts[k] for k in sorted(firsts)] + late + [
            torch.tensor(sorted(firsts), dtype=torch.float64)]
    else:
        late = dist.isend(_x(r, 3, k=0.5), 0, tag=5) if r == n - 1 else None
        dist.send(_x(r, 3), 0, tag=4)  # taken first, though sent after the tag-5 message
        if late is not None:
            late.wait()
        out["recv_any"] = []
    # a subgroup of the first and last rank: its ranks are the group's, its tags its own
    sub = dist.new_group([0, n - 1])
    if r in (0, n - 1):
        t = _x(r, 2)
        if r == 0:
            dist.send(t, n - 1, group=sub, tag=1)
        else:
            dist.recv(t, 0, group=sub, tag=1)
        out["new_group.send_recv"] = [t]
    return out


def checkpoint(r: int, n: int, where: str, backend: str) -> dict[str, Any]:
    """FSDP2 state saved with DCP on this backend, loaded back into a fresh model, and the
    other backend's checkpoint loaded (when it exists): the full tensors each time."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        for layer in (m[0], m[2]):
            fully_shard(layer)
        fully_shard(m)
        return m

    def full(m: torch.nn.Module) -> list[torch.Tensor]:
        return [v.full_tensor() for _, v in sorted(get_model_state_dict(m).items())]

    def load(path: str) -> list[torch.Tensor]:
        m = model()
        sd = get_model_state_dict(m)
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(m, sd)
        return full(m)

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    torch.manual_seed(1 + r)
    m(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    dcp.save(get_model_state_dict(m), checkpoint_id=f"{where}/{backend}")
    out = {"dcp.trained": full(m), "dcp.loaded": load(f"{where}/{backend}")}
    if backend == "gloo":  # hora's checkpoint, loaded by Gloo
        out["dcp.cross"] = load(f"{where}/hora")
    return out


def pipelined(r: int, n: int) -> dict[str, Any]:
    """Two stages of an MLP under ScheduleGPipe, two microbatches: losses and gradients."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    part = full[:2] if r == 0 else full[2:]
    stage = PipelineStage(part, r, n, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda y, t: (y - t).pow(2).mean())
    torch.manual_seed(5)
    x, target = torch.randn(4, 8), torch.randn(4, 4)
    losses: list[torch.Tensor] = []
    if r == 0:
        schedule.step(x)
    else:
        schedule.step(target=target, losses=losses)
    return {"pipeline": [loss.detach().reshape(1) for loss in losses]
            + [p.grad.clone() for p in part.parameters()]}  # fmt: skip


def runs(r: int, n: int, where: str, backend: str) -> dict[str, Any]:
    got = {**rooted(r, n), **point_to_point(r, n)}
    if n == 2:
        got.update(checkpoint(r, n, where, backend))
        got.update(pipelined(r, n))
    return got


def analytic(r: int, n: int) -> dict[str, Any]:
    """What Gloo lacks or leaves unspecified: reduce with AVG, the other ranks' tensors after
    a reduce (hora leaves them as they were), bfloat16 messages."""
    import torch.distributed as dist

    t = torch.full((4,), float(r))
    dist.reduce(t, dst=0, op=dist.ReduceOp.AVG)
    want = (n - 1) / 2 if r == 0 else float(r)
    torch.testing.assert_close(t, torch.full((4,), want))
    h = torch.full((3,), r + 0.5, dtype=torch.bfloat16)
    got = torch.zeros(3, dtype=torch.bfloat16)
    works = [dist.isend(h, (r + 1) % n), dist.irecv(got, (r - 1) % n)]
    for w in works:
        w.wait()
    torch.testing.assert_close(got, torch.full((3,), (r - 1) % n + 0.5, dtype=torch.bfloat16))
    return {"analytic": "ok"}


def battery(rank: int, where: str) -> dict[str, Any]:
    import torch.distributed as dist

    import hora.torch as hvd
    import hora.torch.distributed  # noqa: F401

    torch.set_num_threads(1)
    n = int(os.environ["HORA_SIZE"])
    dist.init_process_group(backend="hora")
    try:
        hora_runs = runs(rank, n, where, "hora")
        result = analytic(rank, n)
    except Exception:
        return {"hora": traceback.format_exc()}
    port = hvd.broadcast_object(free_port() if rank == 0 else None, 0)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)  # fmt: skip
    gloo_runs = runs(rank, n, where, "gloo")
    dist.destroy_process_group()
    result["compare"] = compare(hora_runs, gloo_runs)
    return result



def compare(hora_runs: dict[str, Any], gloo_runs: dict[str, Any]) -> dict[str, str]:
    verdict = {}
    for key, want in gloo_runs.items():
        try:
            got = hora_runs[key] if key != "dcp.cross" else gloo_runs["dcp.loaded"]
            assert len(got) == len(want), f"{len(got)} values against {len(want)}"
            for g, w in zip(got, want):
                if isinstance(w, torch.Tensor):
                    torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
                else:
                    assert g == w, f"{g!r} != {w!r}"
            verdict[key] = "ok"
        except Exception as e:  # noqa: BLE001 - reported per key
            verdict[key] = f"{type(e).__name__}: {e}"
    return verdict


KEYS = ["reduce.SUM", "reduce.MAX", "gather.0", "gather.last", "scatter", "gather_object",
        "scatter_object_list", "isend_irecv.tags", "batch_isend_irecv", "send_recv.large",
        "recv_any", "new_group.send_recv"]  # fmt: skip
CLIENT_KEYS = ["dcp.trained", "dcp.loaded", "dcp.cross", "pipeline"]


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"np{n}")
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    n = request.param
    where = str(tmp_path_factory.mktemp("dcp"))
    return n, run_ranks(battery, n, args=(where,), timeout=200)


def _check(n: int, per_rank: list[Any], key: str) -> None:
    for rank, res in enumerate(per_rank):
        assert "hora" not in res, f"rank {rank} failed on backend hora:\n{res['hora']}"
        verdict = res["compare"].get(key)
        assert verdict == "ok", f"np={n} rank {rank} {key}: {verdict}"


@pytest.mark.timeout(260)
@pytest.mark.parametrize("key", KEYS)
def test_same_results_as_gloo(job: Any, key: str) -> None:
    n, per_rank = job
    key = key.replace(".last", f".{n - 1}")
    if key == "new_group.send_recv":
        per_rank = [per_rank[0], per_rank[-1]]
    _check(n, per_rank, key)


@pytest.mark.timeout(260)
def test_reduce_avg_other_ranks_and_bfloat16(job: Any) -> None:
    n, per_rank = job
    for rank, res in enumerate(per_rank):
        assert res.get("analytic") == "ok", f"np={n} rank {rank}: {res}"


@pytest.mark.timeout(260)
@pytest.mark.parametrize("key", CLIENT_KEYS)
def test_checkpoint_and_pipelining_as_on_gloo(job: Any, key: str) -> None:
    n, per_rank = job
    if n != 2:
        pytest.skip("run at np=2: one FSDP2 checkpoint and one two-stage pipeline")
    _check(n, per_rank, key)


# -- failures -------------------------------------------------------------------------------
def faults(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    import hora.torch.distributed  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(backend="hora")
    out: dict[str, Any] = {}

    def attempt(key: str, fn: Any) -> None:
        try:
            fn()
            out[key] = "no error"
        except Exception as e:  # noqa: BLE001
            out[key] = (type(e).__name__, str(e))

    if rank < 2:  # a receive one element short: both ends raise
        other = 1 - rank
        attempt("size", lambda: (dist.send(torch.ones(4), other) if rank == 0
                                 else dist.recv(torch.zeros(3), other)))  # fmt: skip
        # the same from any sender: rank 0 takes rank 1's message (rank 2 sends none)
        attempt("any_size", lambda: (dist.recv(torch.zeros(3)) if rank == 0
                                     else dist.send(torch.ones(4), 0)))  # fmt: skip
    attempt("root", lambda: dist.reduce(torch.ones(2), dst=min(rank, 1)))
    attempt("shape", lambda: dist.gather(torch.ones(rank + 1),
                                         [torch.zeros(1)] * 3 if rank == 0 else None))
    # a root whose scatter_list does not fit: it raises, and the others do not wait for it
    attempt("scatter_list", lambda: dist.scatter(torch.zeros(2), [torch.zeros(3)] * 3
                                                 if rank == 0 else None, src=0))  # fmt: skip
    t = torch.ones(3)
    dist.all_reduce(t)
    out["after"] = t.tolist()
    if rank == 1:  # one message from rank 2 arrives, the next never does
        dist.recv(torch.zeros(2), 2)
    if rank == 2:
        dist.send(torch.ones(2), 1)
        time.sleep(0.5)
        os._exit(3)
    start = time.monotonic()
    peer = 2 if rank == 1 else 1  # rank 1: its link to rank 2 closes; rank 0: the engine ends
    attempt("killed", lambda: dist.recv(torch.zeros(2), peer))
    out["killed.seconds"] = time.monotonic() - start
    return out


@pytest.mark.timeout(150)
def test_mismatches_and_a_lost_peer_raise_on_every_rank() -> None:
    results = spawn_ranks(faults, 3, timeout=120)
    assert results[2].returncode == 3, results[2].stderr[-2000:]
    for res in results[:2]:
        assert res.ok, f"rank {res.rank}: {res.status}\n{res.value}\n{res.stderr[-3000:]}"
        got = res.value
        kind, text = got["size"]
        assert kind == "DistBackendError", got["size"]
        assert "rank 1 receives 12 bytes" in text and "rank 0 sent 16 bytes" in text, text
        kind, text = got["any_size"]
        assert kind == "DistBackendError", got["any_size"]
        assert "rank 0 receives 12 bytes" in text and "rank 1 sent 16 bytes" in text, text
        kind, text = got["root"]
        assert "root rank" in text and "rank 0" in text and "rank 1" in text, got["root"]
        kind, text = got["shape"]
        assert "shape" in text and "rank 0" in text, got["shape"]
        kind, text = got["scatter_list"]
        if res.rank == 0:
            assert kind == "ValueError" and "scatter_list holds [3, 3, 3] elements" in text, text
        else:
            assert kind == "DistBackendError", got["scatter_list"]
            assert "the root, rank 0, gave pieces that do not fit" in text, text
        assert got["after"] == [3.0, 3.0, 3.0]
        kind, text = got["killed"]
        assert kind == "DistBackendError", got["killed"]
        assert "rank 2" in text, text
    print("seconds to raise after rank 2 died:",
          [round(r.value["killed.seconds"], 2) for r in results[:2]])


def long_waits(rank: int) -> str:
    import torch.distributed as dist

    import hora.torch.distributed  # noqa: F401

    dist.init_process_group(backend="hora")
    if rank == 0:
        t = torch.zeros(2)
        dist.recv(t, 1, tag=7)  # rank 1 sends it late
        time.sleep(2.5)
        dist.recv(t, 1, tag=8)  # rank 1 sent it long ago
    else:
        time.sleep(2.5)
        dist.send(torch.ones(2), 0, tag=7)
        dist.send(torch.ones(2), 0, tag=8)
    dist.barrier()
    return "ok"


@pytest.mark.timeout(90)
def test_a_long_wait_for_a_message_is_reported_on_both_sides() -> None:
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1"}
    results = spawn_ranks(long_waits, 2, timeout=60, env=env)
    for res in results:
        assert res.ok and res.value == "ok", f"rank {res.rank}: {res.status}\n{res.stderr[-3000:]}"
    receiver, sender = results[0].stderr, results[1].stderr
    assert re.search(r"rank 0 has waited \d s to receive a message from rank 1 \(tag 7\)",
                     receiver), receiver[-3000:]  # fmt: skip
    assert re.search(r"rank 1's message to rank 0 \(tag 8\) has waited \d s", sender), sender
    assert "check both ranks' calls" in receiver
    # each wait is reported once, and the short ones not at all
    assert receiver.count("to receive a message") == 1, receiver[-3000:]
    assert sender.count("has waited") == 1, sender[-3000:]
