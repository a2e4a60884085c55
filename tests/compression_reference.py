"""NumPy references of PowerSGD and top-k over a simulated world: every rank's gradients in one
process, averaged with plain NumPy means. Written from the algorithms' definitions (the paper's
Algorithm 1; top-k with error feedback), independently of hora's code, for tests to compare."""

from __future__ import annotations

import zlib

import numpy as np


def powersgd_step(grads: list[np.ndarray], errors: list[np.ndarray], q: np.ndarray | None,
                  rank: int, name: str, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray],
                                                             np.ndarray]:  # fmt: skip
    """One step for one matrix: (average, every rank's new error, new Q)."""
    n = grads[0].shape[0]
    m = grads[0].size // n
    r = min(rank, n, m)
    ms = [(g.reshape(n, m) + e.reshape(n, m)).astype(np.float32) for g, e in zip(grads, errors)]
    if q is None:
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        q = rng.standard_normal((m, r)).astype(np.float32)
    p = np.mean([mat @ q for mat in ms], axis=0)
    p = np.linalg.qr(p)[0]
    q = np.mean([mat.T @ p for mat in ms], axis=0)
    approx = p @ q.T
    return approx.reshape(grads[0].shape), [(mat - approx).reshape(grads[0].shape) for mat in ms], q


def topk_step(grads: list[np.ndarray], errors: list[np.ndarray],
              k: int) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
    """One step for one flat gradient: (average, every rank's new error)."""
    total = np.zeros(grads[0].size, np.float64)
    new_errors = []
    for g, e in zip(grads, errors):
        acc = g.reshape(-1) + e.reshape(-1)
        order = np.argsort(-np.abs(acc), kind="stable")
        keep = order[:k]
        total[keep] += acc[keep]
        left = acc.copy()
        left[keep] = 0
        new_errors.append(left.reshape(g.shape))
    return (total / len(grads)).astype(np.float32).reshape(grads[0].shape), new_errors


def assert_powersgd_state_restored(now: dict, committed: dict) -> None:
    """A PowerSGD compressor's ``state_dict()`` after a restore holds the committed one's
    factors (``shared``: ``q``) and error memory (``local``: ``error``), bit for bit."""
    for name, slot in committed["local"].items():
        np.testing.assert_array_equal(now["local"][name]["error"], slot["error"])
    for name, slot in committed["shared"].items():
        np.testing.assert_array_equal(now["shared"][name]["q"], slot["q"])
