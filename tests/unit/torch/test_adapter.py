"""The tensor <-> NumPy adapter: views without copies, bfloat16 as uint16, staging, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hora.torch.adapter import stage, to_tensor, write_back


def test_contiguous_cpu_tensor_is_viewed_not_copied():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    s = stage(t)
    assert not s.copied and s.dtype is None
    assert s.array.ctypes.data == t.data_ptr()
    s.array[0, 0] = 42.0
    assert t[0, 0].item() == 42.0


def test_bfloat16_travels_as_uint16_storage():
    t = torch.tensor([1.0, -2.5, 3.0], dtype=torch.bfloat16)
    s = stage(t)
    assert s.dtype == "bfloat16" and s.array.dtype == np.uint16
    assert s.array.ctypes.data == t.data_ptr()
    back = to_tensor(s.array.copy(), t)
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)


def test_results_wrap_without_copy_and_keep_dtype():
    like = torch.zeros(3, dtype=torch.int16)
    arr = np.array([1, 2, 3], dtype=np.int16)
    out = to_tensor(arr, like)
    assert out.dtype == torch.int16 and out.data_ptr() == arr.ctypes.data


def test_non_contiguous_tensor_is_staged_and_written_back():
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    t = base.t()
    s = stage(t)
    assert s.copied and s.array.flags.c_contiguous
    np.testing.assert_array_equal(s.array, t.numpy())
    result = s.array * 2
    assert write_back(s, result) is t
    torch.testing.assert_close(base, torch.arange(12, dtype=torch.float64).reshape(3, 4) * 2)


def test_in_place_result_in_the_same_memory_needs_no_copy():
    t = torch.ones(4)
    s = stage(t)
    np.multiply(s.array, 3, out=s.array)
    assert write_back(s, s.array) is t and t.tolist() == [3.0] * 4


def test_tensors_requiring_grad_and_zero_dim():
    t = torch.ones(2, requires_grad=True)
    assert stage(t).array.tolist() == [1.0, 1.0]
    assert stage(torch.tensor(5)).array.shape == ()


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (torch.ones(2, dtype=torch.complex64), TypeError, "not supported"),
        (np.ones(2), TypeError, "torch.Tensor"),
        (torch.ones(2, 2).to_sparse(), TypeError, "sparse"),
    ],
)
def test_bad_inputs_are_rejected_with_a_clear_error(bad, error, match):
    with pytest.raises(error, match=match):
        stage(bad)
