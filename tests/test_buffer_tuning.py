"""The spare capacity tuned on a group's own history: hand-made series with known answers."""

from __future__ import annotations

from datetime import datetime

import numpy as np

from scaler.cluster.pools import NodePool
from scaler.planning.buffer_tuning import (
    RULES,
    BufferRule,
    cheapest_within,
    replay_rules,
    rule_targets,
    target_of,
)
from scaler.planning.planner import (
    DemandOutlook,
    FleetCapacity,
    PlannerMemory,
    PlannerPolicy,
    PoolCapacity,
    plan,
)

AT = datetime(2024, 1, 1, 12, 0)


def test_rules_ask_for_the_last_demand_or_the_recent_peak_plus_spare_nodes() -> None:
    observed = np.array([2.0, 5.0, 3.0, 3.0, 1.2])
    rules = (BufferRule("headroom", 1), BufferRule("rolling-max", 0, 3), BufferRule("forecast", 2))
    targets = rule_targets(observed, np.full(5, 0.5), rules)
    assert targets[0].tolist() == [3, 6, 4, 4, 3]  # ceil(demand) + 1
    assert targets[1].tolist() == [2, 5, 5, 5, 3]  # peak of the last 3 steps
    assert targets[2].tolist() == [3, 3, 3, 3, 3]  # ceil(0.5) + 2
    assert target_of(rules[1], observed, np.full(5, 0.5)) == 3


def test_a_replayed_rule_is_short_when_demand_outruns_the_capacity_ready() -> None:
    # Demand jumps by 3 nodes once; with a boot lag of one step the capacity a rule asks
    # for at call i is ready only from the step after.
    observed = np.array([2.0] * 10 + [5.0] * 10)
    rules = (BufferRule("headroom", 0), BufferRule("headroom", 3), BufferRule("headroom", 2))
    at_once = replay_rules(observed, np.zeros(20), 0, rules)
    assert [r.short_share * r.steps for r in at_once] == [1, 0, 1]  # only the jump step
    lagged = replay_rules(observed, np.zeros(20), 1, rules)
    # the jump step, and the step after it (the nodes asked for at the jump still boot)
    assert [round(r.short_share * r.steps) for r in lagged] == [2, 0, 2]
    best = cheapest_within(at_once, knob=0.0)
    assert rules[best.rule] == BufferRule("headroom", 3)
    assert rules[cheapest_within(at_once, knob=0.1).rule] == BufferRule("headroom", 0)


def test_refills_after_dips_are_served_by_the_recent_peak_not_a_standing_buffer() -> None:
    # Demand dips by 4 nodes for two steps every 12 steps and comes straight back: keeping
    # the peak of the last few steps covers it for far fewer nodes than 4 standing spares.
    cycle = [10.0] * 10 + [6.0, 6.0]
    observed = np.array(cycle * 40)
    records = replay_rules(observed, np.zeros(observed.size), 0)
    best = RULES[cheapest_within(records, knob=0.001).rule]
    assert best.kind == "rolling-max" and best.window >= 3 and best.spare == 0


def test_a_knob_that_accepts_short_steps_waits_out_blips_instead_of_chasing_them() -> None:
    # One-step blips of 3 nodes on 5 % of the steps: Cluster Autoscaler's own lag is short
    # on each and then pays for the blip; at a knob of 0.1 the cheapest rule meets a rise
    # only once it has lasted, paying less than the demand seen.
    cycle = [4.0] * 19 + [7.0]
    observed = np.array(cycle * 30)
    rules = (BufferRule("headroom", 0), BufferRule("sustained", 0, 2))
    targets = rule_targets(observed[:21], np.zeros(21), rules)
    assert targets[1].tolist() == [4] * 21  # a blip never lasts two steps
    records = replay_rules(observed, observed, 0)  # a forecast that follows demand
    chosen = cheapest_within(records, knob=0.1)
    assert RULES[chosen.rule].kind == "sustained"
    assert chosen.mean_nodes < observed.mean()
    assert chosen.short_share <= 0.1
    assert RULES[cheapest_within(records, knob=0.001).rule].kind != "sustained"


def _one_pool_run(demand: list[float], knob: float) -> list[int]:
    pool = NodePool(
        name="a100", gpu_model="A100", gpus_per_node=8, price_per_hour=32.0, max_size=50
    )
    policy = PlannerPolicy(target_shortage=knob, tuning_min_steps=50, step_seconds=600)
    memory: PlannerMemory | None = None
    sizes, ready = [], 0
    for observed in demand:
        # The forecast says a hair more than one node's worth: rounded up, two nodes.
        values = np.array([[observed, observed + 0.2, observed + 0.4]] * 2)
        outlook = DemandOutlook("jobs", observed, (0.5, 0.9, 0.99), values)
        decided = plan(
            [outlook], FleetCapacity(AT, (PoolCapacity("a100", ready),)), [pool], policy, memory
        )
        memory, ready = decided.memory, decided.desired["a100"]
        sizes.append(ready)
    return sizes


def test_a_group_that_needs_exactly_one_node_holds_one_node_not_two() -> None:
    sizes = _one_pool_run([8.0] * 300, knob=0.003)
    assert sizes[10] == 2  # before tuning: the forecast bound, rounded up to whole nodes
    assert set(sizes[100:]) == {1}  # tuned: one node was never short


def test_the_per_base_replay_agrees_with_replaying_every_rule_on_its_own() -> None:
    rng = np.random.default_rng(7)
    observed = np.maximum(np.cumsum(rng.integers(-2, 3, 600)) + 20, 0) / 3
    forecast = observed + rng.uniform(-1, 3, 600)
    targets = rule_targets(observed, forecast)
    demand = np.ceil(observed - 1e-9)
    for lead in (0, 1, 3):
        ready = targets.copy()
        for j in range(1, lead + 1):
            ready[:, j:] = np.minimum(ready[:, j:], targets[:, :-j])
        short = (demand[None, lead + 1 :] > ready[:, lead:-1]).mean(axis=1)
        nodes = targets[:, lead:-1].mean(axis=1)
        for record in replay_rules(observed, forecast, lead):
            assert record.short_share == short[record.rule]
            assert abs(record.mean_nodes - nodes[record.rule]) < 1e-9
