"""hora.common.util's helpers that horovod.common.util (v0.28.1) offers scripts:
is_version_greater_equal_than, check_installed_version, get_average_backwards_compatibility_fun,
the extension path helpers and check_extension, with Horovod's signatures."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest

from hora.common import util


class Ops:
    Average, Sum, Max = 1, 2, 3


def names(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_signatures() -> None:
    assert names(util.is_version_greater_equal_than) == ["ver", "target"]
    assert names(util.check_installed_version) == ["name", "version", "exception"]
    assert names(util.get_average_backwards_compatibility_fun) == ["reduce_ops"]
    assert names(util.get_ext_suffix) == []
    assert names(util.get_extension_full_path) == ["pkg_path", "args"]
    assert names(util.check_extension) == ["ext_name", "ext_env_var", "pkg_path", "args"]
    assert names(util.split_list) == ["l", "n"]


def test_is_version_greater_equal_than() -> None:
    assert util.is_version_greater_equal_than("2.21.0", "2.4.0")
    assert not util.is_version_greater_equal_than("2.3.9", "2.4.0")
    assert util.is_version_greater_equal_than("2.4.0rc1", "2.3.0")
    with pytest.raises(ValueError):
        util.is_version_greater_equal_than(2, "2.4.0")
    with pytest.raises(ValueError):
        util.is_version_greater_equal_than("2.4.0", "2.4")


def test_average_backwards_compatibility_fun_takes_op_then_average() -> None:
    pick = util.get_average_backwards_compatibility_fun(Ops)
    assert pick(None, None) == Ops.Average
    assert pick(Ops.Max, None) == Ops.Max
    with pytest.warns(DeprecationWarning):
        assert pick(None, True) == Ops.Average
    with pytest.warns(DeprecationWarning):
        assert pick(None, False) == Ops.Sum
    with pytest.raises(ValueError, match="supersedes average"):
        pick(Ops.Sum, False)


def test_check_installed_version_finds_no_mismatch() -> None:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert util.check_installed_version("pytorch", torch.__version__) is None
        assert util.check_installed_version("pytorch", "0.0.1", RuntimeError("x")) is None


def test_extension_paths_and_check_extension(tmp_path) -> None:
    pkg = str(tmp_path / "pkg" / "__init__.py")
    full = util.get_extension_full_path(pkg, "sub", "mpi_lib")
    assert full == os.path.join(str(tmp_path / "pkg" / "sub"), "mpi_lib" + util.get_ext_suffix())
    assert util.get_ext_suffix().endswith(".so") or util.get_ext_suffix().endswith(".pyd")
    # hora's torch binding is pure Python: it counts as built
    util.check_extension("horovod.torch", "HOROVOD_WITH_PYTORCH", pkg, "mpi_lib_v2")
    with pytest.raises(ImportError, match="no binding named 'mxnet'"):
        util.check_extension("horovod.mxnet", "HOROVOD_WITH_MXNET", pkg, "mpi_lib")
    os.makedirs(os.path.dirname(full))
    open(full, "w").close()  # a compiled library where Horovod looks counts too
    util.check_extension("horovod.mxnet", "HOROVOD_WITH_MXNET", pkg, "sub", "mpi_lib")
