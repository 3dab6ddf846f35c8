"""The ceiling's MIP on hand-made clusters whose optimum is known, and its validity
against the policies on a slice of the real openb files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from scaler.cluster.job import Job
from scaler.cluster.snapshot import ClusterState, NodeSpec
from scaler.evaluation.placement_bench import Experiment, run_experiment
from scaler.evaluation.placement_bound import (
    BoundResult,
    arrived_sets,
    ceiling,
    maximal_patterns,
    run_bound,
    run_bounds,
)


def cluster(*nodes: tuple[int, int, int, str]) -> ClusterState:
    return ClusterState.from_nodes(
        [
            NodeSpec(f"n{i}", cpu, mem, gpus, model)
            for i, (cpu, mem, gpus, model) in enumerate(nodes)
        ]
    )


def pods(count: int, cpu: int, gpus: int, milli: int, models: str = "", mem: int = 1) -> list[Job]:
    allowed = frozenset(m for m in models.split("|") if m)
    return [
        Job(f"p{cpu}-{gpus}-{milli}-{models}-{i}", cpu, mem, gpus, milli, allowed)
        for i in range(count)
    ]


def test_shares_are_packed_per_gpu_not_summed() -> None:
    # Three 600s on two GPUs: 1800 <= 2000 in sum, but only one 600 fits a GPU.
    result = ceiling(cluster((8000, 64, 2, "T4")), pods(3, 1000, 1, 600))
    assert result.bound == pytest.approx(60.0)
    assert result.best == pytest.approx(60.0) and result.gap == pytest.approx(0.0)
    assert result.exact_gpu_packing


def test_small_shares_fill_what_big_ones_leave() -> None:
    # 700 + 300 fills one GPU; the other 700 leaves 300 a second 300 fills.
    jobs = pods(2, 100, 1, 700) + pods(3, 100, 1, 300)
    assert ceiling(cluster((8000, 64, 2, "T4")), jobs).bound == pytest.approx(100.0)


def test_cpu_of_one_node_limits_its_gpus() -> None:
    # One GPU, 4 cores: two 500-share pods of 3 cores each cannot both run; a whole-GPU
    # pod of 6 cores fits no node at all.
    jobs = pods(2, 3000, 1, 500) + pods(1, 6000, 1, 1000)
    assert ceiling(cluster((4000, 64, 1, "T4")), jobs).bound == pytest.approx(50.0)


def test_per_node_cuts_keep_big_pods_one_to_a_node() -> None:
    # Three nodes of 4 cores and 2 GPUs; four 3-core whole-GPU pods: 12 cores in sum,
    # but one per node.
    nodes = cluster(*[(4000, 64, 2, "T4")] * 3)
    assert ceiling(nodes, pods(4, 3000, 1, 1000)).bound == pytest.approx(50.0)


def test_gpu_models_and_multi_gpu_pods() -> None:
    # An A100 node and a T4 node of 4 GPUs each: two A100-only whole-GPU pods, no 8-GPU
    # node for the 8-GPU pod, and 2-GPU pods for any model fill the rest.
    nodes = cluster((64000, 512, 4, "A100"), (64000, 512, 4, "T4"))
    jobs = pods(5, 1000, 1, 1000, "A100") + pods(1, 1000, 8, 1000) + pods(3, 1000, 2, 1000)
    # 4 A100 pods (only 4 A100 GPUs) + 2 two-GPU pods on the T4 node = 8 of 8.
    assert ceiling(nodes, jobs).bound == pytest.approx(100.0)
    only_a100 = pods(5, 1000, 1, 1000, "A100") + pods(1, 1000, 8, 1000)
    assert ceiling(nodes, only_a100).bound == pytest.approx(50.0)


def test_memory_counts_and_cpu_only_pods_play_no_part() -> None:
    nodes = cluster((64000, 100, 2, "T4"))
    jobs = pods(2, 1000, 1, 1000, mem=60) + pods(10, 60000, 0, 0, mem=100)
    assert ceiling(nodes, jobs).bound == pytest.approx(50.0)


def test_maximal_patterns() -> None:
    patterns = maximal_patterns([300, 700])
    assert sorted(patterns) == [(1, 1), (3, 0)]  # 300+700 (left 0); 300x3 (left 100)
    assert maximal_patterns([10, 20, 30], limit=5) is None


def test_arrived_sets_stop_where_the_bench_records() -> None:
    order = pods(3, 0, 1, 600)
    first, everything = arrived_sets(order, 1000)
    assert first == order[:2] and everything == order
    assert arrived_sets(order[:1], 1000)[0] is None


@pytest.fixture(scope="module")
def openb_slice(traces_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every 20th node of the real cluster and the first 350 pods of the default trace."""
    from predictor.data.loaders import load_openb_nodes, load_openb_pods

    base = traces_dir / "alibaba-openb"
    nodes = load_openb_nodes(base / "openb_node_list_gpu_node.csv").iloc[::20]
    return nodes.reset_index(drop=True), load_openb_pods(base / "openb_pod_list_default.csv").head(
        350
    )


@pytest.fixture(scope="module")
def slice_bound(openb_slice) -> BoundResult:
    """A short time limit: a bound not proven optimal in time is still a bound."""
    nodes, table = openb_slice
    return run_bound(nodes, table, "slice", 42, time_limit_s=3)


@pytest.mark.parametrize("policy", ["fgd", "gpuscale", "bestfit"])
def test_the_bound_is_above_every_policy_on_a_slice(
    openb_slice, slice_bound: BoundResult, policy: str
) -> None:
    nodes, table = openb_slice
    bound = slice_bound
    placed = run_experiment(nodes, table, Experiment("slice", policy, 42))
    assert bound.at_100 is not None
    assert placed.alloc_at_100 <= bound.alloc_at_100 + 1e-9
    assert placed.alloc_at_130 <= bound.alloc_at_130 + 1e-9
    assert placed.alloc_at_100 <= bound.protocol_at_100 + 1e-9
    assert placed.alloc_at_130 <= bound.protocol_at_130 + 1e-9
    row = bound.row()
    assert row["policy"] == "bound" and row["bound_gap"] >= 0
    assert row["best_at_130"] <= row["alloc_at_130"] <= 100.0


def test_run_bounds_keeps_workload_seed_order(openb_slice) -> None:
    nodes, table = openb_slice
    results = run_bounds(nodes, {"a": table.head(150)}, [43, 42], time_limit_s=1)
    assert [(r.workload, r.seed) for r in results] == [("a", 43), ("a", 42)]


def test_cli_adds_the_bound_rows(traces_dir: Path, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from scaler.cli import app

    base = traces_dir / "alibaba-openb"
    nodes = pd.read_csv(base / "openb_node_list_gpu_node.csv").iloc[::40]
    table = pd.read_csv(base / "openb_pod_list_default.csv", keep_default_na=False).head(150)
    nodes.to_csv(tmp_path / "nodes.csv", index=False)
    table.to_csv(tmp_path / "openb_pod_list_slice.csv", index=False)
    out = tmp_path / "rows.json"
    args = ["bench", "placement", "--nodes", str(tmp_path / "nodes.csv")]
    args += ["--pods", str(tmp_path / "openb_pod_list_slice.csv"), "--seeds", "42"]
    args += ["--policies", "fgd,gpuscale", "--bound", "--bound-seconds", "2", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    bound = [r for r in rows if r["policy"] == "bound"]
    assert len(bound) == 1 and {"bound_gap", "seconds", "best_at_130"} <= set(bound[0])
    ours = next(r for r in rows if r["policy"] == "gpuscale")
    assert ours["alloc_at_130"] <= bound[0]["alloc_at_130"]
    assert "of the distance from ours FGD to the offline ceiling at 130%" in result.output
    assert "of the distance from ours FGD to the protocol ceiling at 130%" in result.output
    assert bound[0]["protocol_at_130"] <= bound[0]["alloc_at_130"]
    assert bound[0]["forced_at_130"] > 0 and bound[0]["protocol_gap_at_130"] >= 0
    assert ours["alloc_at_130"] <= bound[0]["protocol_at_130"]


def test_the_lp_rounded_start_is_feasible() -> None:
    from scaler.evaluation.placement_bound import _Model, node_types, pod_types

    state = cluster((8000, 64, 2, "T4"), (4000, 64, 4, "A100"))
    jobs = pods(3, 1000, 1, 600) + pods(4, 700, 1, 300) + pods(2, 1500, 2, 1000, "A100")
    model = _Model(node_types(state), pod_types(jobs))
    # Any LP point (here: every column at its upper bound) rounds to a feasible one.
    start = model.rounded(np.array(model.upper))
    assert start is not None
    for cols, vals, rhs in model.rows:
        assert np.dot(vals, start[cols]) <= rhs + 1e-6
    assert (start[model.integer] == np.round(start[model.integer])).all()


def test_a_solve_writes_nothing_to_stdout() -> None:
    # HiGHS prints its banner once per process, so only a fresh one shows it.
    script = (
        "from scaler.cluster.job import Job\n"
        "from scaler.cluster.snapshot import ClusterState, NodeSpec\n"
        "from scaler.evaluation.placement_bound import ceiling\n"
        "state = ClusterState.from_nodes([NodeSpec('n0', 8000, 64, 2, 'T4')])\n"
        "jobs = [Job(f'p{i}', 1000, 1, 1, 600, frozenset()) for i in range(3)]\n"
        "assert abs(ceiling(state, jobs).bound - 60.0) < 1e-6\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout == ""
