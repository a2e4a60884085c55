"""What every Spark test module shares: skip without pyspark or Java, and one local session.

Import it before anything of pyspark; each module starts one session (``session(...)``) in a
module-scoped fixture, so Spark's start-up is paid once per module.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'hora[spark]')")
if shutil.which("java") is None:
    pytest.skip("no java on PATH: Spark needs a Java runtime", allow_module_level=True)


def session(master: str, app: str, conf: dict[str, str] | None = None) -> Any:
    """A SparkSession on ``master`` whose Python workers run this interpreter, bound to
    loopback, without the web UI and quiet."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app).config("spark.ui.enabled", "false")
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    started = builder.getOrCreate()
    started.sparkContext.setLogLevel("FATAL")
    return started
