"""Job-level simulation: hand-made job lists with known answers, then the synthetic workload."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from predictor.data.synthetic import generate, load_config
from predictor.models import build
from scaler.cluster.pools import NodePool
from scaler.evaluation.job_simulator import JobSimResult, compare_on_workload, simulate_jobs
from scaler.planning.planner import PlannerPolicy

BEGIN = pd.Timestamp("2024-01-01")
REACTIVE = PlannerPolicy(mode="reactive")


def gpu_pool(**fields: object) -> NodePool:
    spec: dict[str, object] = {
        "name": "gpu",
        "gpu_model": "A100",
        "gpus_per_node": 8,
        "cpu_milli_per_node": 64_000,
        "memory_mib_per_node": 512 * 1024,
        "price_per_hour": 10.0,
        "boot_seconds": 600.0,
        "max_size": 10,
    }
    spec.update(fields)
    return NodePool.model_validate(spec)


def jobs(*specs: tuple[float, int, int, int]) -> pd.DataFrame:
    """(submit minute, gpus, gpu_milli, duration minutes) per job, all on pool `gpu`."""
    return pd.DataFrame(
        {
            "job_id": [f"j{i}" for i in range(len(specs))],
            "pool": "gpu",
            "submit": [BEGIN + pd.Timedelta(minutes=s[0]) for s in specs],
            "gpus": [s[1] for s in specs],
            "gpu_milli": [s[2] for s in specs],
            "cpu_milli": 1000,
            "memory_mib": 1024,
            "duration_min": [s[3] for s in specs],
            "priority": 0,
        }
    )


def run(job_list: pd.DataFrame, minutes: int = 120, **pool_fields: object) -> JobSimResult:
    return simulate_jobs(
        job_list,
        [gpu_pool(**pool_fields)],
        "reactive",
        BEGIN,
        BEGIN,
        BEGIN + pd.Timedelta(minutes=minutes),
        REACTIVE,
    )


def test_a_job_with_no_room_waits_exactly_the_boot_time() -> None:
    result = run(jobs((5.0, 8, 1000, 30)))
    assert result.waits.tolist() == [10.0]
    assert result.unstarted == 0


def test_waits_count_from_the_first_scheduling_pass() -> None:
    result = run(jobs((5.5, 8, 1000, 30)))  # arrives mid-minute, first pass at minute 6
    assert result.waits.tolist() == [10.0]


def test_gpu_sharing_jobs_share_one_gpu_and_whole_jobs_pack_first_fit() -> None:
    # One node running: two half-GPU jobs share GPU 0, a 7-GPU job takes the rest.
    result = run(
        jobs((0.0, 1, 1000, 60), (20.0, 1, 500, 30), (20.0, 1, 500, 30), (20.0, 7, 1000, 30)),
        min_size=1,
    )
    # The first job made the node busy; the sharing jobs fit on GPU 1 together, the 7-GPU
    # job needs a second node (6 whole GPUs left) and waits for its boot.
    assert result.waits.tolist() == [0.0, 0.0, 0.0, 10.0]


def test_multi_node_jobs_need_whole_empty_nodes() -> None:
    result = run(jobs((1.0, 16, 1000, 30)), min_size=0)
    assert result.waits.tolist() == [10.0]
    assert result.fleet["nodes"].max() == 2


def test_reactive_removes_idle_nodes_only_after_ten_minutes() -> None:
    result = run(jobs((1.0, 8, 1000, 20)), minutes=60)
    nodes = result.fleet.set_index("ds")["nodes"]
    started, finished = BEGIN + pd.Timedelta(minutes=11), BEGIN + pd.Timedelta(minutes=31)
    assert nodes[started] == 1
    assert nodes[finished + pd.Timedelta(minutes=9)] == 1  # unneeded, not yet for 10 minutes
    assert nodes[finished + pd.Timedelta(minutes=11)] == 0


def test_gpu_hours_count_booting_nodes() -> None:
    result = run(jobs((1.0, 8, 1000, 50)), minutes=61)
    # Requested at 1, ready at 11, busy to 61: one 8-GPU node for the hour after 1.
    assert result.gpu_hours == pytest.approx(8.0)
    assert result.cost == pytest.approx(10.0)


def test_predictive_cuts_waiting_on_the_synthetic_workload() -> None:
    workload = generate(load_config(), seed=1, days=3)
    pools = [NodePool(**{**dataclasses.asdict(p), "boot_seconds": 600}) for p in workload.pools]
    start = workload.start + pd.Timedelta(days=2, hours=6)
    end = start + pd.Timedelta(hours=12)
    comparison = compare_on_workload(
        workload.jobs,
        workload.demand,
        pools,
        build("empirical"),
        start=start,
        end=end,
        warmup=pd.Timedelta(hours=6),
        policy=PlannerPolicy(mode="predictive", target_shortage=0.2),
    )
    reactive, predictive = comparison.rows()
    assert reactive["jobs"] == predictive["jobs"] > 100
    assert predictive["share_waiting"] < reactive["share_waiting"]
    assert predictive["wait_mean_min"] < reactive["wait_mean_min"]
    assert reactive["gpu_hours"] > 0 and predictive["gpu_hours"] > 0
    assert np.all(comparison.predictive.waits >= 0)
    assert set(comparison.predictive.fleet["pool"]) == {p.name for p in pools}


def test_gpuscale_simulate_synthetic_compares_the_modes(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from scaler.cli import app

    args = [
        "simulate",
        "--synthetic",
        "--days",
        "3",
        "--model",
        "empirical",
        "--out",
        str(tmp_path / "sim"),  # made by the command
    ]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert [row["mode"] for row in summary["rows"]] == ["reactive", "predictive"]
    assert (tmp_path / "sim" / "jobs.png").stat().st_size > 1000
    assert json.loads((tmp_path / "sim" / "summary.json").read_text())["rows"] == summary["rows"]


def test_gpuscale_simulate_on_bad_input_leaves_no_out_folder(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from predictor.foundation.errors import InputError
    from scaler.cli import app

    out = tmp_path / "sim"
    for bad in (
        ["--trace", f"philly:{tmp_path / 'absent.csv'}"],
        ["--synthetic", "--workload", str(tmp_path / "absent.yaml")],
        ["--synthetic", "--model", "no-such-model"],
    ):
        result = CliRunner().invoke(app, ["simulate", *bad, "--out", str(out)])
        assert isinstance(result.exception, InputError), result.output
        assert not out.exists()
