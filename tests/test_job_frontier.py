"""The job-level comparison: headroom (reactive plus k spare nodes per pool) on hand-made
job lists, the rows' fields, the matched view, and `simulate --synthetic --frontier`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_simulator import BEGIN, LEVELS, flat_outlook, gpu_pool, jobs

from scaler.evaluation.job_frontier import (
    ABLATIONS,
    HEADROOM_NODES,
    JobRun,
    _run_all,
    _Stream,
    job_runs,
    matched_view,
)
from scaler.evaluation.job_simulator import simulate_jobs
from scaler.planning.planner import PlannerPolicy

# BENCHMARKS.md "## jobs": the fields every row carries.
ROW_FIELDS = {
    "mode",
    "knob",
    "default",
    "jobs",
    "unstarted",
    "gpu_hours",
    "cost",
    "wait_mean_min",
    "wait_p95_min",
    "wait_p99_min",
    "share_waiting",
    "gpu_minutes_waited",
    "seconds",
}


def stream(job_list: pd.DataFrame, minutes: int = 90, forecast_gpus: float = 0.0) -> _Stream:
    return _Stream(
        job_list,
        (gpu_pool(min_size=0),),
        BEGIN,
        BEGIN,
        BEGIN + pd.Timedelta(minutes=minutes),
        PlannerPolicy(mode="predictive", job_wait_share=0.5),
        flat_outlook(forecast_gpus, minutes),
        LEVELS,
        None,
        "fifo",
    )


def test_one_spare_node_serves_a_job_at_once_and_is_paid_for() -> None:
    # Nothing runs until 40: reactive asks for a node when the job arrives (10-minute
    # boot); headroom 1 bought a spare node at the start, held by a placeholder, which the
    # job preempts, and then asks for another spare node.
    reactive, spare = _run_all(
        stream(jobs((40.0, 8, 1000, 30))), [JobRun("reactive"), JobRun("headroom", 1)], 1
    )
    assert reactive.waits.tolist() == [10.0]
    assert spare.waits.tolist() == [0.0]
    assert spare.placeholders_preempted == 1
    assert spare.gpu_hours > reactive.gpu_hours
    nodes = spare.fleet.set_index("ds")["nodes"]
    assert nodes[BEGIN + pd.Timedelta(minutes=20)] == 1  # the spare node, idle
    assert nodes[BEGIN + pd.Timedelta(minutes=41)] == 2  # taken, and a new spare asked for
    assert (spare.row()["mode"], spare.row()["knob"]) == ("headroom", 1)


def test_k_spare_nodes_are_kept_while_nothing_runs_and_restored_after_use() -> None:
    (idle,) = _run_all(stream(jobs((200.0, 8, 1000, 10)), minutes=240), [JobRun("headroom", 3)], 1)
    nodes = idle.fleet.set_index("ds")["nodes"]
    assert nodes[BEGIN + pd.Timedelta(minutes=100)] == 3  # never removed as unneeded
    assert nodes[BEGIN + pd.Timedelta(minutes=205)] == 4  # one in use, three spare
    assert nodes[BEGIN + pd.Timedelta(minutes=235)] == 3  # the used one went after 10 min
    assert idle.waits.tolist() == [0.0]


def test_spare_nodes_belong_to_headroom_mode_only() -> None:
    with pytest.raises(ValueError, match="headroom"):
        simulate_jobs(
            jobs((1.0, 8, 1000, 10)),
            [gpu_pool()],
            "reactive",
            BEGIN,
            BEGIN,
            BEGIN + pd.Timedelta(minutes=30),
            PlannerPolicy(mode="reactive"),
            spare=1,
        )


def test_runs_are_reactive_headroom_then_predictive_with_the_default_marked() -> None:
    runs = job_runs(
        PlannerPolicy(job_wait_share=0.5),
        HEADROOM_NODES,
        (0.1, 0.01, 0.5),
        ("predictive-seasonal", "predictive-flat"),
        (0.2,),
    )
    assert [(r.mode, r.knob, r.default) for r in runs] == [
        ("reactive", None, False),
        *[("headroom", k, False) for k in range(1, 9)],
        ("predictive", 0.01, False),
        ("predictive", 0.1, False),
        ("predictive", 0.5, True),
        # The ablations at their knobs and the default's, none marked default.
        ("predictive-seasonal", 0.2, False),
        ("predictive-seasonal", 0.5, False),
        ("predictive-flat", 0.2, False),
        ("predictive-flat", 0.5, False),
    ]


def test_rows_carry_the_benchmark_fields_and_parallel_runs_match_serial_ones() -> None:
    burst = jobs(*[(float(m), g, 1000, 25) for m in range(0, 60, 7) for g in (1, 4, 8)])
    runs = job_runs(PlannerPolicy(job_wait_share=0.5), (1, 2), (0.1,))
    serial = _run_all(stream(burst, forecast_gpus=16), runs, 1)
    parallel = _run_all(stream(burst, forecast_gpus=16), runs, 2)
    for one, other in zip(serial, parallel, strict=True):
        row = one.row()
        assert set(row) >= ROW_FIELDS, ROW_FIELDS - set(row)
        assert row["seconds"] > 0
        assert {**row, "seconds": 0} == {**other.row(), "seconds": 0}
        assert np.array_equal(one.waits, other.waits)
    assert [r.row()["default"] for r in serial] == [False, False, False, False, True]


def row(mode: str, knob: float | None, hours: float, waited: float, default: bool = False):
    return {
        "mode": mode,
        "knob": knob,
        "default": default,
        "gpu_hours": hours,
        "gpu_minutes_waited": waited,
    }


def test_matched_view_finds_the_cheapest_and_the_least_waiting_baseline() -> None:
    rows = [
        row("reactive", None, 100.0, 1000.0),
        row("headroom", 1, 110.0, 400.0),
        row("headroom", 2, 120.0, 200.0),
        row("predictive", 0.1, 112.0, 150.0),
        row("predictive", 0.5, 108.0, 500.0, default=True),
        row("predictive", 0.001, 300.0, 0.0),
    ]
    tight, loose, strict = matched_view(rows)
    assert tight["knob"] == 0.1
    assert tight["cheapest_no_more_wait"] is None  # no baseline waits as little
    assert tight["least_wait_no_more_cost"] == "headroom 1"
    assert tight["wait_reduction"] == pytest.approx(1 - 150 / 400)
    assert tight["dominated_by"] == []
    assert loose["default"] is True
    assert loose["cheapest_no_more_wait"] == "headroom 1"
    assert loose["gpu_hours_saving"] == pytest.approx(1 - 108 / 110)
    assert loose["least_wait_no_more_cost"] == "reactive"
    assert loose["wait_reduction"] == pytest.approx(0.5)
    assert strict["cheapest_no_more_wait"] is None
    assert strict["least_wait_no_more_cost"] == "headroom 2"
    assert strict["wait_reduction"] == pytest.approx(1.0)
    # Along the baselines' frontier, linear between settings, None beyond them.
    assert tight["envelope_gpu_hours"] is None  # waits less than any baseline
    assert tight["envelope_gpu_minutes_waited"] == pytest.approx(360.0)  # h1 to h2 at 112
    assert tight["envelope_wait_reduction"] == pytest.approx(1 - 150 / 360)
    assert loose["envelope_gpu_hours"] == pytest.approx(100 + 10 * 500 / 600)
    assert loose["envelope_saving"] == pytest.approx(1 - 108 / (100 + 10 * 500 / 600))
    assert loose["envelope_wait_reduction"] == pytest.approx(1 - 500 / 520)
    assert strict["envelope_gpu_hours"] is strict["envelope_gpu_minutes_waited"] is None
    dominated = matched_view([row("headroom", 1, 90.0, 10.0), row("predictive", 0.5, 100.0, 20.0)])
    assert dominated[0]["dominated_by"] == ["headroom 1"]
    assert dominated[0]["gpu_hours_saving"] == pytest.approx(1 - 100 / 90)


SMALL_WORKLOAD = """
start: 2024-01-01T00:00:00
days: 2
warmup_days: 0.5
pools:
  - name: t4
    gpu_model: T4
    gpus_per_node: 4
    cpu_milli_per_node: 48000
    memory_mib_per_node: 196608
    price_per_hour: 3.91
    boot_seconds: 300
    min_size: 0
    max_size: 20
streams:
  - name: serving
    kind: inference
    pools: {t4: 1.0}
    jobs_per_hour: 4
    gpus: {1: 0.7, 4: 0.3}
    duration: {median_minutes: 60, sigma: 1.0, max_minutes: 600}
"""


def test_gpuscale_simulate_synthetic_frontier_json(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from scaler.cli import app

    workload = tmp_path / "small.yaml"
    workload.write_text(SMALL_WORKLOAD)
    args = ["simulate", "--synthetic", "--workload", str(workload), "--days", "3"]
    args += ["--model", "empirical", "--workers", "1", "--out", str(tmp_path / "sim")]
    result = CliRunner().invoke(app, [*args, "--frontier", "--knob", "0.01", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    labels = [(r["mode"], r["knob"], r["default"]) for r in summary["rows"]]
    assert labels == [
        ("reactive", None, False),
        *[("headroom", k, False) for k in range(1, 9)],
        ("predictive", 0.01, False),
        ("predictive", 0.1, True),
        # Each ablation at the knobs asked for and the default's. Three days hold no day
        # of history before the warm-up: no headroom tuned on it, no request model.
        *[(m, k, False) for m in ABLATIONS for k in (0.01, 0.1)],
    ]
    assert summary["request_forecast"] is None
    assert {(a["against"], a["knob"]) for a in summary["ablations"]} == {
        (m, k) for m in ABLATIONS for k in (0.01, 0.1)
    }
    for r in summary["rows"]:
        assert set(r) >= ROW_FIELDS
        assert r["wait_p99_min"] >= r["wait_p95_min"] >= 0
    assert [m["knob"] for m in summary["matched"]] == [0.01, 0.1]
    assert set(summary["matched"][0]) >= {
        "cheapest_no_more_wait",
        "gpu_hours_saving",
        "least_wait_no_more_cost",
        "wait_reduction",
        "dominated_by",
    }
    saved = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert saved["rows"] == summary["rows"]

    shown = CliRunner().invoke(app, [*args, "--knob", "0.01"])  # no --frontier: no 0.01 row
    assert shown.exit_code == 0, shown.output
    assert "matched" in shown.output and "headroom" in shown.output
    assert "0.01 " not in shown.output.split("matched")[0]
    wrong = CliRunner().invoke(
        app, ["simulate", "--trace", "philly:x.csv", "--frontier", *args[-2:]]
    )
    assert wrong.exit_code != 0 and "--frontier" in wrong.output

    own = CliRunner().invoke(app, [*args, "--wait-share", "0.5", "--json"])
    assert own.exit_code == 0, own.output
    rows = json.loads(own.output)["rows"]
    ours = [(r["knob"], r["default"]) for r in rows if r["mode"] == "predictive"]
    assert ours == [(0.5, True)]
    # Without --frontier the ablations run at the default's knob alone.
    assert [(r["mode"], r["knob"]) for r in rows if r["mode"] in ABLATIONS] == [
        (m, 0.5) for m in ABLATIONS
    ]
    # Each mode's knob is its own: the other one's is refused, not ignored.
    mixed = CliRunner().invoke(app, [*args, "--target-shortage", "0.01"])
    assert mixed.exit_code != 0 and "--wait-share" in mixed.output
    replay = CliRunner().invoke(
        app, ["simulate", "--trace", "philly:x.csv", "--wait-share", "0.5", *args[-2:]]
    )
    assert replay.exit_code != 0 and "--wait-share" in replay.output
