"""Compression round trips: dtypes on the wire and values restored."""

from __future__ import annotations

import pytest
import torch

from hora.torch.compression import Compression


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("compressor", "wire", "atol"),
    [(Compression.fp16, torch.float16, 1e-3), (Compression.bf16, torch.bfloat16, 1e-2)],
)
def test_cast_compressors_halve_floats_and_restore(dtype, compressor, wire, atol):
    t = torch.linspace(-1, 1, 101, dtype=dtype)
    sent, ctx = compressor.compress(t)
    assert sent.dtype == wire
    back = compressor.decompress(sent, ctx)
    assert back.dtype == dtype
    torch.testing.assert_close(back, t, atol=atol, rtol=0)


@pytest.mark.parametrize("compressor", [Compression.fp16, Compression.bf16, Compression.none])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.float16])
def test_non_wide_float_tensors_pass_unchanged(compressor, dtype):
    t = torch.arange(10).to(dtype)
    sent, ctx = compressor.compress(t)
    assert sent is t
    assert compressor.decompress(sent, ctx) is t


def test_none_keeps_float32():
    t = torch.randn(5)
    sent, ctx = Compression.none.compress(t)
    assert sent is t and ctx is None
