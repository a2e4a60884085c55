"""hora's failures as TensorFlow's error classes, as Horovod's TensorFlow ops raise them.

==============================  ====================================  ===========================
what failed                     TensorFlow class (``tf.errors.``)     also an instance of
==============================  ====================================  ===========================
ranks disagree about an op      ``FailedPreconditionError``           ``hvd.HorovodInternalError``
hora shut down / engine gone    ``AbortedError``                      ``hvd.HorovodInternalError``
a peer or connection failed     ``UnknownError``                      ``hvd.HorovodInternalError``
a bad argument found at run     ``InvalidArgumentError``              ``ValueError``
==============================  ====================================  ===========================

The raised object is of both classes, so ``except tf.errors.OpError`` and
``except hvd.HorovodInternalError`` both catch it, in eager mode, inside ``tf.function`` and in
TF1 sessions. A Python function inside a graph (``tf.numpy_function``) can only fail with
TensorFlow's ``UnknownError`` (or ``InvalidArgumentError`` for a ``ValueError``), so a failure
inside a graph carries its class in its message, "(tf.errors.FailedPreconditionError)", and
``install()`` (run when ``hora.tensorflow`` is imported) wraps the two places where a failed
graph run reaches Python (calling a ``tf.function``, ``Session.run``) to raise that class; an
error without the mark passes through untouched. The message of a hora failure starts with
``HoraInternalError:`` so that elastic training (``hvd.elastic.run``) recognises it.
Any thread.
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf

from hora.errors import HoraInternalError, MismatchError, ShutDownError

MARK = "HoraInternalError: "  # starts a hora failure's message inside a graph


class FailedPreconditionError(tf.errors.FailedPreconditionError, MismatchError):
    """The ranks submitted one op with different arguments (dtype, shape, op, root rank)."""


class AbortedError(tf.errors.AbortedError, ShutDownError):
    """hora was shut down while the op was pending."""


class UnknownError(tf.errors.UnknownError, HoraInternalError):
    """A collective failed: a peer died or a connection broke."""


class InvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """An argument that only the op's run could check (splits against rows, say)."""


_BY_CODE: dict[int, type[tf.errors.OpError]] = {
    tf.errors.FAILED_PRECONDITION: FailedPreconditionError,
    tf.errors.ABORTED: AbortedError,
    tf.errors.UNKNOWN: UnknownError,
    tf.errors.INVALID_ARGUMENT: InvalidArgumentError,
}


def error_code(e: BaseException) -> int:
    """TensorFlow's code for ``e``."""
    if isinstance(e, ShutDownError):
        return tf.errors.ABORTED
    if isinstance(e, tf.errors.OpError):
        return int(e.error_code)
    if isinstance(e, MismatchError):
        return tf.errors.FAILED_PRECONDITION
    if isinstance(e, HoraInternalError):
        return tf.errors.UNKNOWN
    if isinstance(e, (ValueError, TypeError, IndexError)):
        return tf.errors.INVALID_ARGUMENT
    return tf.errors.UNKNOWN


def make(code: int, message: str) -> tf.errors.OpError:
    """The error to raise for ``code`` with ``message``."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return tf.errors.UnknownError(None, None, message)
    return cls(None, None, message)


def graph_message(e: BaseException) -> str:
    """``e``'s message as a graph node reports it: hora failures marked for elastic, and the
    TensorFlow class it is to arrive as."""
    text = f"{MARK}{e}" if isinstance(e, HoraInternalError) else str(e)
    cls = _BY_CODE.get(error_code(e))
    return text if cls is None else f"{text} (tf.errors.{cls.__bases__[0].__name__})"


_TAG = re.compile(r"\(tf\.errors\.(\w+Error)\)")
_BY_NAME = {cls.__bases__[0].__name__: cls for cls in _BY_CODE.values()}


def retyped(e: tf.errors.OpError) -> tf.errors.OpError | None:
    """The error of the class that ``e``'s message names, or None to keep ``e``."""
    m = _TAG.search(str(e.message))
    cls = _BY_NAME.get(m.group(1)) if m else None
    if cls is None or isinstance(e, cls):
        return None
    return cls(e.node_def, e.op, e.message)


def translated(e: BaseException) -> BaseException:
    """``e`` as TensorFlow's class for it, or ``e`` itself when it already is one or is not a
    failure of the collective (a ``NotImplementedError`` from Horovod's Python checks, say)."""
    if isinstance(e, tf.errors.OpError):
        return e
    if isinstance(e, HoraInternalError) or (
        isinstance(e, (ValueError, IndexError)) and not isinstance(e, NotImplementedError)
    ):
        return make(error_code(e), str(e))
    return e


def _reraising(call: Any) -> Any:
    """``call`` wrapped so that an error marked by ``graph_message`` arrives as its class."""
    if getattr(call, "_hora", False):
        return call

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except tf.errors.OpError as e:
            again = retyped(e)
            if again is None:
                raise
            raise again from None

    wrapped._hora = True  # type: ignore[attr-defined]
    wrapped.__wrapped__ = call  # type: ignore[attr-defined]
    wrapped.__doc__, wrapped.__name__ = call.__doc__, call.__name__
    return wrapped


def install() -> None:
    """Wrap the two places where TensorFlow turns a failed graph run into an exception
    (calling a ``tf.function`` and ``Session.run``) so that an error marked by
    ``graph_message`` arrives as its class. Idempotent; where TensorFlow's internals differ,
    errors stay ``UnknownError`` (with the class named in the message)."""
    try:
        from tensorflow.python.client import session
        from tensorflow.python.eager.polymorphic_function import polymorphic_function
    except ImportError:  # pragma: no cover - another TensorFlow layout
        return
    for cls, attr in ((polymorphic_function.Function, "__call__"),
                      (session.BaseSession, "_do_call")):  # fmt: skip
        call = getattr(cls, attr, None)
        if call is not None:
            setattr(cls, attr, _reraising(call))


__all__ = [
    "AbortedError", "FailedPreconditionError", "InvalidArgumentError", "UnknownError",
    "error_code", "graph_message", "install", "make", "retyped", "translated",
]  # fmt: skip

install()
