"""``priority=``: among the tensors ready in one cycle, higher priority is decided and executed
first; the priority travels on the wire and is part of the cache key."""

from __future__ import annotations

from typing import Any

import pytest

from hora.core.controller import Coordinator
from hora.core.messages import OpType, Request, TensorSpec, bits_encode


def _coord(fusion: int = 1 << 20) -> Coordinator:
    c = Coordinator(fusion, 16)
    c.add_set(0, [0, 1])
    return c


def _send(c: Coordinator, rank: int, *reqs: Request) -> None:
    c.on_message(rank, {"ps": 0, "ep": 0, "r": [r.to_wire() for r in reqs], "h": bits_encode([])})


def _ar(name: str, dtype: str = "float32", **kw: Any) -> Request:
    return Request(OpType.ALLREDUCE, f"allreduce.{name}", dtype, (4,), **kw)


def _order(c: Coordinator) -> list[list[str]]:
    [(_, responses)] = c.take_responses()
    return [r.names for r in responses]


@pytest.mark.parametrize("fusion", [0, 1 << 20])
def test_without_priorities_ready_order_is_kept(fusion: int) -> None:
    c = _coord(fusion)
    for rank in (0, 1):
        _send(c, rank, _ar("a", "float32"), _ar("b", "float64"), _ar("c", "int32"))
    assert _order(c) == [["allreduce.a"], ["allreduce.b"], ["allreduce.c"]]


def test_higher_priority_is_executed_first_in_a_cycle() -> None:
    c = _coord()
    for rank in (0, 1):
        _send(
            c,
            rank,
            _ar("a", "float32", priority=1),
            _ar("b", "float64"),
            _ar("c", "int32", priority=7),
        )
    assert _order(c) == [["allreduce.c"], ["allreduce.a"], ["allreduce.b"]]


def test_priority_orders_tensors_inside_a_fused_buffer() -> None:
    c = _coord()
    for rank in (0, 1):
        _send(c, rank, _ar("a"), _ar("b", priority=-2), _ar("c", priority=3))
    assert _order(c) == [["allreduce.c", "allreduce.a", "allreduce.b"]]


def test_priority_travels_on_the_wire_and_keys_the_cache() -> None:
    req = _ar("a", priority=5)
    back = Request.from_wire(req.to_wire())
    assert back.priority == 5 and back.key() == req.key()
    assert len(_ar("a").to_wire()) == 12  # a request without priority keeps its old form
    assert Request.from_wire(_ar("a").to_wire()).priority == 0
    assert _ar("a", priority=1).key() != _ar("a").key()
    spec = TensorSpec.from_wire(TensorSpec(req).to_wire())
    assert spec.request.priority == 5


def test_priority_must_be_an_int() -> None:
    import numpy as np

    from hora.frameworks import ops

    for bad in (1.5, "high", True):
        with pytest.raises(TypeError, match="priority must be an int"):
            ops.allreduce_async(np.ones(2), priority=bad)


def test_optimizer_priority_forms() -> None:
    import torch

    from hora.torch.optimizer import _priorities

    params = [torch.zeros(1), torch.zeros(2), torch.zeros(3)]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    forward = _priorities("forward", params, names)
    assert [forward[p] for p in params] == [3, 2, 1]
    given = _priorities({"p1": 5}, params, names)
    assert [given[p] for p in params] == [0, 5, 0]
    by_fn = _priorities(lambda n: int(n[1:]) * 2, params, names)
    assert [by_fn[p] for p in params] == [0, 2, 4]
    with pytest.raises(ValueError, match="lacks: \\['nope'\\]"):
        _priorities({"nope": 1}, params, names)
    with pytest.raises(TypeError, match="priority must be 'forward'"):
        _priorities("backward", params, names)
