"""hora on Ray (Horovod's ``horovod.ray``): :class:`RayExecutor` runs a hora job whose ranks
are Ray actors, with hora's rendezvous store in the Ray driver. Needs Ray (``pip install
'hora[ray]'``); nothing else in hora imports this package. See docs/ray.md.
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError("hora.ray needs Ray: pip install 'hora[ray]' (or pip install ray)") from e

from hora.ray.config import RaySettings
from hora.ray.elastic import ElasticRayExecutor
from hora.ray.executor import RayExecutor

__all__ = ["ElasticRayExecutor", "RayExecutor", "RaySettings"]
