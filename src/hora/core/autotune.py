"""Online tuning of the fusion threshold and the cycle time (``HOROVOD_AUTOTUNE``), on rank 0.

Rank 0's coordinator alone decides what is fused and how long a cycle holds small tensors for
more, so tuning there changes the whole job without telling the other ranks.

- A *sample* is ``steps_per_sample`` coordinator cycles that handed out work; its score is the
  bytes those cycles handed out per microsecond of wall time. The first ``warmup_samples``
  samples of the job are thrown away.
- A *point* (fusion threshold, cycle time) is scored by the median of :data:`SAMPLES_PER_POINT`
  samples taken with it.
- Points come from Bayesian optimisation: a Gaussian process over both parameters scaled to
  [0, 1] (an RBF kernel; observation noise ``gaussian_process_noise`` on standardised scores),
  and the next point is the candidate with the largest expected improvement. The first point is
  the configured one.
- After ``bayes_opt_max_samples`` points the best one is kept for the rest of the job.
- A parameter set explicitly (environment, ``hora run`` flag or config file) stays pinned.
  Horovod's categorical choices (hierarchical allreduce and allgather, torus, cache) are not
  tuned: they keep their configured values.
- ``autotune_log`` names a CSV file with one row per scored point, in Horovod's columns.

Used by the engine thread of rank 0 only; not thread-safe.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

from hora.settings import MiB, Settings

log = logging.getLogger("hora.autotune")

SAMPLES_PER_POINT = 5
FUSION_MAX = 64 * MiB  # Horovod's range, widened to hold a larger configured threshold
CYCLE_MS = (1.0, 100.0)
LENGTH_SCALE = 0.25
CANDIDATES = 512
CSV_HEADER = (
    "hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
    "cycle_time_ms,tensor_fusion_threshold,score"
)


class Autotuner:
    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
    ) -> None:
        self.settings = settings
        self.fusion_threshold = settings.fusion_threshold
        self.cycle_time_ms = settings.cycle_time_ms
        self.done = False
        self._clock = clock
        self._rng = np.random.default_rng(seed)
        self._fusion_max = max(FUSION_MAX, settings.fusion_threshold)
        pinned = settings.explicit
        self._free = np.array(["fusion_threshold" not in pinned, "cycle_time_ms" not in pinned])
        self._warmup_left = settings.autotune_warmup_samples
        self._steps = max(settings.autotune_steps_per_sample, 1)
        self._max_points = max(settings.autotune_bayes_opt_max_samples, 1)
        self._noise = max(settings.autotune_gaussian_process_noise, 1e-6)
        self._xs: list[np.ndarray] = []
        self._ys: list[float] = []
        self._scores: list[float] = []  # samples of the current point
        self._cycles = 0
        self._bytes = 0
        self._start: float | None = None
        self._log_path = settings.autotune_log
        self.trials: list[dict[str, float]] = []  # one per scored point, for the log and timeline
        if self._log_path:
            with open(self._log_path, "w") as f:
                f.write(CSV_HEADER + "\n")
        if not self._free.any():
            self.done = True
            log.warning("autotune: fusion threshold and cycle time are both set; nothing to tune")

    # -- the engine's side -----------------------------------------------------------------------
    def cycle(self, nbytes: int) -> tuple[int, float] | None:
        """Count one coordinator cycle that handed out ``nbytes``; the new (fusion threshold in
        bytes, cycle time in ms) when the point changes, else None."""
        if self.done:
            return None
        now = self._clock()
        if self._start is None:  # a sample's time runs from the end of the cycle before it
            self._start = now
            return None
        self._cycles += 1
        self._bytes += nbytes
        if self._cycles < self._steps:
            return None
        score = self._bytes / max((now - self._start) * 1e6, 1e-9)
        self._start, self._cycles, self._bytes = now, 0, 0
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return None
        self._scores.append(score)
        if len(self._scores) < SAMPLES_PER_POINT:
            return None
        return self._scored(float(np.median(self._scores)))

    # -- choosing points ---------------------------------------------------------------------
    def _scored(self, score: float) -> tuple[int, float]:
        x = self._point()
        self._xs.append(x)
        self._ys.append(score)
        samples, self._scores = self._scores, []
        self._write_row(score)
        trial = {
            "point": float(len(self._xs)),
            "fusion_threshold_bytes": float(self.fusion_threshold),
            "cycle_time_ms": float(self.cycle_time_ms),
            "score_bytes_per_us": round(score, 3),
        }
        self.trials.append(trial)
        log.info(
            "autotune: point %d (fusion threshold %.1f MiB, cycle time %.2f ms) scored %.1f "
            "bytes/us, the median of %d samples of %d cycles each: %s",
            len(self._xs), self.fusion_threshold / MiB, self.cycle_time_ms, score,
            len(samples), self._steps, ", ".join(f"{v:.1f}" for v in samples),
        )  # fmt: skip
        if len(self._xs) >= self._max_points:
            best = int(np.argmax(self._ys))
            self._set(self._xs[best])
            self.done = True
            log.warning(self.explain(best))
        else:
            self._set(self._suggest())
        trial["next_fusion_threshold_bytes"] = float(self.fusion_threshold)
        trial["next_cycle_time_ms"] = float(self.cycle_time_ms)
        trial["done"] = float(self.done)
        return self.fusion_threshold, self.cycle_time_ms

    def explain(self, best: int) -> str:
        """The closing log line: what was chosen, from what, and the gain over the start."""
        first, top = self.trials[0], self.trials[best]
        start, chosen = first["score_bytes_per_us"], top["score_bytes_per_us"]
        gain = f"{chosen / start:.2f}x the starting point's" if start > 0 else "vs the start's"
        tried = "; ".join(
            f"{t['fusion_threshold_bytes'] / MiB:.1f} MiB/{t['cycle_time_ms']:.2f} ms: "
            f"{t['score_bytes_per_us']:.1f}"
            for t in self.trials
        )
        return (
            f"autotune: chose fusion threshold {self.fusion_threshold / MiB:.1f} MiB and cycle "
            f"time {self.cycle_time_ms:.2f} ms, the best of {len(self.trials)} points (each the "
            f"median of {SAMPLES_PER_POINT} samples of {self._steps} cycles, after "
            f"{self.settings.autotune_warmup_samples} warm-up samples): {chosen:.1f} bytes/us, "
            f"{gain} {start:.1f} bytes/us ({first['fusion_threshold_bytes'] / MiB:.1f} MiB, "
            f"{first['cycle_time_ms']:.2f} ms). Points tried (threshold/cycle: bytes/us): "
            f"{tried}."
        )

    def _point(self) -> np.ndarray:
        lo, hi = CYCLE_MS
        return np.array([
            self.fusion_threshold / self._fusion_max,
            (min(max(self.cycle_time_ms, lo), hi) - lo) / (hi - lo),
        ])  # fmt: skip

    def _set(self, x: np.ndarray) -> None:
        lo, hi = CYCLE_MS
        if self._free[0]:
            self.fusion_threshold = int(round(float(x[0]) * self._fusion_max / MiB)) * MiB
        if self._free[1]:
            self.cycle_time_ms = round(lo + float(x[1]) * (hi - lo), 2)

    def _suggest(self) -> np.ndarray:
        """The candidate with the largest expected improvement under the Gaussian process."""
        xs, ys = np.array(self._xs), np.array(self._ys)
        spread = ys.std()
        y = (ys - ys.mean()) / (spread if spread > 0 else 1.0)
        candidates = self._rng.random((CANDIDATES, 2))
        candidates[:, ~self._free] = xs[0, ~self._free]  # pinned dimensions stay put
        k = _rbf(xs, xs) + self._noise * np.eye(len(xs))
        k_star = _rbf(candidates, xs)
        mean = k_star @ np.linalg.solve(k, y)
        var = 1.0 - np.einsum("ij,ji->i", k_star, np.linalg.solve(k, k_star.T))
        sigma = np.sqrt(np.maximum(var, 1e-12))
        gain = mean - y.max() - 0.01
        z = gain / sigma
        cdf = 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in z]))
        pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
        return candidates[int(np.argmax(gain * cdf + sigma * pdf))]

    def _write_row(self, score: float) -> None:
        if not self._log_path:
            return
        s = self.settings
        row = [
            int(s.hierarchical_allreduce), int(s.hierarchical_allgather), int(s.torus_allreduce),
            int(s.cache_capacity > 0), self.cycle_time_ms, self.fusion_threshold, f"{score:.3f}",
        ]  # fmt: skip
        with open(self._log_path, "a") as f:
            f.write(",".join(str(v) for v in row) + "\n")


def _rbf(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=2)
    return np.exp(-0.5 * d / LENGTH_SCALE**2)
