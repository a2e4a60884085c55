"""Which backend the settings choose, and what a chosen backend says when it cannot run here."""

from __future__ import annotations

import pytest

from hora.backends import registry
from hora.backends.registry import BackendContext
from hora.identity import Identity
from hora.settings import Settings, load


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, "native"),
        ({"HOROVOD_CPU_OPERATIONS": "gloo"}, "gloo"),
        ({"HORA_CPU_OPERATIONS": "MPI"}, "mpi"),
        ({"HOROVOD_CONTROLLER": "gloo"}, "gloo"),
        ({"HOROVOD_CPU_OPERATIONS": "tcp"}, "native"),
        # a named CPU backend runs everything: CUDA tensors reach it staged through host memory
        ({"HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GPU_OPERATIONS": "nccl"}, "gloo"),
        ({"HOROVOD_CONTROLLER": "mpi", "HOROVOD_GPU_ALLREDUCE": "NCCL"}, "mpi"),
    ],
)
def test_select(env: dict[str, str], want: str) -> None:
    assert registry.select(load(env)) == want


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"HOROVOD_GPU_OPERATIONS": "nccl"}, "nccl"),
        ({"HOROVOD_GPU_ALLREDUCE": "NCCL"}, "nccl"),
        ({"HOROVOD_GPU_OPERATIONS": "mpi"}, "mpi"),
    ],
)
def test_gpu_operations_choose_only_where_there_is_a_gpu(
    env: dict[str, str], want: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "_gpu_present", lambda: True)
    assert registry.select(load(env)) == want
    # Horovod build scripts often export HOROVOD_GPU_OPERATIONS=NCCL: on a CPU-only machine
    # it must not stop the job
    monkeypatch.setattr(registry, "_gpu_present", lambda: False)
    assert registry.select(load(env)) == "native"


def test_unknown_backend_names_what_there_is() -> None:
    with pytest.raises(ValueError, match="=bogus: expected one of native, gloo, mpi, nccl"):
        registry.select(load({"HOROVOD_CPU_OPERATIONS": "bogus"}))
    with pytest.raises(ValueError, match="'carrier': unsupported backend.*gloo, mpi, native"):
        registry.select(Settings(cpu_operations="carrier"))


@pytest.mark.parametrize("name", ["ccl", "CCL"])
def test_ccl_is_not_built_here_as_horovod_says_it(name: str) -> None:
    """Horovod built without oneCCL answers that CCL is not built, not "unsupported"."""
    with pytest.raises(ValueError, match="CCL .*support is not built into hora") as info:
        load({"HOROVOD_CPU_OPERATIONS": name})
    assert "unsupported" not in str(info.value)
    with pytest.raises(ValueError, match="CCL .*support is not built into hora"):
        registry.select(Settings(cpu_operations=name))


def _ctx() -> BackendContext:
    return BackendContext(Identity(), load({}))


def test_nccl_without_gpu_says_so() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the error is for machines without one")
    with pytest.raises(ValueError, match="NCCL backend needs an NVIDIA GPU"):
        registry.create("nccl", _ctx())


@pytest.mark.timeout(60)
def test_optional_dependencies_load_only_with_their_backend() -> None:
    import subprocess
    import sys

    code = (
        "import sys, hora\n"
        "from hora.backends import registry\n"
        "from hora.settings import load\n"
        "before = [m for m in ('torch', 'mpi4py') if m in sys.modules]\n"
        "from hora.identity import Identity\n"
        "ctx = registry.BackendContext(Identity(), load({}))\n"
        "registry.create('gloo', ctx).close()\n"
        "print(before, 'torch' in sys.modules, 'mpi4py' in sys.modules)\n"
    )
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "True", "False"], out.stdout
