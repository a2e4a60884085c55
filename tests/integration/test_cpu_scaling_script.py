"""scripts/cpu_scaling.sh, the prepared many-core run, at np 2 and 4 with tiny sizes, so that
it cannot rot: every step passes, each pair's shared-memory path is named, the allreduce
reports carry the counted bytes, and the scaling run has native and DDP rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "PYTHON": sys.executable,
    "CPU_SCALING_NPS": "2,4",
    "CPU_SCALING_SIZES": "4K,256K",
    "CPU_SCALING_ITERS": "3",
    "CPU_SCALING_BACKENDS": "hora,gloo",
    "CPU_SCALING_SCALE_NPS": "2",
    "CPU_SCALING_MODELS": "mlp",
    "CPU_SCALING_STEPS": "2",
    "CPU_SCALING_BUDGET": "400",
}


@pytest.mark.timeout(480)
def test_cpu_scaling_script(tmp_path: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "cpu_scaling.sh"), str(out)],
                          env={**os.environ, **TINY}, capture_output=True, text=True,
                          timeout=450)  # fmt: skip
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, f"{summary}\n{done.stderr[-3000:]}"
    assert summary.count("\nok ") == 5, summary
    paths = (out / "shm_paths.txt").read_text()
    for rank in range(4):
        named = [line for line in paths.splitlines() if f"rank {rank} -> ShmPair" in line]
        assert len(named) == 3 and all("single-copy" in n or "staged" in n for n in named), paths
    for np_ in (2, 4):
        report = (out / f"allreduce_np{np_}.txt").read_text()
        assert f"bytes moved per rank (hora, np={np_})" in report, report
        assert "all paths" in report and "256 KiB" in report and "gloo" in report, report
    scaling = (out / "scaling.txt").read_text()
    assert "native" in scaling and "ddp" in scaling, scaling
