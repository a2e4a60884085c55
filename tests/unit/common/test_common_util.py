"""hora.common.util answers as horovod.common.util does: gpu_available(ext_base_name) and the
*_built questions, without raising for a framework that is missing."""

from __future__ import annotations

import inspect

import pytest

from hora.common import util


def test_gpu_available_has_horovods_signature() -> None:
    params = list(inspect.signature(util.gpu_available).parameters.values())
    assert [p.name for p in params] == ["ext_base_name", "verbose"]
    assert params[1].default is False


def test_gpu_available_matches_what_the_framework_sees() -> None:
    torch = pytest.importorskip("torch")
    assert util.gpu_available("torch") is bool(torch.cuda.is_available())


@pytest.mark.parametrize("name", ["mxnet", "no_such_framework"])
def test_gpu_available_is_false_where_hora_has_no_binding(name: str) -> None:
    assert util.gpu_available(name) is False


def test_built_answers_agree_with_hora() -> None:
    import hora

    assert util.mpi_built() == hora.mpi_built()
    assert util.gloo_built() == hora.gloo_built()
    assert util.nccl_built() == hora.nccl_built()
    assert util.ccl_built() is False and util.ddl_built() is False
    assert util.extension_available("torch") == util._has("torch")


def test_helpers() -> None:
    assert util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert [n for n in range(10) if util.num_rank_is_power_2(n)] == [1, 2, 4, 8]
    assert util.is_iterable([1]) and not util.is_iterable(3)


def test_is_version_greater_equal_than() -> None:
    assert util.is_version_greater_equal_than("2.21.0", "2.6.0")
    assert not util.is_version_greater_equal_than("2.5.3", "2.6.0")
    with pytest.raises(ValueError, match="major.minor.patch"):
        util.is_version_greater_equal_than("2.21.0", "2.6")
    with pytest.raises(ValueError, match="version strings"):
        util.is_version_greater_equal_than(2.21, "2.6.0")
