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



# With pytest-xdist (scripts/test.sh runs `-n 2 --dist loadfile`), each test file runs whole on
# one worker, so that what its tests share (a module's Spark session, Ray cluster or one job
# running many checks) is set up once. The longest file (about 5.5 minutes on two cores) goes
# first, on one worker while the other takes the rest, rather than alone at the end.
FIRST = "test_elastic_faults.py"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's collection, which the run follows
        items.sort(key=lambda item: item.path.name != FIRST)  # stable: the rest keep their order
