"""What ranks tell the coordinator, and what it answers.

A :class:`Request` is one rank's description of one tensor operation. The coordinator
(global rank 0) collects requests from every member of a process set, checks that they agree,
and answers with a :class:`Response` list in one total order that every rank executes in turn.
A :class:`TensorSpec` is the negotiated description of one tensor: the request of the first rank
plus what differs per rank (allgather's first dimensions, alltoall's split matrix). Specs are
what the response cache stores.

Messages travel as JSON, the steady state's two kinds in a compact binary form (never pickle:
a malformed frame can only fail to parse). Pure data; safe from any thread.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any

from hora.dtypes import itemsize


class OpType(IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    ADASUM = 5
    BARRIER = 6
    JOIN = 7
    ADD_PROCESS_SET = 8
    REMOVE_PROCESS_SET = 9
    ERROR = 10
    DIRECT = 11  # the coordinator's word that members agree on cached work themselves


# The responses that are worth caching: the ones training repeats every step.
CACHEABLE = frozenset(
    {
        OpType.ALLREDUCE,
        OpType.ALLGATHER,
        OpType.ADASUM,
        OpType.ALLTOALL,
        OpType.BROADCAST,
        OpType.REDUCESCATTER,
    }
)
FUSIBLE = frozenset({OpType.ALLREDUCE, OpType.REDUCESCATTER})


@dataclass(slots=True)
class Request:
    op: OpType
    name: str
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    root: int = -1  # broadcast: global root rank
    reduce_op: int = 1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] | None = None  # alltoall rows per destination
    group: str = ""  # grouped ops: the group's key
    group_size: int = 0
    ranks: tuple[int, ...] | None = None  # process-set ops: the set's ranks
    priority: int = 0  # higher goes first among the tensors ready in one cycle
    # Worked out once: the name without its op prefix (see ``match``), and on first use the
    # byte count and the cache key. A request is not changed once it has been submitted.
    _match: str = field(default="", init=False, repr=False, compare=False)
    _nbytes: int = field(default=-1, init=False, repr=False, compare=False)
    _key: tuple[Any, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._match = self.name.split(".", 1)[-1]

    def to_wire(self) -> list[Any]:
        return [
            int(self.op),
            self.name,
            self.dtype,
            list(self.shape),
            self.root,
            self.reduce_op,
            self.prescale,
            self.postscale,
            None if self.splits is None else list(self.splits),
            self.group,
            self.group_size,
            None if self.ranks is None else list(self.ranks),
        ] + ([self.priority] if self.priority else [])

    @staticmethod
    def from_wire(w: list[Any]) -> Request:
        (op, name, dtype, shape, root, reduce_op, pre, post, splits, group, gsize, ranks) = w[:12]
        return Request(
            OpType(op),
            str(name),
            str(dtype),
            tuple(int(d) for d in shape),
            int(root),
            int(reduce_op),
            float(pre),
            float(post),
            None if splits is None else tuple(int(s) for s in splits),
            str(group),
            int(gsize),
            None if ranks is None else tuple(ranks),
            int(w[12]) if len(w) > 12 else 0,
        )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if self._nbytes < 0:
            self._nbytes = self.numel * itemsize(self.dtype)
        return self._nbytes

    @property
    def match(self) -> str:
        """The name without its op prefix: what ranks must agree on.

        ``allreduce.grad`` on one rank and ``allgather.grad`` on another are the same tensor
        asked for with different operations: a mismatch to report, not two tensors to wait for.
        """
        return self._match

    def key(self) -> tuple[Any, ...]:
        """Everything that must match for a cached response to serve this request again."""
        if not self._key:
            self._key = self._make_key()
        return self._key

    def _make_key(self) -> tuple[Any, ...]:
        return (
            self.op,
            self.dtype,
            self.shape,
            self.root,
            self.reduce_op,
            self.prescale,
            self.postscale,
            self.splits,
            self.group,
            self.group_size,
            self.priority,
        )


@dataclass(slots=True)
class TensorSpec:
    """One negotiated tensor: the first rank's request plus per-rank data."""

    request: Request
    first_dims: list[int] | None = None  # allgather: dim 0 per set rank
    split_matrix: list[list[int]] | None = None  # alltoall: rows sent by rank i to rank j

    def request_for(self, set_rank: int) -> Request:
        """The request that rank ``set_rank`` made (used to resolve its cache hits)."""
        req = self.request
        if self.first_dims is not None:
            shape = (self.first_dims[set_rank],) + req.shape[1:]
            return _replace(req, shape=shape)
        if self.split_matrix is not None:
            row = tuple(self.split_matrix[set_rank])
            return _replace(req, splits=row, shape=(sum(row),) + req.shape[1:])
        return req

    def to_wire(self) -> list[Any]:
        return [self.request.to_wire(), self.first_dims, self.split_matrix]

    @staticmethod
    def from_wire(w: list[Any]) -> TensorSpec:
        return TensorSpec(Request.from_wire(w[0]), w[1], w[2])


def _replace(req: Request, **kw: Any) -> Request:
    vals = {f.name: getattr(req, f.name) for f in fields(Request) if f.init}
    vals.update(kw)
    return Request(**vals)


@dataclass(slots=True)
class Response:
    op: OpType
    specs: list[TensorSpec] = field(default_factory=list)
    error: str = ""
    last_joined: int = -1
    process_set_id: int = 0  # for ADD_PROCESS_SET: the id assigned
    threshold: int = 0  # for DIRECT: the fusion threshold members fuse with

    @property
    def names(self) -> list[str]:
        return [s.request.name for s in self.specs]


def table_key(req: Request) -> str:
    """Where a member keeps a submitted request until it runs."""
    if req.op == OpType.BARRIER:
        return "barrier"
    if req.op == OpType.JOIN:
        return "join"
    return str(req.match)


# --- wire messages -------------------------------------------------------------------------
# worker -> coordinator: {"t": "req", "ps": id, "ep": epoch, "r": [requests], "h": hitbits-hex}
#                        {"t": "shutdown"}
# coordinator -> worker: {"t": "resp", "ps": id, "l": [responses]}  {"t": "shutdown", "why": s}
#
# Most messages are JSON objects. The two that steady-state training sends every step go in a
# compact binary form that :func:`decode` turns back into the same dict (a JSON text always
# starts with "{", a binary one with its tag byte; neither is ever executed, only unpacked):
#   _HITS: a request message with no full requests: tag, ps, epoch, then the raw hit bit vector
#   _IDS:  a response list made only of cache ids without error or join data: tag, then
#          little-endian uint32s: ps, number of responses, and per response its op, the number
#          of ids and the ids

_HITS, _IDS = 1, 2
_HITS_HEAD = struct.Struct("<BIQ")
_U32, _U64 = 1 << 32, 1 << 64


def encode(msg: dict[str, Any]) -> bytes:
    kind = msg.get("t")
    if kind == "req" and not msg["r"] and len(msg) == 5:
        ps, ep = msg["ps"], msg["ep"]
        if _plain_int(ps, _U32) and _plain_int(ep, _U64):
            return _HITS_HEAD.pack(_HITS, ps, ep) + bytes.fromhex(msg["h"])
    elif kind == "resp" and len(msg) == 3:
        words = _ids_words(msg["ps"], msg["l"])
        if words is not None:
            return bytes((_IDS,)) + struct.pack(f"<{len(words)}I", *words)
    return json.dumps(msg, separators=(",", ":")).encode()


def _plain_int(v: Any, bound: int) -> bool:
    return type(v) is int and 0 <= v < bound


def _ids_words(ps: Any, responses: list[Any]) -> list[int] | None:
    """The uint32 words of the binary form of a response list, or None if it has none."""
    if not _plain_int(ps, _U32):
        return None
    words = [ps, len(responses)]
    for resp in responses:
        op, entries, error, last_joined, ps_id = resp
        if error != "" or last_joined != -1 or ps_id != 0 or not _plain_int(op, _U32):
            return None
        if not all(_plain_int(e, _U32) for e in entries):
            return None
        words += (op, len(entries), *entries)
    return words


def decode(payload: bytes) -> dict[str, Any]:
    if payload[:1] in (b"\x01", b"\x02"):
        return _decode_binary(payload)
    try:
        msg = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed control message: {e}") from None
    if not isinstance(msg, dict) or "t" not in msg:
        raise ValueError("malformed control message: not an object with a type")
    return msg


def _decode_binary(payload: bytes) -> dict[str, Any]:
    if payload[0] == _HITS:
        if len(payload) < _HITS_HEAD.size:
            raise ValueError("malformed control message: truncated request")
        _, ps, ep = _HITS_HEAD.unpack_from(payload)
        return {"t": "req", "ps": ps, "ep": ep, "r": [], "h": payload[_HITS_HEAD.size :].hex()}
    body = memoryview(payload)[1:]
    if body.nbytes % 4 or body.nbytes < 8:
        raise ValueError("malformed control message: truncated response list")
    words = struct.unpack(f"<{body.nbytes // 4}I", body)
    responses, i = [], 2
    for _ in range(words[1]):
        if i + 2 > len(words) or i + 2 + words[i + 1] > len(words):
            raise ValueError("malformed control message: truncated response list")
        end = i + 2 + words[i + 1]
        responses.append([words[i], list(words[i + 2 : end]), "", -1, 0])
        i = end
    if i != len(words):
        raise ValueError("malformed control message: trailing data after the response list")
    return {"t": "resp", "ps": words[0], "l": responses}


def bits_encode(ids: list[int]) -> str:
    """Cache ids as a hex bit vector: the fast path's whole message."""
    if not ids:
        return ""
    n = max(ids) + 1
    buf = bytearray((n + 7) // 8)
    for i in ids:
        buf[i >> 3] |= 1 << (i & 7)
    return buf.hex()


def bits_decode(text: str) -> list[int]:
    buf = bytes.fromhex(text)
    return [i * 8 + b for i, byte in enumerate(buf) if byte for b in range(8) if byte >> b & 1]
