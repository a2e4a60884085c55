"""The autotuner: samples, warm-up, pinned parameters, the CSV log, that Bayesian optimisation
finds a known optimum, and a real two-rank job tuning itself while its results stay right."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import run_ranks
from hora.core.autotune import CSV_HEADER, SAMPLES_PER_POINT, Autotuner
from hora.settings import MiB, Settings


def _throughput(fusion: float, cycle_ms: float) -> float:
    """A made-up job's bytes per 1 ms cycle: best at 32 MiB and 5 ms."""
    return 1e6 * float(np.exp(-(((fusion / MiB - 32) / 20) ** 2) - ((cycle_ms - 5) / 30) ** 2))


def _drive(tuner: Autotuner, limit: int = 100_000) -> tuple[int, list[tuple[int, float]]]:
    """Run cycles 1 ms apart until the tuner is done: (cycles, the points it moved to)."""
    now = [0.0]
    tuner._clock = lambda: now[0]
    points = []
    for cycles in range(1, limit):
        now[0] += 0.001
        point = tuner.cycle(int(_throughput(tuner.fusion_threshold, tuner.cycle_time_ms)))
        if point is not None:
            points.append(point)
        if tuner.done:
            return cycles, points
    raise AssertionError("the tuner never finished")


def test_bayesian_optimisation_ends_near_the_best_point() -> None:
    settings = Settings(autotune=True, autotune_steps_per_sample=2, autotune_warmup_samples=1)
    cycles, points = _drive(Autotuner(settings))
    assert len(points) == settings.autotune_bayes_opt_max_samples == 20
    # one cycle starts the clock; then warm-up and five samples per point, two cycles each
    assert cycles == 1 + (1 + SAMPLES_PER_POINT * 20) * 2
    scores = [_throughput(*p) for p in points[:-1]]
    final = points[-1]
    assert _throughput(*final) == max(scores + [_throughput(128 * MiB, 1.0)])
    assert _throughput(*final) >= 0.9 * _throughput(32 * MiB, 5.0), final
    assert len({p for p in points}) > 10  # it explored, not only stayed near the start


def test_the_first_point_changes_after_warm_up_and_five_samples() -> None:
    settings = Settings(
        autotune=True, autotune_steps_per_sample=3, autotune_warmup_samples=2,
        autotune_bayes_opt_max_samples=2,
    )  # fmt: skip
    tuner = Autotuner(settings, clock=iter(np.arange(1000) * 0.001).__next__)
    changed = [n for n in range(1, 60) if tuner.cycle(1000) is not None]
    assert changed == [1 + (2 + 5) * 3, 1 + (2 + 10) * 3]
    assert tuner.done and tuner.cycle(1000) is None


def test_a_parameter_set_explicitly_stays_pinned() -> None:
    settings = Settings(
        autotune=True, fusion_threshold=8 * MiB, autotune_steps_per_sample=1,
        autotune_warmup_samples=0, autotune_bayes_opt_max_samples=6,
        explicit=frozenset({"fusion_threshold"}),
    )  # fmt: skip
    _, points = _drive(Autotuner(settings))
    assert {f for f, _ in points} == {8 * MiB}
    assert len({c for _, c in points}) > 2
    both = settings.replace(explicit=frozenset({"fusion_threshold", "cycle_time_ms"}))
    tuner = Autotuner(both)
    assert tuner.done and tuner.cycle(10) is None


def test_every_scored_point_is_a_row_of_the_log(tmp_path: Path) -> None:
    log = tmp_path / "autotune.csv"
    settings = Settings(
        autotune=True, autotune_log=str(log), autotune_steps_per_sample=1,
        autotune_warmup_samples=0, autotune_bayes_opt_max_samples=4, cycle_time_ms=5.0,
        fusion_threshold=32 * MiB,
    )  # fmt: skip
    _drive(Autotuner(settings))
    lines = log.read_text().splitlines()
    assert lines[0] == CSV_HEADER
    assert len(lines) == 1 + 4
    first = lines[1].split(",")
    assert first[:4] == ["0", "0", "0", "1"]  # the categorical choices, not tuned
    assert (float(first[4]), int(first[5])) == (5.0, 32 * MiB)  # the configured point
    assert float(first[6]) == pytest.approx(1000.0)  # bytes per microsecond


def _tuned_job(rank: int, log: str) -> dict[str, Any]:
    import numpy as np

    import hora
    from hora.core.runtime import runtime

    hora.init()
    try:
        wrong = 0
        for step in range(80):
            grads = [np.full(1000 * (i + 1), rank + step, np.float32) for i in range(4)]
            handles = [
                hora.allreduce_async(g, op=hora.Sum, name=f"g{i}") for i, g in enumerate(grads)
            ]
            for h in handles:
                got = hora.synchronize(h)
                wrong += int(not np.all(got == 2 * step + 1))
        engine = runtime().engine
        tuner = engine._tuner
        return {
            "wrong": wrong,
            "done": tuner.done if tuner is not None else None,
            "threshold": engine.coordinator.fusion_threshold if engine.coordinator else None,
        }
    finally:
        hora.shutdown()


@pytest.mark.timeout(120)
def test_a_two_rank_job_tunes_itself_and_its_sums_stay_right(tmp_path: Path) -> None:
    log = tmp_path / "autotune.csv"
    env = {
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "3",
        "HOROVOD_TIMELINE": str(tmp_path / "tl.{rank}.json"),
    }  # fmt: skip
    results = run_ranks(_tuned_job, 2, args=(str(log),), env=env, timeout=100)
    assert [r["wrong"] for r in results] == [0, 0]
    assert results[0]["done"] is True  # rank 0 tunes; the others have no tuner
    assert results[1]["done"] is None
    lines = log.read_text().splitlines()
    assert lines[0] == CSV_HEADER and len(lines) == 1 + 3
    chosen = max(lines[1:], key=lambda line: float(line.split(",")[6]))
    assert results[0]["threshold"] == int(chosen.split(",")[5])
    # every trial is an AUTOTUNE instant in rank 0's timeline, and hora timeline lists them
    from hora.lab.timeline import align, analyze, load

    traces = load([str(tmp_path / "tl.0.json"), str(tmp_path / "tl.1.json")])
    align(traces)
    trials = analyze(traces)["autotune"]
    assert [int(t["fusion_threshold_bytes"]) for t in trials] == [
        int(line.split(",")[5]) for line in lines[1:]
    ]
    assert trials[-1]["done"] == 1.0 and trials[-1]["next_fusion_threshold_bytes"] == float(
        results[0]["threshold"]
    )


def test_autotune_explains_its_choice_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(
        autotune=True, autotune_steps_per_sample=2, autotune_warmup_samples=1,
        autotune_bayes_opt_max_samples=6, fusion_threshold=16 * MiB,
    )  # fmt: skip
    tuner = Autotuner(settings)
    with caplog.at_level("INFO", logger="hora.autotune"):
        _drive(tuner)
    assert len(tuner.trials) == 6
    scores = [t["score_bytes_per_us"] for t in tuner.trials]
    best = tuner.trials[int(np.argmax(scores))]
    assert (tuner.fusion_threshold, tuner.cycle_time_ms) == (
        best["fusion_threshold_bytes"], best["cycle_time_ms"],
    )  # fmt: skip
    [final] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert final.startswith(
        f"autotune: chose fusion threshold {tuner.fusion_threshold / MiB:.1f} MiB and cycle "
        f"time {tuner.cycle_time_ms:.2f} ms, the best of 6 points (each the median of "
        f"{SAMPLES_PER_POINT} samples of 2 cycles, after 1 warm-up samples)"
    )
    assert f"{max(scores) / scores[0]:.2f}x the starting point's {scores[0]:.1f} bytes/us" in final
    assert "16.0 MiB/1.00 ms" in final  # the starting point is among the points tried
    per_point = [r.getMessage() for r in caplog.records if "scored" in r.getMessage()]
    assert len(per_point) == 6 and "the median of 5 samples of 2 cycles each" in per_point[0]
