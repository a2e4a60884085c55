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
