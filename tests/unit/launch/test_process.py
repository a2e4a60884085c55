"""Output prefixing, and the worker wrapper run as a real shell process."""

from __future__ import annotations

import io
import os
import queue
import signal
import subprocess
import sys
import time

import pytest

from harness import pid_alive
from hora.launch.local import worker_argv
from hora.launch.process import ConsoleSink, LinePrefixer, Worker, stop_all, wrapper_script


def _prefixed(chunks: list[bytes], timestamp: bool = False) -> list[bytes]:
    out: list[bytes] = []
    cutter = LinePrefixer(b"[3]<stdout>:", out.append, timestamp)
    for chunk in chunks:
        cutter.feed(chunk)
    cutter.close()
    return out


def test_prefix_splits_on_newline_and_carriage_return() -> None:
    assert _prefixed([b"one\ntwo\rthree\r\nfour"]) == [
        b"[3]<stdout>:one\n",
        b"[3]<stdout>:two\r",
        b"[3]<stdout>:three\r",
        b"[3]<stdout>:four\n",
    ]


def test_prefix_handles_arbitrary_chunks() -> None:
    data = b"progress 10%\rprogress 20%\r\ndone\n"
    whole = _prefixed([data])
    bytewise = _prefixed([data[i : i + 1] for i in range(len(data))])
    assert (
        whole
        == bytewise
        == [
            b"[3]<stdout>:progress 10%\r",
            b"[3]<stdout>:progress 20%\r",
            b"[3]<stdout>:done\n",
        ]
    )


def test_prefix_with_timestamp() -> None:
    (line,) = _prefixed([b"x\n"], timestamp=True)
    stamp, _, rest = line.partition(b"[3]")
    assert rest == b"<stdout>:x\n"
    time.strptime(stamp.decode(), "%a %b %d %H:%M:%S %Y")


def test_console_sink_accepts_text_and_binary_streams() -> None:
    text, binary = io.StringIO(), io.BytesIO()
    ConsoleSink(text).write(b"a\n")
    ConsoleSink(binary).write(b"b\n")
    assert text.getvalue() == "a\n" and binary.getvalue() == b"b\n"


def _start(command: list[str], out: io.BytesIO, exits: queue.Queue, **kw) -> Worker:
    script = wrapper_script(command, grace_seconds=kw.pop("grace", 1.0))
    sink = ConsoleSink(out)
    return Worker(5, worker_argv(script), env=dict(os.environ), cwd=None,
                  stdin_data=b"c0ffee\n", stdout=sink, stderr=sink, exits=exits, **kw)  # fmt: skip


@pytest.mark.timeout(30)
def test_wrapper_passes_secret_and_exit_code(tmp_path) -> None:
    out, exits = io.BytesIO(), queue.Queue()
    code = "import os,sys; print(os.environ['HORA_SECRET_KEY']); sys.exit(3)"
    worker = _start([sys.executable, "-c", code], out, exits, output_dir=str(tmp_path / "r"))
    assert exits.get(timeout=20) == (5, 3)
    assert out.getvalue() == b"[5]<stdout>:c0ffee\n"
    assert (tmp_path / "r" / "stdout").read_bytes() == b"c0ffee\n"
    assert (tmp_path / "r" / "stderr").read_bytes() == b""
    assert "c0ffee" not in " ".join(worker.proc.args)


def _pid_from(out: io.BytesIO, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = out.getvalue().decode()
        if "pid=" in text:
            return int(text.split("pid=")[1].split()[0])
        time.sleep(0.05)
    raise AssertionError(f"no pid printed: {out.getvalue()!r}")


@pytest.mark.timeout(40)
def test_stop_kills_the_process_group_including_grandchildren() -> None:
    out, exits = io.BytesIO(), queue.Queue()
    code = (
        "import os,subprocess,sys,time; c=subprocess.Popen([sys.executable,'-c',"
        "'import time; time.sleep(60)']); print('pid=%d child=%d' % (os.getpid(), c.pid)); "
        "time.sleep(60)"
    )
    worker = _start([sys.executable, "-c", code], out, exits)
    pid = _pid_from(out)
    child = int(out.getvalue().decode().split("child=")[1].split()[0])
    stop_all([worker], grace_seconds=1.0)
    label, status = exits.get(timeout=10)
    assert label == 5 and status != 0
    deadline = time.monotonic() + 5
    while (pid_alive(pid) or pid_alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid) and not pid_alive(child)


@pytest.mark.timeout(40)
def test_sigterm_ignoring_worker_gets_sigkill_after_grace() -> None:
    out, exits = io.BytesIO(), queue.Queue()
    code = (
        "import os,signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('pid=%d' % os.getpid()); time.sleep(60)"
    )
    worker = _start([sys.executable, "-c", code], out, exits, grace=0.5)
    pid = _pid_from(out)
    stop_all([worker], grace_seconds=0.5)
    _, status = exits.get(timeout=10)
    assert status == 128 + signal.SIGKILL
    assert not pid_alive(pid)


@pytest.mark.timeout(40)
def test_worker_dies_when_its_launcher_dies() -> None:
    """The stdin pipe closing (launcher killed with SIGKILL) stops the worker too."""
    code = "import os,time; print('pid=%d' % os.getpid(), flush=True); time.sleep(60)"
    script = wrapper_script([sys.executable, "-c", code], grace_seconds=1.0)
    launcher = subprocess.Popen(worker_argv(script), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
    assert launcher.stdin is not None and launcher.stdout is not None
    launcher.stdin.write(b"aa\n")
    launcher.stdin.flush()
    pid = int(launcher.stdout.readline().decode().split("pid=")[1])
    launcher.stdin.close()  # what the kernel does when the launcher dies
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)


def test_exit_statuses_name_the_signal_behind_them() -> None:
    from hora.launch.job import exit_status

    assert exit_status(3) == "3"
    assert exit_status(-9) == "-9 (killed by SIGKILL)"
    assert exit_status(134) == "134 (SIGABRT, as a shell reports it)"
    assert exit_status(128 + 15) == "143 (SIGTERM, as a shell reports it)"
    assert exit_status(-99) == "-99 (killed by signal 99)"
    assert exit_status(255) == "255"
