"""Job-level spare nodes (`planning.job_spare`): the replay of each spare level over the
node requests, the one price of waiting, the planner's job-level input, and the job
simulator's predictive mode holding the planner's spare on top of reactive demand."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

import numpy as np
import pandas as pd
import pytest
from test_simulator import BEGIN, LEVELS, flat_outlook, gpu_pool, jobs, run_mode

import scaler.planning.job_spare as job_spare
from predictor.models.requests import RequestRateForecast
from scaler.evaluation.job_simulator import simulate_jobs
from scaler.placement.estimator import ScaleUpEstimate
from scaler.planning.job_spare import (
    BUCKETS,
    GroupSpare,
    NodeRequests,
    ScheduledNodes,
    SpareReplay,
    choose_spares,
    hour_bucket,
)
from scaler.planning.planner import (
    DemandOutlook,
    FleetCapacity,
    PlannerPolicy,
    PoolCapacity,
    plan,
)
from scaler.planning.reactive import ReactiveDemand

MONDAY = datetime(2024, 1, 1)  # a Monday


def replayed(requests: list[tuple[float, int]], boot: float = 10.0) -> SpareReplay:
    """One call at minute 60 taking in `requests` (minute, nodes) of 8-GPU nodes."""
    return SpareReplay.start(0.0).observe(
        NodeRequests(tuple(60.0 - t for t, _ in requests), tuple(n for _, n in requests)),
        60.0,
        MONDAY + timedelta(hours=1),
        8,
        boot,
    )


def test_a_request_within_the_spare_waits_nothing_and_a_larger_one_a_boot() -> None:
    waited = replayed([(5.0, 1)]).waited
    assert waited[0] == 8 * 10  # no spare: one node, a whole boot
    assert (waited[1:] == 0).all()
    gang = replayed([(5.0, 4)]).waited  # a gang of four gains nothing from fewer than four
    assert (gang[:4] == 4 * 8 * 10).all() and (gang[4:] == 0).all()


def test_a_spare_node_taken_is_back_one_boot_later() -> None:
    # Spare 1: the node taken at 5 is replaced at 15, so a request at 8 waits 7 minutes and
    # one at 20 none; spare 2 serves both at once.
    waited = replayed([(5.0, 1), (8.0, 1), (20.0, 1)]).waited
    assert waited[1] == 8 * 7
    assert waited[2] == 0
    assert replayed([(5.0, 1), (8.0, 1)]).free[2] == 0  # both taken, both on the way


def test_the_replay_counts_the_hours_and_the_gpus_requested_by_hour_of_week() -> None:
    replay = replayed([(5.0, 2)])
    assert replay.hours.sum() == pytest.approx(1.0)
    assert replay.requested[hour_bucket(MONDAY)] == 16
    assert hour_bucket(MONDAY + timedelta(days=5, hours=3)) == 27  # Saturday, 3 am
    with pytest.raises(ValueError, match="one time per request"):
        NodeRequests((1.0,), ())


def history(gangs_per_day: int, days: int = 7, gang: int = 4) -> SpareReplay:
    """A week of calls every 10 minutes with `gangs_per_day` gangs of `gang` nodes, all
    in the afternoon (14:00-17:00)."""
    replay = SpareReplay.start(0.0)
    for call in range(1, days * 144 + 1):
        at = MONDAY + timedelta(minutes=10 * call)
        afternoon = 14 <= at.hour < 17 and call % (18 // max(gangs_per_day, 1)) == 0
        n = 1 if afternoon and gangs_per_day else 0
        replay = replay.observe(NodeRequests((5.0,) * n, (gang,) * n), 10.0 * call, at, 8, 10.0)
    return replay


def test_one_price_buys_spare_where_it_saves_most_waiting() -> None:
    busy, quiet = history(6), history(1)
    groups = {g: GroupSpare(r, 8, 10.0, 32) for g, r in (("busy", busy), ("quiet", quiet))}
    afternoon, night = MONDAY + timedelta(hours=15), MONDAY + timedelta(hours=3)
    # Without spare every request waits a boot (share 1): a knob of 1 allows that.
    loose = choose_spares(groups, 1.0, afternoon)
    assert loose.nodes == {"busy": 0, "quiet": 0}
    tight = choose_spares(groups, 0.05, afternoon)
    assert tight.share <= 0.05
    # The gang's four nodes, not fewer, where gangs come often; none where they are rare.
    assert tight.nodes == {"busy": 4, "quiet": 0}
    # At a looser knob the busy hours keep theirs and the night goes without.
    assert choose_spares(groups, 0.5, afternoon).nodes["busy"] == 4
    assert choose_spares(groups, 0.5, night).nodes["busy"] == 0
    capped = choose_spares({"busy": GroupSpare(busy, 8, 10.0, 2)}, 0.01, afternoon)
    assert capped.nodes == {"busy": 2}


def test_the_spare_asked_for_now_is_the_one_the_hour_a_boot_later_needs() -> None:
    # At this knob the afternoon's gangs are worth spare from 14:00 on (13:00-14:00, when
    # few come, is not): a node asked for at 13:45 is ready at 13:55, still that hour, one
    # asked for at 13:55 at 14:05.
    groups = {"busy": GroupSpare(history(6), 8, 10.0, 32)}
    quiet = MONDAY + timedelta(hours=13, minutes=45)
    assert choose_spares(groups, 0.7, quiet).nodes == {"busy": 0}
    assert choose_spares(groups, 0.7, quiet + timedelta(minutes=10)).nodes == {"busy": 4}


def test_the_spare_follows_the_request_forecast_where_one_is_given() -> None:
    # The same history, two forecasts of the hour ahead: a burst (five times the week's
    # rate) buys spare at night that the seasonal table would not; a lull holds none in
    # the afternoon, where the table holds the gang's four nodes.
    busy = history(6)
    mean = float(busy.requested.sum() / busy.hours.sum())
    afternoon, night = MONDAY + timedelta(hours=15), MONDAY + timedelta(hours=3)

    def spare(at: datetime, rate: float | None, rates: str = "forecast") -> int:
        forecast = None if rate is None else RequestRateForecast(rate)
        group = GroupSpare(busy, 8, 10.0, 32, forecast)
        return choose_spares({"busy": group}, 0.5, at, rates).nodes["busy"]

    assert spare(night, None) == 0 and spare(afternoon, None) == 4  # the table
    assert spare(night, 5 * mean) == 4  # a burst under way: spare at night too
    assert spare(afternoon, 0.01 * mean) == 0  # a lull: none
    assert spare(night, 5 * mean) != spare(night, 0.01 * mean)
    # `seasonal` ignores the forecast; `flat` ignores the hour too (the week's mean rate).
    assert spare(night, 5 * mean, "seasonal") == 0
    assert spare(night, None, "flat") == spare(afternoon, None, "flat")


def test_the_forecasts_shape_over_the_week_sets_the_price_of_waiting() -> None:
    # The same history and rate ahead: priced on the table's afternoon-only shape, the
    # waits the knob allows fall in the afternoon; on a forecast that spreads the requests
    # over every hour, a spare at the rate's mean costs every hour alike, and the price
    # that keeps the waits within the knob is another one.
    busy = history(6)
    mean = float(busy.requested.sum() / busy.hours.sum())
    afternoon = MONDAY + timedelta(hours=15)

    def choice(shape: tuple[float, ...] | None, rates: str = "forecast"):
        group = GroupSpare(busy, 8, 10.0, 32, RequestRateForecast(mean, shape))
        return choose_spares({"busy": group}, 0.5, afternoon, rates)

    table, flat = choice(None), choice((1.0,) * BUCKETS)
    assert flat.price != pytest.approx(table.price)
    assert flat.share <= 0.5 and table.share <= 0.5
    # Only `forecast` reads the shape; a shape of the wrong length is refused.
    assert choice((1.0,) * BUCKETS, "seasonal").price == pytest.approx(
        choice(None, "seasonal").price
    )
    with pytest.raises(ValueError, match="48 hour buckets"):
        RequestRateForecast(mean, (1.0,) * 24)


def test_the_planner_holds_the_nodes_of_scheduled_runs_due_within_a_boot() -> None:
    pool = gpu_pool(max_size=20)
    policy = PlannerPolicy(job_wait_share=0.5, tuning_min_steps=6)
    memory = None
    for step in range(12):
        at = MONDAY + timedelta(minutes=10 * step)
        fleet = FleetCapacity(at, (PoolCapacity("gpu", 2),))
        last = plan([outlook(NodeRequests())], fleet, [pool], policy, memory)
        memory = last.memory
    assert last.needs[0].spare_nodes == 0  # nothing was ever requested
    at = MONDAY + timedelta(hours=2)
    fleet = FleetCapacity(at, (PoolCapacity("gpu", 2),))
    # A gang of four fires in 15 minutes (boot 10 + a 10-minute step: within the window),
    # another in 45 (not yet).
    due = replace(outlook(NodeRequests()), scheduled=ScheduledNodes((15.0, 45.0), (4, 3)))
    planned = plan([due], fleet, [pool], policy, memory)
    assert planned.needs[0].spare_nodes == 4
    assert "4 node(s) for scheduled jobs due within a boot" in planned.needs[0].reason
    assert ScheduledNodes((15.0, 45.0), (4, 3)).due(60) == 7
    with pytest.raises(ValueError, match="one time per run"):
        ScheduledNodes((1.0,), ())


def test_nothing_requested_holds_no_spare() -> None:
    replay = SpareReplay.start(0.0).observe(NodeRequests(), 600.0, MONDAY, 8, 10.0)
    choice = choose_spares({"g": GroupSpare(replay, 8, 10.0, 10)}, 0.01, MONDAY)
    assert choice.nodes == {"g": 0} and choice.share == 0
    assert replay.waited.shape == (job_spare.LEVELS,) and replay.requested.shape == (BUCKETS,)


def outlook(requests: NodeRequests | None, observed: float = 16.0) -> DemandOutlook:
    return DemandOutlook(
        "gpu",
        observed,
        LEVELS,
        np.full((2, len(LEVELS)), observed),
        gpu_models=frozenset({"A100"}),
        requests=requests,
    )


def test_the_planner_sizes_the_spare_on_job_level_input_only() -> None:
    pool = gpu_pool(max_size=20)
    policy = PlannerPolicy(job_wait_share=0.05, tuning_min_steps=6)
    fleet = FleetCapacity(MONDAY, (PoolCapacity("gpu", 2),))
    trace_memory = job_memory = None
    for step in range(12):
        at = MONDAY + timedelta(minutes=10 * step)
        now = FleetCapacity(at, fleet.pools)
        trace = plan([outlook(None)], now, [pool], policy, trace_memory)
        job = plan([outlook(NodeRequests((3.0,), (2,)))], now, [pool], policy, job_memory)
        trace_memory, job_memory = trace.memory, job.memory
        assert trace.needs[0].spare_nodes is None
    (need,) = job.needs
    assert need.spare_nodes == 2  # every step a request of two nodes, which waiting costs
    assert need.add_to == need.keep == (2 + 2) * 8  # on the two nodes in use
    assert "job-level spare 2 node(s)" in need.reason
    assert job.desired == {"gpu": 4}
    # Until a group has `tuning_min_steps` of requests it is sized as without them: on
    # the forecast's upper bound (here 3 x 8 GPUs), not on the nodes in use alone.
    first = plan([outlook(NodeRequests((3.0,), (2,)), observed=20.0)], fleet, [pool], policy)
    assert first.needs[0].spare_nodes is None
    assert first.needs[0].reason.startswith("forecast upper bound")
    assert first.desired == {"gpu": 3}


def test_predictive_mode_holds_the_planner_spare_on_top_of_reactive_demand() -> None:
    # An 8-GPU job every hour for a day: reactive makes each wait a boot; predictive learns
    # that one spare node serves them all and holds it, preempted and asked again.
    stream = jobs(*[(float(m), 8, 1000, 20) for m in range(5, 24 * 60, 60)])
    minutes = 24 * 60
    common = (
        [gpu_pool(min_size=0)],
        BEGIN,
        BEGIN + pd.Timedelta(hours=12),
        BEGIN + pd.Timedelta(minutes=minutes),
    )
    policy = PlannerPolicy(job_wait_share=0.1, tuning_min_steps=36)
    reactive = simulate_jobs(stream, common[0], "reactive", *common[1:], policy)
    predictive = simulate_jobs(
        stream, common[0], "predictive", *common[1:], policy, flat_outlook(0.0, minutes), LEVELS
    )
    assert (reactive.waits == 10).all()
    assert (predictive.waits == 0).all()
    assert predictive.placeholders_preempted >= predictive.waits.size
    assert reactive.gpu_hours < predictive.gpu_hours < reactive.gpu_hours + 8 * 12 + 1


def test_the_simulator_replaces_a_spare_node_taken_as_the_replay_assumes() -> None:
    # Two spare nodes (10-minute boot): the jobs at 40 and 42 take them, each asking for
    # its node again at once (ready at 50 and 52); the one at 45 finds none free and starts
    # on the first back, at 50; by 53 a spare node is free again.
    arrivals = [40.0, 42.0, 45.0, 53.0]
    stream = jobs(*[(m, 8, 1000, 60) for m in arrivals])
    headroom = run_mode(stream, "headroom", spare=2, minutes=120)
    assert headroom.waits.tolist() == [0.0, 0.0, 5.0, 0.0]
    waited = replayed([(m, 1) for m in arrivals]).waited
    assert waited[2] == 8 * 5  # the replay's level 2: the same five minutes for one node


def test_node_requests_are_the_rises_of_reactive_demand() -> None:
    demand = ReactiveDemand({"a100": 7, "h100": 1, "t4": 3}, ScaleUpEstimate(pools={}))
    assert demand.rises({"a100": 3, "h100": 2}) == {"a100": 4}  # a gang of four at once
    assert demand.rises({}) == {}


def test_the_job_level_spare_follows_its_own_knob_not_the_step_level_one() -> None:
    # The two knobs mean different things (a share of boot time waited, a share of steps
    # short): the job-level spare moves with `job_wait_share` only, and a live loop left
    # at the defaults sizes it at the job level's default, not at the step level's 0.001.
    pool = gpu_pool(max_size=20)
    fleet = FleetCapacity(MONDAY, (PoolCapacity("gpu", 2),))

    def spare(policy: PlannerPolicy) -> int | None:
        memory = None
        for step in range(12):
            now = FleetCapacity(MONDAY + timedelta(minutes=10 * step), fleet.pools)
            result = plan([outlook(NodeRequests((3.0,), (2,)))], now, [pool], policy, memory)
            memory = result.memory
        return result.needs[0].spare_nodes

    tuned = {"tuning_min_steps": 6}
    assert PlannerPolicy().job_wait_share == 0.1
    assert spare(PlannerPolicy(**tuned, target_shortage=0.001)) == spare(
        PlannerPolicy(**tuned, target_shortage=0.2)
    )
    assert spare(PlannerPolicy(**tuned, job_wait_share=0.001)) == 2
    assert spare(PlannerPolicy(**tuned, job_wait_share=1.0)) == 0
