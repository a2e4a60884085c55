"""TensorFlow tensors in and out of the op surface: one bridge for eager mode and both graphs.

``bridge(fn, inputs, ...)`` runs ``fn(name, *arrays) -> arrays`` (a blocking call into
``hora.frameworks.ops``) as one collective, in the way that cannot deadlock in each mode:

- **Eager**: called at once in the caller's thread on NumPy views of the tensors (no copy);
  results become tensors through DLPack (no copy either).
- **tf.function**: one stateful ``tf.numpy_function`` node. TensorFlow's automatic control
  dependencies run a function's stateful nodes in program order, so every rank blocks in its
  collectives in the same order.
- **TensorFlow 1 graphs** (``tf.compat.v1`` sessions): nothing orders independent nodes there,
  and a node that blocked an executor thread until its peers arrive could wait forever for a
  peer whose threads are all blocked in other collectives. So the collective is split: a
  *submit* node copies the inputs into the node's mailbox and returns at once; the blocking call
  runs in the node's own ``tf.data`` reader thread (``IteratorGetNext`` waits without holding an
  executor thread); a *check* node raises the collective's error, or a result that belongs to an
  earlier, cancelled ``session.run``. Any number of independent collectives, in any order, with
  any size of inter-op thread pool, complete. (Inside TF1's own ``while_loop``/``cond`` a
  reader cannot be built; there the blocking form is used.)

Unnamed collectives in a graph are named after their graph node, as Horovod does, so the ranks
pair them by what they are, never by the order an executor happened to run them in; eager ones
take hora's per-process-set counter. Failures arrive as TensorFlow's error classes
(``hora.tensorflow.errors``). Thread-safe.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hora.tensorflow.errors import error_code, graph_message, make, translated

SUPPORTED = frozenset(
    {
        tf.uint8,
        tf.int8,
        tf.uint16,
        tf.int16,
        tf.int32,
        tf.int64,
        tf.float16,
        tf.bfloat16,
        tf.float32,
        tf.float64,
        tf.bool,
    }
)

Collective = Callable[..., Sequence[np.ndarray]]  # fn(name, *arrays) -> one array per output


def as_tensor(value: Any, what: str = "tensor") -> tf.Tensor:
    """``value`` (a tensor, variable, array or number) as a dense tensor of a wire dtype."""
    if isinstance(value, tf.IndexedSlices):
        raise TypeError(f"{what} is a tf.IndexedSlices; this op needs a dense tensor")
    t = tf.convert_to_tensor(value)
    if t.dtype not in SUPPORTED:
        raise TypeError(f"Tensor type {t.dtype.name} is not supported.")
    return t


def bridge(
    fn: Collective,
    inputs: Sequence[tf.Tensor],
    tout: Sequence[tf.DType],
    shapes: Sequence[Any],
    what: str,
    name: str | None = None,
    local: bool = False,
) -> list[tf.Tensor]:
    """Run ``fn(name, *arrays)`` as one collective; outputs get ``shapes`` (None: unknown).

    ``name`` is the op's name as the user gave it; None lets the mode pick one (see above).
    ``local``: ``fn`` never waits for other ranks (a rank or size query), so one plain node.
    """
    if tf.executing_eagerly():  # np.asarray views the tensor's buffer (.numpy() copies)
        results = _run(fn, name, [np.asarray(t) for t in inputs], tout)
        return [to_tensor(o, d) for o, d in zip(results, tout)]
    graph = tf.compat.v1.get_default_graph()
    if local or getattr(graph, "building_function", False) or _in_v1_control_flow(graph):
        outs = _blocking_node(fn, inputs, tout, what, name)
    else:
        outs = _split_nodes(fn, inputs, tout, what, name)
    for o, s in zip(outs, shapes):
        if s is not None:
            o.set_shape(s)
    return outs


def _run(
    fn: Collective, name: str | None, arrays: Sequence[np.ndarray], tout: Sequence[tf.DType],
    in_graph: bool = False,
) -> list[np.ndarray]:  # fmt: skip
    """Call the collective; its failure is raised as TensorFlow's error class for it (inside a
    graph with the message marked for elastic training)."""
    try:
        outs = fn(name, *arrays)
    except Exception as e:
        t = translated(e)
        if t is e:
            raise
        raise (make(error_code(e), graph_message(e)) if in_graph else t) from e
    return [np.asarray(o, dtype=d.as_numpy_dtype) for o, d in zip(outs, tout)]


def _in_v1_control_flow(graph: tf.Graph) -> bool:
    get = getattr(graph, "_get_control_flow_context", None)
    return get is not None and get() is not None


def _blocking_node(
    fn: Collective, inputs: Sequence[tf.Tensor], tout: Sequence[tf.DType], what: str,
    name: str | None,
) -> list[tf.Tensor]:  # fmt: skip
    node: list[str] = []  # the node's name, known once the node exists

    def call(*arrays: np.ndarray) -> list[np.ndarray]:
        return _run(fn, name or node[0], arrays, tout, in_graph=True)

    outs = tf.numpy_function(call, list(inputs), list(tout), stateful=True, name=f"Hora{what}")
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    node.append(outs[0].op.name)
    return outs


class _Mailbox:
    """One TF1 node's hand-over from its submit op (an executor thread) to its reader (a
    ``tf.data`` thread). Holds the newest submission: one left by a cancelled run is replaced,
    and the check op catches a result that was already under way for it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._item: tuple[int, list[np.ndarray]] | None = None

    def put(self, ticket: int, arrays: list[np.ndarray]) -> None:
        with self._cond:
            self._item = (ticket, arrays)
            self._cond.notify()

    def take(self) -> tuple[int, list[np.ndarray]]:
        with self._cond:
            while self._item is None:
                self._cond.wait()
            item, self._item = self._item, None
            return item


_tickets = itertools.count(1)
_READER_OPTIONS = tf.data.Options()
_READER_OPTIONS.experimental_optimization.apply_default_optimizations = False
_READER_OPTIONS.autotune.enabled = False


def _split_nodes(
    fn: Collective, inputs: Sequence[tf.Tensor], tout: Sequence[tf.DType], what: str,
    name: str | None,
) -> list[tf.Tensor]:  # fmt: skip
    box = _Mailbox()
    node: list[str] = []

    def submit(*arrays: np.ndarray) -> np.ndarray:
        ticket = next(_tickets)
        box.put(ticket, [np.array(a, copy=True) for a in arrays])  # TF frees its buffers
        return np.int64(ticket)

    def reader() -> Any:
        while True:  # never raises: a failure travels as (code, message) to the check op
            ticket, arrays = box.take()
            try:
                outs: list[np.ndarray] = _run(fn, name or node[0], arrays, tout)
                code, message = 0, b""
            except Exception as e:
                outs = [np.zeros([0], d.as_numpy_dtype) for d in tout]
                code, message = error_code(e), graph_message(e).encode()
            yield (np.int64(ticket), np.int32(code), message, *outs)

    ticket = tf.numpy_function(submit, list(inputs), tf.int64, stateful=True, name=f"Hora{what}")
    node.append(ticket.op.name)
    spec = (tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.string),
            *[tf.TensorSpec(None, d) for d in tout])  # fmt: skip
    with tf.control_dependencies([ticket]):
        dataset = tf.data.Dataset.from_generator(reader, output_signature=spec)
        got = tf.compat.v1.data.make_one_shot_iterator(dataset.with_options(_READER_OPTIONS))
        got_ticket, code, message, *outs = got.get_next(name=f"{ticket.op.name}_result")

    def check(sent: np.int64, received: np.int64, code: np.int32, message: bytes) -> np.int64:
        if code:
            raise make(int(code), message.decode(errors="replace"))
        if sent != received:
            stale = make(tf.errors.ABORTED, f"{what} {node[0]!r}: the result that arrived "
                         "belongs to an earlier session.run that was cancelled; run the step again")
            raise make(tf.errors.ABORTED, graph_message(stale))  # marked: arrives as Aborted
        return np.int64(0)

    ok = tf.numpy_function(check, [ticket, got_ticket, code, message], tf.int64, stateful=True,
                           name=f"{ticket.op.name}_check")  # fmt: skip
    with tf.control_dependencies([ok]):
        return [tf.identity(o) for o in outs]


ALIGN = 64  # bytes: the alignment TensorFlow's CPU kernels check


def aligned_empty(like: np.ndarray) -> np.ndarray:
    """An uninitialised array shaped and typed like ``like`` whose buffer is ALIGN-aligned, for
    results that ``to_tensor`` can then hand to TensorFlow without a copy."""
    nbytes = max(like.nbytes, 1)
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + like.nbytes].view(like.dtype).reshape(like.shape)


def to_tensor(array: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    """``array`` as an eager tensor, sharing its memory through DLPack where it can (an
    aligned result array that nothing else writes), else copied."""
    if (
        array.size
        and array.flags.c_contiguous
        and array.flags.writeable
        and array.ctypes.data % ALIGN == 0  # TensorFlow's kernels need aligned buffers
    ):
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except Exception:  # a dtype or layout DLPack does not carry: copy
            pass
    return tf.convert_to_tensor(array, dtype=dtype)


def rows_unknown(shape: tf.TensorShape) -> tf.TensorShape:
    """``shape`` with an unknown first dimension (the result of a gather or an exchange)."""
    if shape.rank is None:
        return shape
    if shape.rank == 0:
        return tf.TensorShape([None])
    return tf.TensorShape([None]).concatenate(shape[1:])
