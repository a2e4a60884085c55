"""The body of one hora rank on Ray: a Ray actor (:class:`hora.ray.RayExecutor` wraps
:class:`Worker` with ``ray.remote``) that receives its rank's environment once and then runs the
functions the driver sends.

The environment is the one :mod:`hora.launch.workerenv` builds for a launched rank, so
``hvd.init()`` inside a function finds its identity, the knobs and the driver's rendezvous store
exactly as under ``hora run``. Outcomes are returned as :mod:`hora.launch.task` stores them
(``("ok", value)`` or ``("error", exception, traceback text)``, cloudpickled) so the driver
names the rank that raised. Ray runs each method in the actor's main thread, one at a time.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.launch.task import outcome_bytes
from hora.ray import ray_logger


class Worker:
    """One rank's process. Constructed by Ray in the actor; its methods are called by the driver."""

    def __init__(self) -> None:
        self.executable: Any = None

    def where(self) -> tuple[str, str, int, list[str]]:
        """``(Ray node id, host name, process id, GPU ids Ray gave this actor)``."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        gpus = [str(g) for g in ray.get_gpu_ids()]
        return node, socket.gethostname(), os.getpid(), gpus

    def setup(
        self,
        env: Mapping[str, str],
        executable_cls: type | None,
        executable_args: Sequence[Any],
        executable_kwargs: Mapping[str, Any],
    ) -> None:
        """Take the rank's environment, then build the executable object (if a class is given)
        with it in place, so that its constructor may call ``hvd.init()``."""
        os.environ.update(env)
        if executable_cls is not None:
            self.executable = executable_cls(*executable_args, **dict(executable_kwargs))

    def env(self, names: Sequence[str]) -> dict[str, str | None]:
        """The values of ``names`` in this actor's environment (for checks and tests)."""
        return {name: os.environ.get(name) for name in names}

    def call(self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``func(*args, **kwargs)``'s value, exceptions raised as they are (``run_remote``)."""
        return func(*args, **dict(kwargs))

    def execute_raw(self, func: Callable[[Any], Any]) -> Any:
        """``func(executable)``'s value, exceptions raised as they are (``execute_single``)."""
        return func(self.executable)

    def outcome(
        self,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        logger: Any = None,
    ) -> bytes:
        """``func(*args, **kwargs)``'s cloudpickled outcome (``run``, ``execute``); what it
        logs with :func:`hora.ray.ray_logger.log` goes to ``logger`` (the driver's callbacks'
        queue) while it runs."""
        ray_logger.configure(logger)
        try:
            result: tuple[object, ...] = ("ok", func(*args, **dict(kwargs)))
        except BaseException as e:  # carried back to the driver, which names this rank
            result = ("error", e, traceback.format_exc())
        finally:
            ray_logger.configure(None)
        return outcome_bytes(result)

    def run_task(self, env: Mapping[str, str], logger: Any = None) -> int:
        """One elastic worker: take ``env``, then run :mod:`hora.launch.task` as a launched
        worker process does (fetch the function from the store, call it, store the outcome);
        its exit status. ``logger``: as for :meth:`outcome`."""
        from hora.launch.task import main

        os.environ.update(env)
        ray_logger.configure(logger)
        try:
            return main()
        finally:
            ray_logger.configure(None)

    def executable_outcome(self, func: Callable[[Any], Any], logger: Any = None) -> bytes:
        """``func(executable)``'s cloudpickled outcome (``execute``)."""
        return self.outcome(func, (self.executable,), {}, logger)
