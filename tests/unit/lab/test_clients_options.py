"""``hora bench clients`` refuses bad options before starting any worker, saying which."""

from __future__ import annotations

import argparse

import pytest

from hora.lab import clients


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    clients.configure(parser)
    return clients.command(parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--clients", "keras"], "--clients 'keras': choose from"),
        (["--clients", ","], "--clients ',': choose from"),
        (["--model", "mnist"], "--model 'mnist': choose from"),
        (["--steps", "1"], "--steps must be at least 2"),
    ],
)
def test_bad_options_say_what_to_choose(argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit, match=says):
        _run(*argv)


def test_table_sets_hora_against_gloo() -> None:
    row = {"batch": 64, "np": 2}
    result = {"np": 2, "model": "mlp", "repeat": 2, "clients": ["lightning"],
              "results": {"lightning.gloo": dict(row, step_ms=120.0),
                          "lightning.hora": dict(row, step_ms=100.0)}}  # fmt: skip
    text = clients.render(result)
    assert "best of 2 round(s)" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("lightning"))
    assert line.split() == ["lightning", "64", "120.00", "100.00", "1.20x"], line
