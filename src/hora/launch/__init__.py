"""Starting hora jobs: ``hora run`` / ``horovodrun``, ``hora check`` and ``hora.run(func)``.

The way through it goes one direction: argv (:mod:`.cli`) -> :class:`.config.LaunchConfig` ->
:class:`.job.Job` (preflight, rendezvous store, workers) -> :mod:`.process` (one wrapper per
rank, local or over :mod:`.ssh`, or one :mod:`.mpirun`). Ranks are assigned in :mod:`.hosts`
and their environment is built in :mod:`.workerenv`. Everything the CLI does is reachable
from Python (``hora.run``, which uses :func:`.api.run_on_job`, and ``Job``). The launcher
runs in one main thread plus pump and waiter threads per worker; see each module for its
threading.
"""

