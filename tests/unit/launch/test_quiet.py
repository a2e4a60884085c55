"""TensorFlow's start-up notes: which worker stderr lines the launcher drops, and the
TF_CPP_MIN_LOG_LEVEL workers get, with the tf_logs knob off and on."""

from __future__ import annotations

from hora.launch.process import LinePrefixer
from hora.launch.quiet import StartupNotes
from hora.launch.workerenv import job_env
from hora.settings import load

BANNER = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
ONEDNN = (b"I0000 00:00:1795720643.587812    6567 port.cc:153] oneDNN custom operations are on. "
          b"You may see slightly different numerical results.\n")  # fmt: skip
NO_DRIVER = (b"I0000 00:00:1795720643.588245    6567 cudart_stub.cc:31] Could not find cuda "
             b"drivers on your machine, GPU will not be used.\n")  # fmt: skip
CPU = (b"I0000 00:00:1795720643.794052    6567 cpu_feature_guard.cc:227] This TensorFlow binary "
       b"is optimized to use available CPU instructions in performance-critical operations.\n")
CPU_TAIL = b"To enable the following instructions: AVX2 FMA, in other operations, rebuild.\n"
CUINIT = (b"E0000 00:00:1795720651.056234    6576 cuda_platform.cc:52] failed call to cuInit: "
          b"INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n")  # fmt: skip
OTHER_ERROR = (b"E0000 00:00:1795720651.056234    6576 cuda_dnn.cc:535] Loaded runtime CuDNN "
               b"library: 8.1.0 but source was compiled with: 8.6.0.\n")  # fmt: skip


def shown(lines: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    cutter = LinePrefixer(b"[0]<stderr>:", out.append, drop=StartupNotes().drop)
    cutter.feed(b"".join(lines))
    cutter.close()
    return out


def test_start_up_notes_are_dropped_and_the_rest_kept() -> None:
    user = b"Traceback (most recent call last):\n"
    got = shown([BANNER, ONEDNN, NO_DRIVER, CPU, CPU_TAIL, BANNER, ONEDNN, NO_DRIVER, CUINIT,
                 OTHER_ERROR, user])  # fmt: skip
    assert got == [b"[0]<stderr>:" + OTHER_ERROR, b"[0]<stderr>:" + user]


def test_cuinit_error_kept_where_a_driver_was_found() -> None:
    assert shown([BANNER, ONEDNN, CUINIT]) == [b"[0]<stderr>:" + CUINIT]


def test_instruction_line_kept_unless_it_follows_the_cpu_note() -> None:
    assert shown([CPU_TAIL]) == [b"[0]<stderr>:" + CPU_TAIL]
    assert shown([CPU, b"something else\n", CPU_TAIL]) == [
        b"[0]<stderr>:something else\n", b"[0]<stderr>:" + CPU_TAIL,
    ]  # fmt: skip


def test_workers_get_tf_log_level_unless_set_or_tf_logs() -> None:
    quiet = job_env({}, load({}), "native", 1234, [])
    assert quiet["TF_CPP_MIN_LOG_LEVEL"] == "1"
    assert job_env({"TF_CPP_MIN_LOG_LEVEL": "0"}, load({}), "native", 1, [])[
        "TF_CPP_MIN_LOG_LEVEL"] == "0"  # fmt: skip
    loud = job_env({}, load({"HORA_TF_LOGS": "1"}), "native", 1234, [])
    assert "TF_CPP_MIN_LOG_LEVEL" not in loud and loud["HORA_TF_LOGS"] == "1"
