"""Job-level simulation on the placement engine: hand-made job lists with known answers
(waits, gangs, queue order, placeholders), then the synthetic workload."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import scaler.evaluation.job_simulator as job_simulator
from predictor.models import build
from scaler.cluster.pools import NodePool
from scaler.evaluation.job_frontier import ABLATIONS, compare_on_workload
from scaler.evaluation.job_simulator import JobSimResult, simulate_jobs, simulator_snapshot
from scaler.evaluation.synthetic import generate, load_config
from scaler.placement.estimator import estimate_scale_up
from scaler.planning.planner import PlannerPolicy
from scaler.planning.reactive import busy_nodes

BEGIN = pd.Timestamp("2024-01-01")
REACTIVE = PlannerPolicy(mode="reactive")
LEVELS = (0.5, 0.9, 0.99)


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


def jobs(*specs: tuple[float, int, int, int], priority: tuple[int, ...] = ()) -> pd.DataFrame:
    """(submit minute, gpus, gpu_milli, duration minutes) per job, all on pool `gpu`;
    job i is named j{i}."""
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
            "priority": list(priority) or 0,
        }
    )


def run(
    job_list: pd.DataFrame, minutes: int = 120, queue: str = "fifo", **pool_fields: object
) -> JobSimResult:
    return simulate_jobs(
        job_list,
        [gpu_pool(**pool_fields)],
        "reactive",
        BEGIN,
        BEGIN,
        BEGIN + pd.Timedelta(minutes=minutes),
        REACTIVE,
        queue=queue,  # type: ignore[arg-type]
    )


def waits_by_job(result: JobSimResult) -> dict[str, float]:
    return dict(zip(result.job_ids, result.waits.tolist(), strict=True))


def flat_outlook(gpus: float, minutes: int) -> dict[str, np.ndarray]:
    """A forecast of `gpus` GPUs at every level, every step, over the boot-time lead."""
    return {"gpu": np.full((minutes // 10 + 1, 2, len(LEVELS)), float(gpus))}


def run_mode(
    job_list: pd.DataFrame,
    mode: str,
    spare: int,
    minutes: int,
    policy: PlannerPolicy | None = None,
) -> JobSimResult:
    """One run on an empty GPU pool with no forecast; headroom holds `spare` nodes."""
    return simulate_jobs(
        job_list,
        [gpu_pool(min_size=0)],
        mode,
        BEGIN,
        BEGIN,
        BEGIN + pd.Timedelta(minutes=minutes),
        policy or PlannerPolicy(mode="predictive"),
        flat_outlook(0.0, minutes),
        LEVELS,
        spare=spare,
    )


def run_modes(job_list: pd.DataFrame, spare: int, minutes: int = 90) -> dict:
    """reactive, and headroom with `spare` nodes held by placeholders."""
    return {
        mode: run_mode(job_list, mode, spare if mode == "headroom" else 0, minutes)
        for mode in ("reactive", "headroom")
    }


def test_a_job_with_no_room_waits_exactly_the_boot_time() -> None:
    result = run(jobs((5.0, 8, 1000, 30)))
    assert result.waits.tolist() == [10.0]
    assert result.unstarted == 0


def test_waits_count_from_the_first_scheduling_pass() -> None:
    result = run(jobs((5.5, 8, 1000, 30)))  # arrives mid-minute, first pass at minute 6
    assert result.waits.tolist() == [10.0]


def test_gpu_sharing_jobs_share_one_gpu_and_a_job_too_big_for_the_rest_waits() -> None:
    # One node running: the engine puts the two half-GPU jobs on one GPU, so 6 whole GPUs
    # are left and the 7-GPU job waits for a second node's boot.
    result = run(
        jobs((0.0, 1, 1000, 60), (20.0, 1, 500, 30), (20.0, 1, 500, 30), (20.0, 7, 1000, 30)),
        min_size=1,
    )
    assert waits_by_job(result) == {"j0": 0.0, "j1": 0.0, "j2": 0.0, "j3": 10.0}
    assert result.placement == "gpuscale" and result.queue == "fifo"


def test_the_engine_places_both_shares_on_one_gpu_of_the_simulators_cluster() -> None:
    pool = gpu_pool()
    snap = simulator_snapshot(
        [pool], {"gpu": 1}, jobs((0.0, 1, 500, 30), (0.0, 1, 500, 30)), jobs()
    )
    gpus = {a.job.id: a.gpus for a in snap.state.jobs.values()}
    assert gpus["j0"] == gpus["j1"]
    assert snap.state.gpu_free[snap.state.jobs["j0"].node].tolist().count(1000) == 7


def test_reactive_scales_up_for_a_pending_gpu_sharing_job() -> None:
    result = run(jobs((1.0, 1, 250, 30)), minutes=60, min_size=0)
    nodes = result.fleet.set_index("ds")["nodes"]
    assert nodes[BEGIN] == 0
    assert nodes[BEGIN + pd.Timedelta(minutes=1)] == 1  # asked for in the minute it waits
    assert result.waits.tolist() == [10.0]
    row = result.row()
    assert row["gpu_minutes_waited"] == pytest.approx(0.25 * 10)
    assert row["wait_p99_min"] == 10.0


def test_multi_node_jobs_need_whole_empty_nodes() -> None:
    result = run(jobs((1.0, 16, 1000, 30)), min_size=0)
    assert result.waits.tolist() == [10.0]
    assert result.fleet["nodes"].max() == 2
    assert result.row()["gpu_minutes_waited"] == 160.0


def test_a_gang_starts_all_at_once_or_waits_and_smaller_jobs_backfill() -> None:
    # Two nodes, no more: j0 holds one until 30; the 16-GPU gang j1 (two whole nodes)
    # cannot start on the one free node, so j2 takes it at once; the gang starts when
    # both are free (j2 ends at 46), never half of it earlier.
    result = run(
        jobs((0.0, 8, 1000, 30), (5.0, 16, 1000, 10), (6.0, 8, 1000, 40)),
        minutes=80,
        min_size=2,
        max_size=2,
    )
    assert waits_by_job(result) == {"j0": 0.0, "j1": 41.0, "j2": 0.0}
    demand = result.fleet.set_index("ds")["demand_gpus"]
    assert demand[BEGIN + pd.Timedelta(minutes=10)] == 32  # 16 running, the gang's 16 waiting
    assert demand[BEGIN + pd.Timedelta(minutes=50)] == 16  # the gang alone, all of it running


@pytest.mark.parametrize(
    ("queue", "priority", "first"),
    [("fifo", (2, 0, 0), "j1"), ("qssf", (2, 0, 0), "j2"), ("priority", (2, 0, 1), "j2")],
)
def test_queue_order_decides_who_starts_first_under_contention(
    queue: str, priority: tuple[int, ...], first: str
) -> None:
    # One node, busy until 20 with j0 (top priority: nothing preempts it); a long job (j1,
    # 100 min) arrives before a short one (j2, 5 min). fifo serves j1 first; qssf takes the
    # smaller predicted GPU time; priority the higher priority (j2's, in that case).
    result = run(
        jobs((0.0, 8, 1000, 20), (1.0, 8, 1000, 100), (2.0, 8, 1000, 5), priority=priority),
        minutes=200,
        queue=queue,
        min_size=1,
        max_size=1,
    )
    if first == "j1":
        assert waits_by_job(result) == {"j0": 0.0, "j1": 19.0, "j2": 118.0}
    else:
        assert waits_by_job(result) == {"j0": 0.0, "j1": 24.0, "j2": 18.0}


def test_a_higher_priority_job_preempts_a_running_one_which_runs_again_in_full() -> None:
    result = run(
        jobs((0.0, 8, 1000, 20), (2.0, 8, 1000, 5), priority=(0, 1)),
        minutes=60,
        min_size=1,
        max_size=1,
    )
    assert waits_by_job(result) == {"j0": 0.0, "j1": 0.0}  # j0's wait: to its first start
    demand = result.fleet.set_index("ds")["demand_gpus"]
    assert demand[BEGIN + pd.Timedelta(minutes=3)] == 16  # j1 runs, j0 waits again
    assert demand[BEGIN + pd.Timedelta(minutes=26)] == 8  # j0 again from 7, 20 minutes
    assert demand[BEGIN + pd.Timedelta(minutes=27)] == 0


def test_jobs_on_a_reclaimed_spot_node_wait_again_and_all_finish() -> None:
    from scaler.providers.simulated import SimulatedCloudConfig

    def demand(reclaims_per_hour: float) -> tuple[JobSimResult, pd.Series]:
        result = simulate_jobs(
            jobs(*[(float(m), 8, 1000, 40) for m in range(0, 60, 5)]),
            [gpu_pool(capacity_type="spot", min_size=0)],
            "reactive",
            BEGIN,
            BEGIN,
            BEGIN + pd.Timedelta(hours=12),
            REACTIVE,
            cloud=SimulatedCloudConfig(seed=3, spot_interruptions_per_hour=reclaims_per_hour),
        )
        return result, result.fleet["demand_gpus"]

    calm, calm_demand = demand(0.0)
    reclaimed, reclaimed_demand = demand(1.0)
    for result, series in ((calm, calm_demand), (reclaimed, reclaimed_demand)):
        assert result.unstarted == 0 and result.waits.size == 12
        assert series.min() >= 0 and series.iloc[-1] == 0
    # A reclaimed job waits again and runs again in full: more GPU-minutes of demand.
    assert reclaimed_demand.sum() > calm_demand.sum() + 8 * 10


def test_a_placeholder_is_preempted_by_a_real_job() -> None:
    # Two spare nodes from the start, held with placeholders: the job at 40 evicts one and
    # starts at once (and a spare node is asked for again), where the reactive baseline
    # only asks for a node when the job arrives.
    results = run_modes(jobs((40.0, 8, 1000, 30)), spare=2)
    spare, reactive = results["headroom"], results["reactive"]
    assert spare.waits.tolist() == [0.0]
    assert spare.placeholders_preempted == 1
    assert reactive.waits.tolist() == [10.0]
    assert reactive.placeholders_preempted == 0
    assert spare.fleet["nodes"].max() == 3


def test_a_gang_preempts_the_placeholders_of_the_nodes_it_takes() -> None:
    results = run_modes(jobs((40.0, 16, 1000, 30)), spare=2)
    assert results["headroom"].waits.tolist() == [0.0]
    assert results["headroom"].placeholders_preempted == 2
    assert results["reactive"].waits.tolist() == [10.0]


def test_the_reactive_estimate_needs_no_ready_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator estimates without the ready nodes (admission just tried them all);
    at every call that must equal `reactive_demand` on its full cluster."""
    clusters: list[job_simulator._SimCluster] = []
    original_cluster, original_demand = job_simulator._SimCluster, job_simulator.reactive_demand

    class Recorded(original_cluster):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object) -> None:
            super().__init__(*args)
            clusters.append(self)

    checked = []

    def both(state, pending, pools, policy, **sizes):  # type: ignore[no-untyped-def]
        assert state is None
        light = original_demand(None, pending, pools, policy, **sizes)
        full = original_demand(clusters[-1].state, pending, pools, policy, **sizes)
        busy = busy_nodes(clusters[-1].state)
        for pool in pools:
            assert full.nodes[pool.name] == busy.get(pool.name, 0) + light.nodes[pool.name]
        assert not full.estimate.on_existing
        checked.append(len(pending))
        return light

    monkeypatch.setattr(job_simulator, "_SimCluster", Recorded)
    monkeypatch.setattr(job_simulator, "reactive_demand", both)
    burst = [
        (float(m), g, milli, d)
        for m in range(0, 40, 3)
        for g, milli, d in [(1, 250, 25), (2, 1000, 15), (16, 1000, 12), (1, 1000, 40)]
    ]
    run(jobs(*burst), minutes=90, min_size=1)
    run_modes(jobs(*burst), spare=3)
    assert len(checked) > 10 and max(checked) > 3


def test_simulator_snapshot_is_the_cluster_and_queue_the_estimate_sees() -> None:
    pool = gpu_pool(max_size=6)
    running = jobs((0.0, 8, 1000, 60), (0.0, 4, 1000, 60))
    pending = jobs((5.0, 4, 1000, 30), (6.0, 16, 1000, 30), (7.0, 1, 500, 30))
    pending["job_id"] = ["p0", "p1", "p2"]
    snap = simulator_snapshot([pool], {"gpu": 3}, running, pending)
    assert (~snap.state.cordoned).sum() == 3  # the ready nodes; the other slots cordoned
    assert sorted(snap.state.jobs) == ["j0", "j1"]
    assert [j.id for j in snap.pending] == ["p0", "p1/0", "p1/1", "p2"]
    assert {j.gang for j in snap.pending} == {None, "p1"}
    assert all(j.gpu_models == frozenset({"A100"}) for j in snap.pending)
    estimate = estimate_scale_up(
        snap.state, snap.pending, [pool], snap.policy, booting={}, current={"gpu": 3}
    )
    # The gang needs two whole nodes and one ready node is empty: all or nothing, it goes
    # to two new ones; the 4-GPU and the sharing job fit the ready nodes.
    assert estimate.on_existing == ("p0", "p2")
    assert estimate.new_nodes("gpu") == 2
    assert estimate.pools["gpu"].jobs == ("p1/0", "p1/1")


def test_reactive_removes_idle_nodes_only_after_ten_minutes() -> None:
    result = run(jobs((1.0, 8, 1000, 20)), minutes=60)
    nodes = result.fleet.set_index("ds")["nodes"]
    started, finished = BEGIN + pd.Timedelta(minutes=11), BEGIN + pd.Timedelta(minutes=31)
    assert nodes[started] == 1
    assert nodes[finished + pd.Timedelta(minutes=9)] == 1  # unneeded, not yet for 10 minutes
    assert nodes[finished + pd.Timedelta(minutes=11)] == 0


def test_predictive_removes_a_node_its_plan_does_not_want_at_the_next_pass() -> None:
    # gpuscale sizes the groups itself: a freed node beyond the spare it chose goes at once,
    # where Cluster Autoscaler (above) keeps it for its 10 unneeded minutes. At a knob of 1
    # (a reactive autoscaler's waiting) the spare is none.
    policy = PlannerPolicy(mode="predictive", job_wait_share=1.0)
    result = run_mode(jobs((1.0, 8, 1000, 20)), "predictive", 0, 60, policy)
    nodes = result.fleet.set_index("ds")["nodes"]
    started, finished = BEGIN + pd.Timedelta(minutes=11), BEGIN + pd.Timedelta(minutes=31)
    assert nodes[started] == 1
    assert nodes[finished - pd.Timedelta(minutes=1)] == 1
    assert nodes[finished + pd.Timedelta(minutes=1)] == 0


def test_gpu_hours_count_booting_nodes() -> None:
    result = run(jobs((1.0, 8, 1000, 50)), minutes=61)
    # Requested at 1, ready at 11, busy to 61: one 8-GPU node for the hour after 1.
    assert result.gpu_hours == pytest.approx(8.0)
    assert result.cost == pytest.approx(10.0)


def test_predictive_cuts_waiting_on_the_synthetic_workload() -> None:
    workload = generate(load_config(), seed=1, days=3)
    pools = [p.model_copy(update={"boot_seconds": 600}) for p in workload.pools]
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
        # The spare is sized on the node requests of the warm-up (6 hours, not a day).
        policy=PlannerPolicy(mode="predictive", tuning_min_steps=36),
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
    modes = ["reactive", *["headroom"] * 8, "predictive", *ABLATIONS]
    assert [row["mode"] for row in summary["rows"]] == modes
    assert summary["placement"] == {"policy": "gpuscale", "queue": "fifo"}
    assert "placement gpuscale, queue fifo" in summary["title"]
    for row in summary["rows"]:
        assert row["wait_p99_min"] >= row["wait_p95_min"] >= row["wait_p50_min"]
        assert row["gpu_minutes_waited"] >= 0
    assert (tmp_path / "sim" / "jobs.png").stat().st_size > 1000
    assert json.loads((tmp_path / "sim" / "summary.json").read_text())["rows"] == summary["rows"]

    shown = CliRunner().invoke(app, [*args, "--queue", "qssf"])
    assert shown.exit_code == 0, shown.output
    assert "placement: the engine's gpuscale policy, queue qssf" in shown.output
    assert "p99 wait" in shown.output
    wrong = CliRunner().invoke(app, [*args, "--queue", "lifo"])
    assert wrong.exit_code != 0 and "--queue" in wrong.output


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
