"""hora's one error tree.

Every error a user can see is defined here, with Horovod's names kept as aliases so that
``except horovod.common.exceptions.HorovodInternalError`` code works after changing the import.
Thread-safe: these are plain classes.
"""

from __future__ import annotations


class HoraError(Exception):
    """Base of every error hora raises on purpose."""


class HoraInternalError(HoraError, RuntimeError):
    """A collective failed: mismatched arguments across ranks, a dead peer, or a shutdown.

    Raised from ``synchronize`` (and the blocking ops) on every rank involved. Elastic training
    catches it, restores the last committed state and re-initialises.
    """


HorovodInternalError = HoraInternalError


class MismatchError(HoraInternalError):
    """The ranks submitted one op (by name) with different arguments: dtype, shape, reduction,
    root rank, scale factors, grouping or process set. Raised on every rank involved, with a
    message naming both sides (TensorFlow bindings raise it as ``FailedPreconditionError``)."""


class ShutDownError(HoraInternalError):
    """hora was shut down, or its engine stopped, while the op was pending (TensorFlow
    bindings raise it as ``AbortedError``)."""


class HostsUpdatedInterrupt(HoraError, RuntimeError):
    """Elastic: the set of hosts changed; ``skip_sync`` is True when hosts were only removed."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated" + (" (removed only)" if skip_sync else ""))
        self.skip_sync = skip_sync


class HoraVersionMismatchError(HoraError, ImportError):
    """A framework binding was built against a different framework version."""


HorovodVersionMismatchError = HoraVersionMismatchError


class NotSupportedError(HoraError, NotImplementedError, ValueError):
    """An op was asked for something it does not do (reducescatter with Adasum, Adasum on a
    number of ranks that is not a power of two). Raised at once, in the caller's thread.

    Horovod raises these as RuntimeErrors, so scripts catch them with ``except RuntimeError``
    (``NotImplementedError`` is one); it is also a ``ValueError``, as hora raised before. It is
    not a ``HorovodInternalError``: elastic training must not retry a call that cannot work.
    """


class UnsupportedTypeError(HoraError, TypeError, ValueError):
    """A tensor's dtype cannot travel ("Tensor type X is not supported.").

    A ``ValueError`` as in Horovod, and a ``TypeError`` as hora raised before.
    """


class TransportError(HoraInternalError):
    """A connection to a peer failed: closed, reset, timed out, or sent a malformed frame."""


class AuthenticationError(TransportError):
    """A connection did not prove that it knows the job's secret."""


class RendezvousError(HoraError, RuntimeError):
    """The rendezvous store could not be reached or did not answer in time."""


class LaunchError(HoraError, RuntimeError):
    """``hora run`` could not start or keep the job running (bad hosts, ssh, a failed worker)."""


NOT_INITIALIZED_MESSAGE = "Horovod has not been initialized; use hvd.init()."

SHUT_DOWN_MESSAGE = (
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an "
    "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
    "execution. If the shutdown was caused by an exception, you should see the exception in "
    "the log before the first shutdown message."
)

DUPLICATE_NAME_MESSAGE = (
    "Requested to {op} a tensor with the same name as another tensor that is currently being "
    "processed. If you want to request another tensor, use a different tensor name. "
    "(name: {name})"
)

__all__ = [
    "HoraError",
    "HoraInternalError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "MismatchError",
    "ShutDownError",
    "HoraVersionMismatchError",
    "HorovodVersionMismatchError",
    "NotSupportedError",
    "UnsupportedTypeError",
    "TransportError",
    "AuthenticationError",
    "RendezvousError",
    "LaunchError",
]
