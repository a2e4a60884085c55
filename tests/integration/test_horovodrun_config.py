"""`hora run --config-file` with a file in horovodrun's YAML format reaches the workers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.timeout(150)
def test_a_horovodrun_config_file_reaches_the_workers(tmp_path) -> None:
    """`hora run --config-file` with a file in horovodrun's format, every section: the workers
    run with its controller and settings, and rank 0 writes the timeline it names."""
    timeline = tmp_path / "tl.json"
    config = tmp_path / "horovod.yaml"
    config.write_text(
        textwrap.dedent(f"""\
        controller: gloo
        params:
          fusion_threshold_mb: 32
          cycle_time_ms: 10
          cache_capacity: 2048
          hierarchical_allreduce: false
          hierarchical_allgather: false
        autotune:
          enabled: false
          log_file: {tmp_path / "at.csv"}
          warmup_samples: 5
          steps_per_sample: 20
          bayes_opt_max_samples: 50
          gaussian_process_noise: 0.9
        timeline:
          filename: {timeline}
          mark_cycles: true
        stall_check:
          enabled: true
          warning_time_seconds: 120
          shutdown_time_seconds: 240
        library_options:
          mpi_threads_disable: true
          num_nccl_streams: 2
          ccl_bgt_affinity: 1
          gloo_timeout_seconds: 60
        logging:
          level: INFO
          with_timestamp: false
        """)
    )
    script = tmp_path / "w.py"
    script.write_text(
        textwrap.dedent("""\
        import numpy as np
        import hora as hvd
        from hora.core import runtime
        hvd.init()
        s = runtime.runtime().settings
        hvd.allreduce(np.ones(4, np.float32), name="x")
        print("cfg", hvd.rank(), runtime.runtime().backend_name, s.fusion_threshold >> 20,
              s.cycle_time_ms, s.cache_capacity, s.stall_shutdown_time_seconds,
              s.gloo_timeout_seconds, s.log_level, s.log_hide_time, s.num_nccl_streams)
        hvd.shutdown()
        """)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    hora_cli = [
        sys.executable,
        "-c",
        "import sys; from hora.launch.cli import main; sys.exit(main())",
    ]  # noqa: E501
    done = subprocess.run(
        [*hora_cli, "run", "-np", "2", "--config-file", str(config), sys.executable, str(script)],
        capture_output=True, text=True, env=env, timeout=140, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(ln.split(":", 1)[1] for ln in done.stdout.splitlines() if "cfg" in ln)
    assert lines == [f"cfg {r} gloo 32 10.0 2048 240.0 60.0 INFO True 2" for r in (0, 1)], (
        done.stdout
    )
    assert "ccl_bgt_affinity" in done.stderr  # read, and said once to have nothing to do
    assert timeline.exists() and timeline.stat().st_size > 0
