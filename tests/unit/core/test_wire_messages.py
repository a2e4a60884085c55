"""Control messages: the compact binary forms decode to exactly what the JSON form would."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hora.core.messages import bits_encode, decode, encode


def _json(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    "msg",
    [
        {"t": "req", "ps": 0, "ep": 7, "r": [], "h": bits_encode([0, 3, 17])},
        {"t": "req", "ps": 3, "ep": (1 << 64) - 1, "r": [], "h": ""},
        {"t": "resp", "ps": 0, "l": [[0, [1, 2, 3], "", -1, 0], [4, [9], "", -1, 0]]},
        {"t": "resp", "ps": 2, "l": []},
    ],
)
def test_steady_state_messages_are_binary_and_round_trip(msg: dict[str, Any]) -> None:
    data = encode(msg)
    assert data[:1] in (b"\x01", b"\x02")
    assert len(data) < len(_json(msg))
    assert decode(data) == msg


@pytest.mark.parametrize(
    "msg",
    [
        {"t": "req", "ps": 0, "ep": 1, "r": [[0, "allreduce.a"]], "h": ""},
        {"t": "req", "ps": 0, "ep": 1 << 64, "r": [], "h": ""},
        {"t": "resp", "ps": 0, "l": [[0, [[["x"], None, None]], "", -1, 0]]},
        {"t": "resp", "ps": 0, "l": [[10, [1], "boom", -1, 0]]},
        {"t": "resp", "ps": 0, "l": [[7, [], "", 1, 0]]},
        {"t": "resp", "ps": 0, "l": [[8, [2], "", -1, 4]]},
        {"t": "resp", "ps": 0, "l": [[0, [True], "", -1, 0]]},
        {"t": "shutdown"},
        {"t": "abort", "why": "rank 1 failed"},
    ],
)
def test_other_messages_stay_json(msg: dict[str, Any]) -> None:
    assert encode(msg) == _json(msg)
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "payload",
    [
        b"\x01\x00",
        b"\x02\x00\x00\x00",
        b"\x02" + (0).to_bytes(4, "little") + (1).to_bytes(4, "little"),
        b"\x02" + b"".join(n.to_bytes(4, "little") for n in (0, 1, 0, 5, 1)),
        b"\x02" + b"".join(n.to_bytes(4, "little") for n in (0, 0, 9)),
        b"\x03junk",
        b"",
        b"[1]",
    ],
)
def test_malformed_payloads_raise_value_error(payload: bytes) -> None:
    with pytest.raises(ValueError, match="malformed control message"):
        decode(payload)


def test_a_requests_derived_values_are_worked_out_once_and_right() -> None:
    from hora.core.messages import OpType, Request, TensorSpec

    req = Request(OpType.ALLGATHER, "allgather.x", "bfloat16", (3, 5))
    assert req.nbytes == 3 * 5 * 2 and req.nbytes == 30  # the second read is the cached one
    assert req.key() is req.key()
    assert req.key() == Request(OpType.ALLGATHER, "allgather.x", "bfloat16", (3, 5)).key()
    # another rank's view of the same spec: a new request, with its own byte count and key
    other = TensorSpec(req, first_dims=[3, 7]).request_for(1)
    assert other.shape == (7, 5) and other.nbytes == 70
    assert other.key() != req.key()
    with pytest.raises(TypeError):
        _ = Request(OpType.ALLREDUCE, "allreduce.y", "no-such-dtype", (2,)).nbytes
