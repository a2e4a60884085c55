"""Horovod scripts unchanged, in real multi-process jobs: the blocking, differentiable ops and
their Function classes imported from horovod.torch.mpi_ops (under `hora run --as-horovod`), and
duplicate process sets raising ValueError as Horovod's do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness import run_ranks

ROOT = Path(__file__).parents[2]
SRC = str(ROOT / "src")
HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]

SCRIPT = """
import torch
from horovod.torch.mpi_ops import (HorovodAllreduce, allgather, allreduce, broadcast,
                                   grouped_allreduce, init, rank, reducescatter, size)
import horovod.torch as hvd

init()
x = torch.tensor([float(rank() + 1)] * 2, requires_grad=True)
total = allreduce(x, op=hvd.Sum)
total.sum().backward()
gathered = allgather(torch.tensor([[float(rank())]]))
root = broadcast(torch.tensor([float(rank() + 5)]), root_rank=1)
pair = grouped_allreduce([torch.ones(1), torch.ones(2)], op=hvd.Sum)
scattered = reducescatter(torch.arange(4.0), op=hvd.Sum)
direct = HorovodAllreduce.apply(torch.tensor([2.0]), None, "direct", hvd.Sum, 1.0, 1.0,
                                hvd.global_process_set)
print("mpi_ops", rank(), size(), total.tolist(), x.grad.tolist(), gathered.flatten().tolist(),
      root.tolist(), [t.tolist() for t in pair], scattered.tolist(), direct.tolist(), sep="|")
"""


def _env(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    return {**clean, "PYTHONPATH": SRC, **extra}


@pytest.mark.timeout(150)
def test_blocking_ops_from_horovod_torch_mpi_ops_under_as_horovod(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [*HORA, "run", "-np", "2", "--as-horovod", sys.executable, str(script)],
        capture_output=True, text=True, env=_env(), timeout=140, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(ln.split(":", 1)[1] for ln in done.stdout.splitlines() if "mpi_ops|" in ln)
    assert len(lines) == 2, done.stdout + done.stderr
    for r, line in enumerate(lines):
        fields = line.split("|")
        assert fields[1:3] == [str(r), "2"]
        assert fields[3] == "[3.0, 3.0]"  # 1 + 2
        assert fields[4] == "[2.0, 2.0]"  # the gradient of a Sum is Sum-reduced: 1 + 1
        assert fields[5] == "[0.0, 1.0]"
        assert fields[6] == "[6.0]"
        assert fields[7] == "[[2.0], [2.0, 2.0]]"
        assert fields[8] == ("[0.0, 2.0]" if r == 0 else "[4.0, 6.0]")
        assert fields[9] == "[4.0]"


def _process_sets(rank: int) -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    out: dict[str, Any] = {}
    sets = [hvd.ProcessSet([0]), hvd.ProcessSet([1]), hvd.ProcessSet([0]),
            hvd.ProcessSet([1, 0])]  # fmt: skip
    try:
        hvd.init(process_sets=sets)
        out["init"] = "no error"
    except Exception as e:
        out["init"] = type(e).__name__
        out["init_message"] = str(e)
    out["initialized"] = hvd.is_initialized()
    out["ids"] = [ps.process_set_id for ps in sets]
    out["sum_in_first"] = hvd.allreduce(
        torch.tensor([1.0]),
        op=hvd.Sum, process_set=sets[rank],
    ).tolist()  # fmt: skip

    # init again with the sets of a valid list: bound to those registered, as in Horovod
    again = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]
    hvd.init(process_sets=again)
    out["again_ids"] = [ps.process_set_id for ps in again]

    # out of range: ValueError
    try:
        hvd.init(process_sets=[hvd.ProcessSet([0, 5])])
        out["range"] = "no error"
    except Exception as e:
        out["range"] = type(e).__name__
    hvd.barrier()  # no rank shuts down (ending the job) while another is still checking
    hvd.shutdown()
    return out


def _dynamic_sets(rank: int) -> dict[str, Any]:
    import hora.torch as hvd

    out: dict[str, Any] = {}
    hvd.init()
    added = hvd.add_process_set([0])
    errors = []
    for attempt in ([0], hvd.ProcessSet([0]), [0, 1]):
        try:
            hvd.add_process_set(attempt)
            errors.append("no error")
        except Exception as e:
            errors.append(type(e).__name__)
    out["add"] = errors
    out["removed"] = hvd.remove_process_set(added)
    out["added_again"] = hvd.add_process_set([0]).process_set_id is not None
    hvd.shutdown()
    return out


@pytest.mark.timeout(150)
def test_duplicate_process_sets_raise_value_error() -> None:
    results = run_ranks(_process_sets, 2, timeout=120)
    dynamic = run_ranks(_dynamic_sets, 2, timeout=120, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    for out, more in zip(results, dynamic):
        out.update(more)
        assert out["init"] == "ValueError", out
        assert "entry number 2" in out["init_message"] and "entry number 3" in out["init_message"]
        assert out["initialized"] is True
        ids = out["ids"]
        assert ids[0] is not None and ids[1] is not None and ids[2:] == [None, None], out
        assert out["sum_in_first"] == [1.0]
        assert out["again_ids"] == ids[:2]
        assert out["range"] == "ValueError"
        assert out["add"] == ["ValueError", "ValueError", "ValueError"], out
        assert out["removed"] is True and out["added_again"] is True
