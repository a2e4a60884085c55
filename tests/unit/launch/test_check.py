"""hora check reports every group and says how to get what is missing."""

from __future__ import annotations

import sys

from hora.launch import check


def test_findings_cover_every_group() -> None:
    items = check.findings()
    names = {i.name for i in items}
    assert {"PyTorch", "native", "MPI", "Gloo", "NCCL", "TCP", "shared memory", "GPUs"} <= names
    native = next(i for i in items if i.name == "native")
    assert native.available


def test_missing_things_name_an_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)  # makes the import fail
    item = check._mpi()
    assert not item.available and "hora[mpi]" in item.detail
    assert "\x00" not in check.report(check.findings())


def test_report_text() -> None:
    text = check.report(check.findings())
    for group in ("frameworks:", "backends:", "transports:", "devices:"):
        assert group in text
