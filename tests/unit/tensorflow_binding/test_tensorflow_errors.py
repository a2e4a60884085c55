"""hora's failures as TensorFlow's error classes (hora.tensorflow.errors), without ranks."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed"
)


def test_each_failure_is_both_classes() -> None:
    import tensorflow as tf

    from hora.errors import HoraInternalError, MismatchError, ShutDownError, TransportError
    from hora.tensorflow.errors import translated

    cases = [
        (MismatchError("Mismatched data types"), tf.errors.FailedPreconditionError,
         MismatchError),
        (ShutDownError("Horovod has been shut down"), tf.errors.AbortedError, ShutDownError),
        (TransportError("peer gone"), tf.errors.UnknownError, HoraInternalError),
        (ValueError("splits exceed the rows"), tf.errors.InvalidArgumentError, ValueError),
    ]  # fmt: skip
    for error, tf_class, hora_class in cases:
        got = translated(error)
        assert isinstance(got, tf_class) and isinstance(got, hora_class), (error, got)
        assert str(error) in str(got)
    assert issubclass(MismatchError, HoraInternalError)
    assert issubclass(ShutDownError, HoraInternalError)
    not_ours = NotImplementedError("Adasum on sparse tensors")
    assert translated(not_ours) is not_ours  # Horovod's Python checks keep their class


def test_a_marked_failure_inside_a_graph_arrives_as_its_class() -> None:
    import tensorflow as tf

    from hora.errors import MismatchError
    from hora.tensorflow import errors

    message = errors.graph_message(MismatchError("shapes differ"))
    assert message.startswith(errors.MARK) and "(tf.errors.FailedPreconditionError)" in message
    stale = errors.make(tf.errors.ABORTED, "a result from a cancelled run")  # the check node's
    assert "(tf.errors.AbortedError)" in errors.graph_message(stale)
    unknown = tf.errors.UnknownError(None, None, errors.graph_message(stale))
    assert isinstance(errors.retyped(unknown), tf.errors.AbortedError)

    def fail(x: np.ndarray) -> np.ndarray:
        raise errors.make(tf.errors.FAILED_PRECONDITION, message)

    errors.install()
    errors.install()  # idempotent: wrapping twice would change nothing either
    with pytest.raises(tf.errors.FailedPreconditionError, match="shapes differ") as e:
        tf.function(lambda: tf.numpy_function(fail, [tf.constant(1.0)], tf.float32))()
    assert isinstance(e.value, MismatchError)
    with tf.Graph().as_default():
        node = tf.numpy_function(fail, [tf.constant(1.0)], tf.float32)
        with tf.compat.v1.Session() as s, pytest.raises(tf.errors.FailedPreconditionError):
            s.run(node)
    # an error without the mark passes through untouched
    with pytest.raises(tf.errors.UnknownError):
        tf.function(lambda: tf.numpy_function(lambda x: 1 / 0, [tf.constant(1.0)],
                                              tf.float32))()  # fmt: skip
