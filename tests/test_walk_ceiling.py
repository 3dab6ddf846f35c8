"""The walk ceiling: the best causal policy on memoryless demand, matched as `bench scaling`
matches ours, so that a bar set on the scaling benchmark can be read against what any
forecast could reach."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from replay_fixtures import bench_vc_slice, hand_series

from scaler.evaluation.replay import PlannedTargets, replay
from scaler.evaluation.scaling_bench import HEADROOM_NODES
from scaler.evaluation.walk_ceiling import (
    changes_before_test,
    ideal_spares,
    memoryless_walk,
    walk_ceiling,
    walk_points,
)

# 97 flat steps and one rise each of 1, 2 and 3 nodes in 100 changes.
LAW = np.array([0.0] * 97 + [1.0, 2.0, 3.0])


def test_the_ideal_spare_is_the_least_whose_chance_of_a_larger_rise_is_the_knob() -> None:
    rng = np.random.default_rng(0)
    # P(change > 2) = 0.01: two spare nodes on every step meet 0.01 exactly, no mixing.
    assert set(ideal_spares(LAW, 0.01, 1000, rng)) == {2}
    # 0.015 lies between P(> 2) = 0.01 and P(> 1) = 0.02: half the steps hold one node less.
    spares = ideal_spares(LAW, 0.015, 200_000, rng)
    assert set(spares) == {1, 2}
    assert np.mean(spares == 1) == pytest.approx(0.5, abs=0.01)
    # A knob above the chance of any rise (0.03) buys holding less than the last demand.
    spares = ideal_spares(LAW, 0.1, 200_000, rng)
    assert set(spares) == {-1, 0}
    # P(change > -1) = 1, P(change > 0) = 0.03: 7 % of the steps at -1 make 0.1 expected.
    assert np.mean(spares == -1) == pytest.approx(0.07 / 0.97, abs=0.005)


def test_a_walk_draws_its_changes_from_the_law_and_never_goes_negative() -> None:
    rng = np.random.default_rng(1)
    walk = memoryless_walk(np.array([-2.0, 0.0, 2.0]), 1.0, 5000, rng)
    assert walk.min() >= 0
    assert set(np.abs(np.diff(walk))) <= {0.0, 2.0, 4.0}  # a reflection can double a step
    with pytest.raises(ValueError, match="no steps before its test window"):
        changes_before_test(hand_series([3.0, 3.0], start=1))


def test_on_a_walk_the_ideal_policy_is_short_on_the_knobs_share_of_steps() -> None:
    rng = np.random.default_rng(2)
    demand = memoryless_walk(LAW, 50.0, 100_000, rng)
    s = hand_series(demand, start=1, static=None)
    last = np.concatenate(([0.0], demand[:-1]))
    for knob in (0.01, 0.015, 0.1):
        targets = np.maximum(last + ideal_spares(LAW, knob, demand.size, rng), 0)
        row = replay(s, PlannedTargets("ideal", targets), 0).row()
        assert row["shortage_events"] / row["steps"] == pytest.approx(knob, rel=0.1)


def test_where_the_ideal_spare_is_a_swept_setting_it_never_beats_the_envelope() -> None:
    # A series whose changes before the test window are LAW: at 0.01 the ideal holds 2
    # spare nodes on every step, which is Cluster Autoscaler plus two spare nodes, a row of
    # the envelope: its match costs no more. Only a spare between the settings can win.
    assert 2 in HEADROOM_NODES
    demand = np.concatenate(([10.0], 10.0 + np.cumsum(LAW), [13.0] * 300))
    s = hand_series(demand, start=LAW.size + 1)
    assert np.array_equal(changes_before_test(s), LAW)
    for walk in range(3):
        (point,) = walk_points(s, (0.01,), walk, unneeded=1)
        assert point["matched"] is not None and point["saving"] <= 1e-12


def test_on_flat_demand_the_only_saving_is_the_shortage_the_knob_allows() -> None:
    s = hand_series([4.0] * 2400, start=1200)
    ceiling = walk_ceiling([(s, 1)], (0.001, 0.1), walks=2)
    assert len(ceiling.points) == 4
    for p in ceiling.points:
        # Every change is 0: the ideal holds the last demand, and one node less on the
        # knob's share of steps, each such step one node short.
        steps = s.end - s.start
        assert p["ideal_node_steps"] == p["ideal_events"]
        assert p["ideal_ratio"] == pytest.approx(1 - p["ideal_events"] / (4 * steps))
        # Cluster Autoscaler is never short on flat demand and every buffer costs more.
        assert p["matched"] == "reactive"
        assert p["saving"] == pytest.approx(1 - p["ideal_ratio"])
    at_01 = [p for p in ceiling.points if p["knob"] == 0.1]
    assert all(0.05 <= p["short_share"] <= 0.2 for p in at_01)
    # 0.001 and 0.1 each save a quarter of their short share: 1.3 % on average, short of 3 %.
    assert ceiling.runs_meeting_bar == 0
    assert ceiling.document()["lag_steps"] == 0


def test_an_idle_series_gives_no_points_rather_than_a_ratio_of_nothing() -> None:
    ceiling = walk_ceiling([(hand_series([0.0] * 300, start=100), 1)], (0.01,), walks=2)
    assert ceiling.points == [] and ceiling.runs_meeting_bar == 0
    (knob,) = ceiling.by_knob
    assert knob["points"] == knob["matched"] == 0
    assert knob["mean_saving"] is None and knob["share_in_band"] is None


def test_bench_scaling_walks_write_the_ceiling(traces_dir: Path, tmp_path: Path) -> None:
    options = ("--lag", "0", "--knob", "0.01", "--knob", "0.1", "--walks", "2")
    result, document = bench_vc_slice(traces_dir, tmp_path / "scaling.json", *options)
    assert "on memoryless demand" in result.output and "sets of walks" in result.output
    ceiling = document["walk_ceiling"]
    assert ceiling["walks"] == 2 and ceiling["lag_steps"] == 0
    assert [k["knob"] for k in ceiling["by_knob"]] == [0.01, 0.1]
    assert len(ceiling["points"]) == 2 * 2
    assert {"walk", "knob", "ideal_ratio", "matched", "saving", "short_share"} <= set(
        ceiling["points"][0]
    )
    # Reproducible: the same walks the next time.
    _, again = bench_vc_slice(traces_dir, tmp_path / "again.json", *options)
    assert again["walk_ceiling"] == ceiling
