"""The op surface's submission to the engine in one process (a world of one): requests reused
for a named op submitted again as before, results handed back as they are when nothing
converts them, and blocking forms keeping their handles out of the int handle table."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hora as hvd
from hora.core.messages import OpType, Request
from hora.frameworks import submit


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    """A world of one whose ops go through the engine (a set of one runs them itself
    otherwise: tests/integration/test_world_of_one.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HORA_LOCAL_SETS", "0")
        hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture
def submitted(world: None, monkeypatch: pytest.MonkeyPatch) -> list[Request]:
    """The requests the engine receives (the real engine, watched)."""
    from hora.core.runtime import runtime

    engine = runtime().engine
    seen: list[Request] = []
    real = engine.enqueue

    def watch(ps_id: int, entries: list[Any], inline: bool = False) -> Any:
        seen.extend(e.spec_request for e in entries)
        return real(ps_id, entries, inline)

    monkeypatch.setattr(engine, "enqueue", watch)
    return seen


def test_a_named_op_submitted_again_reuses_its_request(submitted: list[Request]) -> None:
    x = np.arange(6, dtype=np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(hvd.allreduce(x, name="reuse", op=hvd.Sum), x)
    assert submitted[0] is submitted[1] is submitted[2]
    assert submitted[0].name == "allreduce.reuse" and submitted[0].shape == (6,)


@pytest.mark.parametrize(
    "change",
    [
        {"x": np.zeros(7, np.float32)},
        {"x": np.zeros(6, np.float64)},
        {"prescale_factor": 2.0},
        {"postscale_factor": 0.5},
        {"op": hvd.Average},
        {"op": hvd.Adasum},
        {"priority": 3},
    ],
    ids=["shape", "dtype", "prescale", "postscale", "op", "adasum", "priority"],
)
def test_anything_that_changes_the_request_makes_a_new_one(
    submitted: list[Request], change: dict[str, Any]
) -> None:
    kw: dict[str, Any] = {"op": hvd.Sum, "prescale_factor": 1.0, "postscale_factor": 1.0}
    x = kw.pop("x", np.zeros(6, np.float32))
    hvd.allreduce(x, name="changed", **kw)
    other = {**kw, **change}
    y = other.pop("x", x)
    hvd.allreduce(y, name="changed", **other)
    first, second = submitted
    assert first is not second
    assert second.op == (OpType.ADASUM if change.get("op") == hvd.Adasum else OpType.ALLREDUCE)
    assert (second.shape, second.dtype, second.prescale, second.postscale, second.priority) == (
        y.shape, str(y.dtype), float(other["prescale_factor"]),
        float(other["postscale_factor"]), other.get("priority", 0),
    )  # fmt: skip


def test_a_reused_request_still_takes_what_the_call_says(submitted: list[Request]) -> None:
    """A named array submitted again finds its request before anything is checked or named
    (submit._plain); what that lookup does not cover still goes the long way."""
    x = np.arange(12, dtype=np.int16)
    hvd.allreduce(x[:6], name="again", op=hvd.Sum)
    hvd.allreduce(x[:6], name="again", op=hvd.Sum)
    assert submitted[0] is submitted[1] and submitted[0].dtype == "int16"
    with pytest.raises(ValueError, match="contiguous"):  # the same shape, strided
        hvd.allreduce(x[::2], name="again", op=hvd.Sum)
    hvd.allreduce(x[:6], name="again", op=hvd.Sum, dtype="bfloat16")  # int16 storage
    hvd.allreduce(x[:6].view(np.uint16), name="again", op=hvd.Sum)
    assert [r.dtype for r in submitted[2:]] == ["bfloat16", "uint16"]
    hvd.allreduce(x[:6], name="again", op=hvd.Sum)
    assert submitted[4] is submitted[0]


def test_unnamed_ops_are_named_anew_each_time(submitted: list[Request]) -> None:
    x = np.ones(3, np.float32)
    hvd.allreduce(x)
    hvd.allreduce(x)
    assert submitted[0].name != submitted[1].name


def test_grouped_requests_are_reused_with_their_group(submitted: list[Request]) -> None:
    xs = [np.ones(2, np.float32), np.ones(5, np.float32)]
    for _ in range(2):
        out = hvd.grouped_allreduce(xs, name="grp", op=hvd.Sum)
        assert isinstance(out, list) and len(out) == 2
    assert submitted[0] is submitted[2] and submitted[1] is submitted[3]
    assert submitted[0].group == submitted[1].group == "allreduce.grp_0of2"
    assert submitted[0].group_size == 2


def test_a_converted_result_still_comes_back_in_the_users_dtype(world: None) -> None:
    x = np.array([0x3F80, 0x4000], dtype=np.int16)  # bfloat16 1.0 and 2.0 in int16 storage
    out = hvd.allreduce(x, name="bf16", dtype="bfloat16", op=hvd.Sum)
    assert out.dtype == np.int16 and out.tolist() == [0x3F80, 0x4000]


def test_only_async_handles_get_an_int(world: None) -> None:
    before = set(submit._handles._handles)
    hvd.allreduce(np.ones(2, np.float32), name="blocking")
    assert set(submit._handles._handles) == before  # nothing left, nothing added
    h = hvd.allreduce_async(np.ones(2, np.float32), name="async")
    assert int(h) in submit._handles._handles
    np.testing.assert_array_equal(hvd.synchronize(int(h)), np.ones(2, np.float32))
    assert int(h) not in submit._handles._handles
