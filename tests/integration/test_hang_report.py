"""The one-shot hang report: rank 0 names the waiting op, the missing rank and where in its
Python code that rank is, once; with a stall shutdown time the job ends with the report."""

from __future__ import annotations

import pytest

from harness import spawn_ranks


def _hang(rank: int, shutdown: bool) -> str:
    import time

    import numpy as np

    import hora as hvd

    hvd.init()
    if rank == 1:

        def stuck_in_data_loading() -> None:
            time.sleep(6.0 if shutdown else 4.0)

        stuck_in_data_loading()
    try:
        hvd.allreduce(np.ones(4), name="grad.fc1")
        out = "completed"
    except Exception as e:  # the stall shutdown fails the pending op on every rank
        from hora.errors import HoraInternalError

        kind = "HoraInternalError" if isinstance(e, HoraInternalError) else "not HoraInternalError"
        out = f"{kind} ({type(e).__name__}): {e}"
    if not shutdown:
        hvd.shutdown()
    return out


def _check_report(text: str) -> None:
    assert "hora hang report: 1 operation(s) waiting for more than 1 s." in text
    assert (
        "allreduce.grad.fc1 (ALLREDUCE, process set 0): submitted by ranks [0], not by [1]" in text
    )
    assert "rank 1 (has not submitted 1 of them): Python stack of each thread" in text
    assert "in stuck_in_data_loading" in text and "Thread MainThread" in text


@pytest.mark.timeout(120)
def test_hang_report_is_logged_once_with_the_missing_ranks_stack() -> None:
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "0"}
    results = spawn_ranks(_hang, 2, args=(False,), timeout=90, env=env)
    assert [r.value for r in results] == ["completed", "completed"], results[0].stderr
    log = results[0].stderr
    _check_report(log)
    assert log.count("hora hang report") == 1  # once, though the stall warning repeats
    assert "hora hang report" not in results[1].stderr


@pytest.mark.timeout(120)
def test_stall_shutdown_ends_the_job_with_the_report() -> None:
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "2"}
    results = spawn_ranks(_hang, 2, args=(True,), timeout=90, env=env)
    error = results[0].value
    assert error.startswith("HoraInternalError (ShutDownError)"), error
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in error
    _check_report(error)
    assert "hora hang report" in results[1].value  # rank 1's op fails with the same cause
