"""The workload-inflation benchmark on small slices of the real openb files (not timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from predictor.data.loaders import load_openb_nodes, load_openb_pods
from scaler.cli import app
from scaler.cli.placing import parse_seeds
from scaler.evaluation.placement_bench import (
    Experiment,
    arrival_order,
    jobs_from_pods,
    load_anchors,
    run_experiment,
    scaled_nodes,
    workload_name,
)
from scaler.placement import ClusterState

OPENB = "alibaba-openb"


@pytest.fixture(scope="module")
def slices(traces_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Every 20th node of the real cluster (314 GPUs) and the first 350 pods of the default
    trace (about 250 GPUs asked)."""
    out = tmp_path_factory.mktemp("openb")
    nodes = pd.read_csv(traces_dir / OPENB / "openb_node_list_gpu_node.csv")
    pods = pd.read_csv(traces_dir / OPENB / "openb_pod_list_default.csv", keep_default_na=False)
    nodes.iloc[::20].to_csv(out / "nodes.csv", index=False)
    pods.head(350).to_csv(out / "openb_pod_list_slice.csv", index=False)
    return out / "nodes.csv", out / "openb_pod_list_slice.csv"


@pytest.fixture(scope="module")
def tables(slices: tuple[Path, Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    return load_openb_nodes(slices[0]), load_openb_pods(slices[1])


def test_arrival_order_shuffles_then_inflates_to_just_under_130(tables) -> None:
    nodes, pods = tables
    capacity = ClusterState.from_frame(nodes).total_gpu_milli
    jobs = jobs_from_pods(pods)
    order = arrival_order(jobs, capacity, seed=42, ratio=1.3)
    assert sorted(j.id for j in order[: len(jobs)]) == sorted(j.id for j in jobs)
    assert [j.id for j in order[: len(jobs)]] != [j.id for j in jobs]
    requested = sum(j.gpu_request_milli for j in order)
    biggest = max(j.gpu_request_milli for j in jobs)
    assert 1.3 * capacity - biggest < requested <= 1.3 * capacity
    assert len({j.id for j in order}) == len(order)
    assert [j.id for j in arrival_order(jobs, capacity, 42, 1.3)] == [j.id for j in order]
    assert [j.id for j in arrival_order(jobs, capacity, 43, 1.3)] != [j.id for j in order]


def test_a_trace_bigger_than_130_percent_is_thinned(tables) -> None:
    nodes, pods = tables
    capacity = ClusterState.from_frame(nodes).total_gpu_milli
    jobs = jobs_from_pods(pods) * 3
    order = arrival_order(jobs, capacity, seed=42, ratio=1.3)
    assert len(order) < len(jobs)
    assert sum(j.gpu_request_milli for j in order) <= 1.3 * capacity


@pytest.mark.parametrize("policy", ["random", "bestfit", "fgd", "gpuscale"])
def test_experiment_on_a_slice(tables, policy: str) -> None:
    nodes, pods = tables
    result = run_experiment(nodes, pods, Experiment("slice", policy, 42))
    assert 50 < result.alloc_at_100 <= result.alloc_at_130 <= 100
    assert result.failed_pods > 0 and result.pods == 350
    curve = np.array(result.curve)
    assert np.all(np.diff(curve) >= -1e-9)
    # Allocated never exceeds arrived; a point is taken once arrivals reach it, and one pod
    # (up to 8 of the slice's 314 GPUs) may overshoot it.
    assert np.all(curve <= np.arange(curve.size) + 100 * 8 / 314)
    again = run_experiment(nodes, pods, Experiment("slice", policy, 42))
    assert (again.alloc_at_100, again.alloc_at_130, again.failed_pods) == (
        result.alloc_at_100,
        result.alloc_at_130,
        result.failed_pods,
    )
    row = result.row()
    assert list(row)[:7] == [
        "workload", "policy", "seed", "alloc_at_100", "alloc_at_130", "failed_pods", "seconds",
    ]  # fmt: skip


def test_fragmentation_aware_policies_beat_random_on_the_slice(tables) -> None:
    nodes, pods = tables
    got = {
        p: np.mean(
            [run_experiment(nodes, pods, Experiment("s", p, s)).alloc_at_130 for s in (42, 43)]
        )
        for p in ("random", "fgd", "gpuscale")
    }
    assert got["fgd"] > got["random"] + 2 and got["gpuscale"] > got["random"] + 2


def test_pods_the_cluster_can_never_run_fail_with_their_reason(tables) -> None:
    nodes, pods = tables
    small = nodes[nodes["gpu"] <= 4].reset_index(drop=True)
    extra = pods.head(3).copy()
    extra["name"] = ["needs-8-gpus", "needs-h100", "needs-9-gpus"]
    extra["num_gpu"] = [8, 1, 9]
    extra["gpu_milli"] = [1000, 500, 1000]
    extra["gpu_spec"] = ["", "H100", ""]
    with_bad = pd.concat([extra, pods.head(20)], ignore_index=True)
    result = run_experiment(small, with_bad, Experiment("bad", "gpuscale", 42))
    assert result.failures["asks 8 GPUs but the largest allowed node has 4"] >= 1
    assert result.failures["no node has GPU model H100"] >= 1
    assert result.failures["asks 9 GPUs but the largest allowed node has 4"] >= 1
    assert result.failed_pods == sum(result.failures.values())


def test_cli_writes_rows_and_curves(slices: tuple[Path, Path], tmp_path: Path) -> None:
    nodes, pods = slices
    out, png = tmp_path / "placement.json", tmp_path / "curves.png"
    args = ["bench", "placement", "--nodes", str(nodes), "--pods", str(pods), "--seeds", "42-43"]
    args += ["--policies", "bestfit,gpuscale", "--json", str(out), "--plot", str(png)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["suite"] == "placement" and len(data["rows"]) == 4
    for row in data["rows"]:
        assert row["workload"] == "slice" and row["policy"] in ("bestfit", "gpuscale")
        assert row["seed"] in (42, 43) and row["seconds"] > 0
        assert 0 < row["alloc_at_100"] <= row["alloc_at_130"] <= 100
    assert png.stat().st_size > 10_000
    assert "gpuscale" in result.output and "median seconds per experiment" in result.output


def test_cli_rejects_bad_arguments(slices: tuple[Path, Path]) -> None:
    nodes, pods = slices
    base = ["bench", "placement", "--nodes", str(nodes), "--pods", str(pods)]
    assert CliRunner().invoke(app, [*base, "--policies", "bestfit,nope"]).exit_code == 2
    assert CliRunner().invoke(app, [*base, "--seeds", "51-42"]).exit_code == 2


def test_cli_reports_a_malformed_row_by_line(slices: tuple[Path, Path], tmp_path: Path) -> None:
    nodes, pods = slices
    broken = tmp_path / "openb_pod_list_broken.csv"
    lines = pods.read_text().splitlines()
    lines[5] = (
        lines[5].replace(",1,", ",one,", 1) if ",1," in lines[5] else lines[5] + ",extra,cells"
    )
    broken.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaler",
            "bench",
            "placement",
            "--nodes",
            str(nodes),
            "--pods",
            str(broken),
            "--seeds",
            "42",
            "--policies",
            "bestfit",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "openb_pod_list_broken.csv:6" in done.stderr and done.stderr.count("\n") == 1


def test_parse_seeds_and_names() -> None:
    assert parse_seeds("42-45") == [42, 43, 44, 45]
    assert parse_seeds("42,50, 44-45") == [42, 50, 44, 45]
    assert workload_name("/x/openb_pod_list_gpushare40.csv") == "gpushare40"
    assert workload_name("my_pods.csv.gz") == "my_pods"


def test_published_anchors(traces_dir: Path) -> None:
    anchors = load_anchors(traces_dir.parent / "anchors" / "fgd_openb_allocation.csv")
    assert anchors[("default", "fgd")] == (95.227, 95.391)
    assert anchors[("gpushare60", "bestfit")][1] == pytest.approx(89.359)
    assert {p for _, p in anchors} == {
        "random",
        "dotprod",
        "gpuclustering",
        "gpupacking",
        "bestfit",
        "fgd",
    }


def test_scale_to_repeats_the_node_list_and_times_decisions(
    slices: tuple[Path, Path], tmp_path: Path
) -> None:
    nodes, pods = slices
    table = load_openb_nodes(nodes)
    big = scaled_nodes(table, 2 * len(table) + 5)
    assert len(big) == 2 * len(table) + 5 and big["sn"].is_unique
    assert (big["gpu"].to_numpy()[: len(table)] == table["gpu"].to_numpy()).all()
    out = tmp_path / "scale.json"
    args = ["bench", "placement", "--nodes", str(nodes), "--pods", str(pods), "--seeds", "42"]
    args += ["--policies", "gpuscale", "--scale-to", str(len(big)), "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(out.read_text())["rows"]
    assert row["nodes"] == len(big)
    assert 0 < row["decision_ms_p50"] <= row["decision_ms_p99"]
    assert f"one placement decision on {len(big)} nodes: median" in result.output


NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,96000,786432,8,V100M32\n"
PODS = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,1000\n"


@pytest.mark.parametrize(
    ("nodes", "anchors", "where"),
    [
        (NODES + "n1,96000,786432,1000000,V100M32\n", None, "nodes.csv:3, column 'gpu'"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn0,96000,786432,0,\n", None, "the nodes hold no"),
        (NODES, "absent.csv", "absent.csv: file not found"),
        (NODES, "policy,alloc_at_100,alloc_at_130\nFGD,90,92\n", "column 'workload'"),
        (NODES, "workload,policy,alloc_at_100,alloc_at_130\ndefault,FGD,x,92\n", "anchors.csv:2"),
    ],
)
def test_a_node_list_or_anchors_file_the_bench_cannot_use_is_refused_by_name(
    tmp_path: Path, nodes: str, anchors: str | None, where: str
) -> None:
    """Were a NodeSpec ValueError (a million GPUs), a ZeroDivisionError (no GPUs), and a
    FileNotFoundError or KeyError (anchors)."""
    from predictor.foundation.errors import InputError

    (tmp_path / "nodes.csv").write_text(nodes)
    (tmp_path / "openb_pod_list_x.csv").write_text(PODS)
    args = ["bench", "placement", "--nodes", str(tmp_path / "nodes.csv"), "--seeds", "42"]
    args += ["--pods", str(tmp_path / "openb_pod_list_x.csv"), "--policies", "bestfit"]
    if anchors is not None:
        path = tmp_path / ("anchors.csv" if "\n" in anchors else anchors)
        if "\n" in anchors:
            path.write_text(anchors)
        args += ["--anchors", str(path)]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, InputError), result.output
    assert where in str(result.exception)
