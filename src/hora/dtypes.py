"""hora's wire dtypes and how NumPy arrays map onto them.

bfloat16 has no NumPy dtype of its own: it travels as 16-bit storage (``uint16``) tagged
``bfloat16``, and reductions widen it to float32 (see ``collectives/reduce_ops.py``). When the
optional ``ml_dtypes`` package is installed, its ``bfloat16`` arrays are recognised directly.
"""

from __future__ import annotations

import numpy as np

from hora.errors import UnsupportedTypeError

DTYPES: tuple[str, ...] = (
    "uint8",
    "int8",
    "uint16",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "bool",
)

try:  # optional
    import ml_dtypes as _ml

    _BF16: np.dtype | None = np.dtype(_ml.bfloat16)
except Exception:  # pragma: no cover - depends on the environment
    _BF16 = None

FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})


_NAMES: dict[np.dtype, str] = {np.dtype(n): n for n in DTYPES if n != "bfloat16"}
if _BF16 is not None:
    _NAMES[_BF16] = "bfloat16"


def name_of(dtype: np.dtype) -> str:
    """The hora dtype name of a NumPy dtype; UnsupportedTypeError (a TypeError and, as in
    Horovod, a ValueError) for anything hora does not carry."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        pass
    dtype = np.dtype(dtype)
    if dtype in _NAMES:
        return _NAMES[dtype]
    raise UnsupportedTypeError(f"Tensor type {dtype.name} is not supported.")


_STORAGE: dict[str, np.dtype] = {}  # dtype name -> storage dtype, filled on first use


def storage_dtype(name: str) -> np.dtype:
    """The NumPy dtype that holds ``name`` in memory (uint16 for bfloat16)."""
    st = _STORAGE.get(name)
    if st is None:  # a name not seen yet (np.dtype raises for one hora does not carry)
        st = _STORAGE[name] = np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)
    return st


def storage_view(arr: np.ndarray, name: str) -> np.ndarray:
    """``arr`` viewed in its storage dtype (a no-op except for bfloat16)."""
    st = storage_dtype(name)
    return arr if arr.dtype == st else arr.view(st)


_ITEMSIZE: dict[str, int] = {}  # dtype name -> bytes per element, filled on first use


def itemsize(name: str) -> int:
    size = _ITEMSIZE.get(name)
    if size is None:  # a name not seen yet (storage_dtype raises for one hora does not carry)
        size = _ITEMSIZE[name] = storage_dtype(name).itemsize
    return size
