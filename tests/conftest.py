"""Shared test setup: make tests/ importable (harness, conformance battery), and give every
test the "hora" logger as it found it."""

import logging
import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))


_HORA_LOGGER = logging.getLogger("hora")
_PRISTINE = (list(_HORA_LOGGER.handlers), _HORA_LOGGER.propagate, _HORA_LOGGER.level)


@pytest.fixture(autouse=True)
def _hora_logger_restored() -> Iterator[None]:
    """``hvd.init()`` in the test process (in a test or a module's fixture) gives the "hora"
    logger its own handler and stops it propagating, which would hide later tests' records
    from ``caplog``: every test starts with the logger as it was before any of that."""
    _HORA_LOGGER.handlers[:] = _PRISTINE[0]
    _HORA_LOGGER.propagate, _HORA_LOGGER.level = _PRISTINE[1], _PRISTINE[2]
    yield


# With pytest-xdist (scripts/test.sh runs `-n 2 --dist loadgroup`), a test file goes to one
# worker whole, so that what its tests share (a module's Spark session, Ray cluster or one job
# running many checks, an import already made) is set up once. These files share nothing
# between tests and take minutes: their tests are spread over the workers one by one, so that
# neither waits alone for the other at the end.
SPREAD = frozenset(
    {
        "test_elastic_faults.py",
        "test_tensorflow_examples.py",
        "test_torch_examples.py",
        "test_bench_scaling.py",
        "test_reliability.py",
        "test_elastic.py",
        "test_as_horovod.py",
        "test_cast_compression_hosts.py",
        "test_model_parallel.py",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.path.name not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
