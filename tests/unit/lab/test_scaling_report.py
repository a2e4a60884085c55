"""Scaling-lab numbers and rendering from synthetic results: summarize, derive, the lab's
tables (text and Markdown), the comparison of two runs, files, and ``hora bench report``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from hora.lab import bench_report as br
from hora.lab import bench_results as res
from hora.lab import envreport

PNG = b"\x89PNG\r\n\x1a\n"


def _ranks(np_: int, compute: list[float], wait: list[float]) -> list[dict[str, Any]]:
    """Rank r's phase times: compute + 0.01 * r (rank 1 is slower), the same wait."""
    return [
        {
            "rank": r,
            "backend": "native",
            "params": 1000,
            "grad_bytes": 4000,
            "data_s": [0.0] * len(compute),
            "compute_s": [c + 0.01 * r for c in compute],
            "wait_s": list(wait),
            "update_s": [0.001] * len(compute),
        }
        for r in range(np_)
    ]


def _row(model: str, backend: str, servers: int, per: int, step: float, **kw: Any) -> res.Row:
    np_ = servers * per
    return {
        "model": model, "backend": backend, "servers": servers, "per_server": per, "np": np_,
        "hosts": [f"h{i}" for i in range(servers)], "batch_size": 10, "steps": 5, "warmup": 1,
        "step_mean_s": step, "step_std_s": step / 10, "step_p50_s": step, "step_p90_s": step,
        "data_s": 0.0, "compute_s": step * 0.6, "wait_s": step * 0.3, "update_s": step * 0.1,
        "comm_share": 0.3, "throughput": np_ * 10 / step, "params": 2_000_000,
        "grad_bytes": 8_000_000, "wall_s": 3.0, **kw,
    }  # fmt: skip


ROWS = [
    _row("cnn", "native", 1, 1, 0.100),
    _row("cnn", "native", 1, 2, 0.125),
    _row("cnn", "native", 2, 1, 0.160),
    _row("cnn", "native", 2, 2, 0.200),
    _row("cnn", "gloo", 1, 1, 0.110),
    _row("cnn", "gloo", 1, 2, 0.150),
    _row("lstm", "native", 1, 1, 0.050),
    _row("lstm", "native", 1, 2, 0.080),
]
ENV = [{k: f"{k}-a" for _, _, k in envreport.ROWS} | {"host": "alpha"}]


def _result(rows: list[res.Row] = ROWS, **kw: Any) -> res.ScalingResult:
    meta = {"backends": ["native", "gloo", "mpi"], "batch_sizes": {"cnn": 10, "lstm": 10},
            "steps": 5, "warmup": 1, "threads": 1, "date": "today"}  # fmt: skip
    return res.ScalingResult(meta, ENV, list(rows), **kw)


def test_summarize_takes_the_mean_over_ranks_per_step_and_derives_throughput() -> None:
    ranks = _ranks(2, compute=[0.10, 0.20, 0.30], wait=[0.05, 0.05, 0.05])
    row = res.summarize(ranks, {"batch_size": 8, "model": "mlp"})
    assert row["np"] == 2 and row["model"] == "mlp"
    # the two ranks' steps: compute (+ 0.01 on rank 1) + wait 0.05 + update 0.001
    assert row["step_times_s"] == pytest.approx([0.156, 0.256, 0.356])
    assert row["step_mean_s"] == pytest.approx(0.256)
    assert row["step_std_s"] == pytest.approx(0.1)
    assert row["throughput"] == pytest.approx(2 * 8 / 0.256)
    assert row["wait_s"] == pytest.approx(0.05)
    assert row["compute_s"] == pytest.approx(0.205)
    assert row["comm_share"] == pytest.approx(0.05 / (0.205 + 0.05 + 0.001))
    assert row["step_p50_s"] == pytest.approx(0.256)
    assert row["step_mean_s"] < row["step_p90_s"] <= 0.356
    assert row["backend_used"] == "native" and row["params"] == 1000


def test_a_step_is_the_ranks_wall_time_not_their_offsets_added_up() -> None:
    """Two ranks that wait for each other every step spend the same wall time, 0.2 s a step;
    their step boundaries sit at different points (each updates longer one step and shorter
    the next, out of phase), so their own steps alternate 0.25 and 0.15. The step is 0.2 s,
    not the 0.25 that the longer of the two steps is each time."""
    ranks = _ranks(2, compute=[0.1] * 4, wait=[0.05] * 4)
    for r, update in zip(ranks, ([0.1, 0.0, 0.1, 0.0], [0.0, 0.1, 0.0, 0.1])):
        r["compute_s"] = [0.1] * 4
        r["update_s"] = update
    assert [sum(s) for s in zip(*(ranks[1][f"{p}_s"] for p in res.PHASES))] == pytest.approx(
        [0.15, 0.25, 0.15, 0.25])
    row = res.summarize(ranks, {"batch_size": 1})
    assert row["step_times_s"] == pytest.approx([0.2] * 4)
    assert row["step_mean_s"] == pytest.approx(0.2)


def test_summarize_rejects_ranks_with_different_step_counts() -> None:
    ranks = _ranks(2, [0.1, 0.2], [0.0, 0.0])
    ranks[1]["compute_s"] = [0.1]
    with pytest.raises(ValueError, match="same number of steps"):
        res.summarize(ranks, {"batch_size": 1})
    with pytest.raises(ValueError):
        res.summarize([], {"batch_size": 1})


def test_speedup_is_the_throughput_ratio_to_one_process_of_the_same_backend() -> None:
    derived = {(r["model"], r["backend"], r["servers"], r["per_server"]): r
               for r in res.derive(ROWS)}  # fmt: skip
    two = derived[("cnn", "native", 1, 2)]
    assert two["speedup"] == pytest.approx(two["throughput"] / derived[("cnn", "native", 1, 1)]["throughput"])  # fmt: skip  # noqa: E501
    assert two["speedup"] == pytest.approx(1.6)
    assert two["efficiency"] == pytest.approx(0.8)
    assert derived[("cnn", "gloo", 1, 2)]["speedup"] == pytest.approx(2 * 0.110 / 0.150)
    no_base = res.derive([_row("mlp", "mpi", 1, 2, 0.1)])[0]
    assert no_base["speedup"] is None and no_base["efficiency"] is None


def test_intra_table_has_the_labs_columns_and_only_one_server_runs() -> None:
    headers, body = br.intra_table(ROWS, "cnn", ["native", "gloo"])
    assert headers[:6] == [
        "backend", "servers", "processes/server", "avg step time (ms)",
        "avg throughput (samples/s)", "speedup",
    ]  # fmt: skip
    assert [(r[0], r[1], r[2]) for r in body] == [
        ("native", "1", "1"), ("native", "1", "2"), ("gloo", "1", "1"), ("gloo", "1", "2"),
    ]  # fmt: skip
    assert body[1][3] == "125.0 ± 12.5"
    assert body[1][4] == "160.0" and body[1][5] == "1.60" and body[1][6] == "80%"
    assert body[1][7] == "30%"


def test_inter_table_groups_by_processes_per_server_from_one_server_up() -> None:
    _, body = br.inter_table(ROWS, "cnn", ["native", "gloo"])
    assert [(r[0], r[1], r[2]) for r in body] == [
        ("native", "1", "1"), ("native", "2", "1"), ("native", "1", "2"), ("native", "2", "2"),
    ]  # fmt: skip
    assert body[1][5] == f"{(2 * 10 / 0.160) / 100:.2f}"
    assert br.inter_table(ROWS, "lstm")[1] == []


def test_the_links_bytes_per_step_show_where_a_run_counted_them() -> None:
    """A --netns run counts what its hosts' links sent: a column of the lab's tables and the
    CSV, with a note on what it averages; runs without the count have neither."""
    assert br.LINK_HEADER not in br.inter_table(ROWS, "cnn")[0]
    assert "link_bytes_per_step" not in br.to_csv(ROWS).splitlines()[0]
    linked = [_row("mlp", "native", 2, 2, 0.2, link_bytes_per_step=27_850_000.0,
                   link_rate="1gbit"),
              _row("mlp", "native+fp16", 2, 2, 0.15, link_bytes_per_step=14_400_000.0,
                   link_rate="500mbit"),
              _row("mlp", "native", 1, 2, 0.1),
              # DDP communicates inside backward: its compute holds the wait, no bound to give
              _row("mlp", "ddp", 2, 2, 0.2, link_bytes_per_step=7e6, link_rate="1gbit",
                   comm_share=None)]  # fmt: skip
    headers, body = br.inter_table(linked, "mlp", ["native", "native+fp16", "ddp"])
    at = headers.index(br.LINK_HEADER)
    assert headers[at + 1] == br.BOUND_HEADER
    # compute and update (70% of the step) plus one host's half of the bytes at the link's rate
    assert [(r[0], r[1], r[at], r[at + 1]) for r in body] == [
        ("native", "1", "-", "-"),
        ("native", "2", "27.85", f"{0.14e3 + 13.925e6 * 8 / 1e9 * 1e3:.1f}"),
        ("native+fp16", "2", "14.40", f"{0.105e3 + 7.2e6 * 8 / 5e8 * 1e3:.1f}"),
        ("ddp", "2", "7.00", "-"),
    ]
    assert br.link_bound_s(linked[0]) == pytest.approx(0.14 + 0.1114)
    csv_rows = br.to_csv(linked).splitlines()
    assert csv_rows[0].endswith(",link_bytes_per_step") and csv_rows[1].endswith(",27850000.0")
    text = br.render_text(_result(linked))
    assert "MB/step on the links: what the namespace hosts' links sent" in text


def test_model_table_compares_models_at_their_largest_process_count() -> None:
    headers, body = br.model_table(ROWS, ["native", "gloo"])
    assert headers[0] == "model" and "comm wait share" in headers
    assert [(r[0], r[3], r[4]) for r in body] == [("cnn", "native", "2x2"), ("lstm", "native", "1x2")]  # fmt: skip  # noqa: E501
    assert body[0][1] == "2.00" and body[0][2] == "8.0"


def test_text_and_markdown_show_every_section_and_the_notes() -> None:
    failed = [{"model": "cnn", "backend": "mpi", "servers": 1, "per_server": 2, "reason": "boom"}]
    result = _result(skipped={"nccl": "needs an NVIDIA GPU"}, failed=failed)
    text = br.render_text(result)
    for title in ("Speedup inside one server: cnn", "Speedup across servers: cnn",
                  "Speedup inside one server: lstm", "Compute and communication by model",
                  "Environment", "skipped nccl: needs an NVIDIA GPU", "failed cnn mpi 1x2: boom"):  # fmt: skip  # noqa: E501
        assert title in text
    assert "Speedup across servers: lstm" not in text
    assert "Load average" not in text and "better than linearly" not in text
    fast = _result([*ROWS[:1], _row("cnn", "native", 1, 2, 0.09)])
    assert "1 configuration(s) scale better than linearly" in br.render_text(fast)
    loaded = _result()
    loaded.meta.update(load_before=[1.5, 1, 1], load_after=[2.25, 1, 1])
    assert "Load average (1 min) of this host: 1.5 before, 2.25 after" in br.render_text(loaded)
    md = br.render_markdown(result)
    assert "## Speedup inside one server: cnn" in md
    assert "| native | 1 | 2 | 125.0 ± 12.5 | 160.0 | 1.60 | 80% | 30% |" in md
    assert "- skipped nccl: needs an NVIDIA GPU" in md
    one_server = br.render_text(_result(ROWS[:2]))
    assert "no run across servers" in one_server and "across servers: cnn" not in one_server


def test_markdown_escapes_pipes_and_counts_lines() -> None:
    md = br.markdown((["a", "b"], [["x|y", "1"], ["z", "2"]]))
    lines = md.splitlines()
    assert len(lines) == 4 and lines[1] == "|---|---|" and lines[2] == "| x\\|y | 1 |"


def test_compare_gives_ratios_and_counts_regressions() -> None:
    slower = [dict(r, throughput=r["throughput"] * (0.5 if r["backend"] == "gloo" else 1.0))
              for r in ROWS[:-1]]  # fmt: skip
    (headers, body), below = br.compare_table(_result(), _result(slower), fail_below=0.9)
    assert headers[8] == "B/A throughput"
    assert len(body) == len(ROWS) - 1  # the missing configuration is left out
    ratios = {(r[0], r[1], r[3]): (r[8], r[9]) for r in body if r[2] == "1"}
    assert ratios[("cnn", "native", "2")] == ("1.000", "")
    assert ratios[("cnn", "gloo", "2")] == ("0.500", "REGRESSION")
    assert below == 2
    assert br.compare_table(_result(), _result(slower))[1] == 0


def test_save_writes_json_csv_markdown_and_pngs_that_load_back(tmp_path: Path) -> None:
    result = _result(skipped={"nccl": "no GPU"})
    written = br.save(result, tmp_path / "out")
    names = sorted(p.name for p in written)
    assert names == ["breakdown.png", "results.csv", "results.json", "scaling_cnn.png",
                     "scaling_lstm.png", "tables.md"]  # fmt: skip
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000
    back = br.load(tmp_path / "out")
    assert back.skipped == {"nccl": "no GPU"} and back.environment == ENV
    assert [r["throughput"] for r in back.rows] == [r["throughput"] for r in ROWS]
    assert back.rows[1]["speedup"] == pytest.approx(1.6)
    csv_lines = (tmp_path / "out" / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("model,backend,servers,per_server,np,hosts")
    assert len(csv_lines) == len(ROWS) + 1 and ",h0+h1," in csv_lines[3]


def test_load_names_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        br.load(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a hora bench scaling result"):
        br.load(tmp_path)


def _report(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    br.configure(parser)
    code = br.command(parser.parse_args(list(argv)))
    out, err = capsys.readouterr()
    return code, out, err


def test_report_command_rerenders_and_compares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    br.save(_result(), a, plots=False)
    br.save(_result([dict(r, throughput=r["throughput"] * 0.8) for r in ROWS]), b, plots=False)
    code, out, _ = _report(capsys, str(a))
    assert code == 0 and "Speedup inside one server: cnn" in out
    assert (a / "scaling_cnn.png").read_bytes()[:8] == PNG
    code, out, _ = _report(capsys, str(a), str(b), "--out", str(tmp_path / "cmp"))
    assert code == 0 and "0.800" in out
    assert (tmp_path / "cmp" / "comparison.png").read_bytes()[:8] == PNG
    assert "| cnn | native |" in (tmp_path / "cmp" / "comparison.md").read_text()
    code, out, _ = _report(capsys, str(a), str(b), "--fail-below", "0.9")
    assert code == 1 and "8 configuration(s) below 0.9" in out
    code, _, err = _report(capsys, str(tmp_path / "missing"))
    assert code == 2 and "not found" in err
    code, _, err = _report(capsys, str(a), str(b), str(a))
    assert code == 2 and "one or two" in err
