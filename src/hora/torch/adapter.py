"""Torch tensors as the NumPy buffers the op surface works on, and results back as tensors.

A contiguous CPU tensor is viewed, not copied: the engine reads and (for in-place ops) writes the
tensor's own memory. bfloat16 has no NumPy dtype, so its storage is viewed as ``uint16`` and
tagged ``dtype="bfloat16"``. CUDA tensors and non-contiguous tensors are staged through a
contiguous host copy; in-place ops copy the result back into the user's tensor.

``stage`` runs in the caller's thread; ``to_tensor``/``write_back`` run wherever the result is
finalized (the engine thread). All functions are pure apart from the in-place write-back, and
thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hora.errors import UnsupportedTypeError

_WIRE_NAMES: dict[torch.dtype, str] = {
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bool: "bool",
}
if hasattr(torch, "uint16"):
    _WIRE_NAMES[torch.uint16] = "uint16"


@dataclass(frozen=True)
class Staged:
    """A tensor prepared for the op surface.

    ``array`` is what the engine reads (and writes, for in-place ops); it aliases ``tensor``
    unless ``copied``. ``dtype`` is the hora dtype override to pass along (``"bfloat16"``) or None.
    """

    tensor: torch.Tensor
    array: np.ndarray
    dtype: str | None
    copied: bool


def check_tensor(tensor: object, what: str = "tensor") -> torch.Tensor:
    """``tensor`` if it is a dense torch tensor of a supported dtype; TypeError otherwise
    (UnsupportedTypeError, also a ValueError as in Horovod, for a dtype that cannot travel)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(
            f"{what} has layout {tensor.layout}; only dense tensors are supported here "
            "(use sparse_allreduce_async for sparse tensors)"
        )
    if tensor.dtype not in _WIRE_NAMES:
        raise UnsupportedTypeError(f"Tensor type {tensor.dtype} is not supported.")
    return tensor


def stage(tensor: torch.Tensor, what: str = "tensor") -> Staged:
    """Expose ``tensor``'s data as a NumPy array: a view when possible, else a host copy."""
    check_tensor(tensor, what)
    host = tensor.detach()
    copied = False
    if host.device.type != "cpu":
        host = host.to("cpu")
        copied = True
    if not host.is_contiguous():
        host = host.contiguous()
        copied = True
    host = host.resolve_conj().resolve_neg()
    if host.dtype == torch.bfloat16:
        return Staged(tensor, host.view(torch.int16).numpy().view(np.uint16), "bfloat16", copied)
    return Staged(tensor, host.numpy(), None, copied)


def _host_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``array`` as a CPU tensor of ``dtype``, sharing its memory where the dtypes allow."""
    if not array.flags.writeable:
        array = array.copy()
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    out = torch.from_numpy(array)
    return out if out.dtype == dtype else out.to(dtype)


def to_tensor(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Wrap a result array as a tensor with ``like``'s dtype and device (no copy on CPU)."""
    out = _host_tensor(array, like.dtype)
    return out if like.device.type == "cpu" else out.to(like.device)


def write_back(staged: Staged, result: np.ndarray) -> torch.Tensor:
    """Finish an in-place op: the user's tensor, holding ``result``."""
    if staged.copied or not np.may_share_memory(result, staged.array):
        target = staged.tensor.data
        target.copy_(_host_tensor(result, target.dtype).view(target.shape))
    return staged.tensor
