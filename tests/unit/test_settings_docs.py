"""Settings, the `hora run` flags and the docs name the same knobs."""

from __future__ import annotations

import argparse
from pathlib import Path

from hora.launch import cli
from hora.settings import KNOBS

ROOT = Path(__file__).resolve().parents[2]


def _run_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return {s for a in parser._actions for s in a.option_strings}


def test_every_knob_flag_exists_in_hora_run() -> None:
    flags = _run_flags()
    missing = [k.flag for k in KNOBS if k.flag and k.flag not in flags]
    assert not missing, missing


def test_docs_name_every_knob_and_flag() -> None:
    text = (ROOT / "docs" / "settings.md").read_text()
    for k in KNOBS:
        assert f"HORA_{k.env}" in text and f"HOROVOD_{k.env}" in text, k.env
        if k.flag:
            assert k.flag in text, k.flag
