"""Planner decisions on hand-made cases: each names the behaviour it pins down."""

from __future__ import annotations

import json
from datetime import datetime, time
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from predictor.foundation.errors import InputError
from scaler.cluster.pools import NodePool, load_pools, parse_pools
from scaler.planning.margin import ConformalMargin
from scaler.planning.planner import (
    DemandOutlook,
    FleetCapacity,
    PlannerMemory,
    PlannerPolicy,
    PoolCapacity,
    ScheduledSize,
    plan,
)

AT = datetime(2024, 1, 1, 12, 0)
LEVELS = (0.5, 0.9, 0.99)


def pool(name: str = "a100", **fields: object) -> NodePool:
    spec: dict[str, object] = {
        "name": name,
        "gpu_model": "A100",
        "gpus_per_node": 8,
        "price_per_hour": 32.0,
        "power_watts": 4800.0,
        "boot_seconds": 600.0,
        "max_size": 100,
    }
    spec.update(fields)
    return NodePool.model_validate(spec)


def outlook(
    medians: list[float],
    spread: float = 4.0,
    observed: float | None = None,
    group: str = "jobs",
    models: set[str] | None = None,
) -> DemandOutlook:
    """Quantiles per row: median, median + spread / 2, median + spread."""
    med = np.asarray(medians, dtype=float)
    values = np.column_stack([med, med + spread / 2, med + spread])
    return DemandOutlook(
        group=group,
        observed=medians[0] if observed is None else observed,
        levels=LEVELS,
        values=values,
        gpu_models=None if models is None else frozenset(models),
    )


def fleet(**pools: int | tuple[int, int] | PoolCapacity) -> FleetCapacity:
    out = []
    for name, spec in pools.items():
        if isinstance(spec, PoolCapacity):
            out.append(spec)
        elif isinstance(spec, tuple):
            out.append(PoolCapacity(name, ready=spec[0], booting=spec[1]))
        else:
            out.append(PoolCapacity(name, ready=spec))
    return FleetCapacity(at=AT, pools=tuple(out))


PREDICTIVE = PlannerPolicy(mode="predictive", drop_hold_steps=0)


# ---------------------------------------------------------------- rising demand, boot lag


def test_rising_demand_is_covered_at_the_lead_time_not_now() -> None:
    """Boot takes 2 steps: nodes asked now must meet demand 2 steps ahead."""
    slow = pool(boot_seconds=1200)
    decided = plan([outlook([40, 56, 80])], fleet(a100=5), [slow], PREDICTIVE)
    # Upper bound at lead 2 = 80 + 4 = 84 GPUs -> 11 nodes of 8.
    assert decided.desired == {"a100": 11}
    (decision,) = decided.decisions
    assert decision.action == "scale_up" and decision.delta == 6
    assert "lead 2" in decision.reason
    assert decided.needs[0].add_to == pytest.approx(84.0)


def test_booting_nodes_count_as_capacity_on_the_way() -> None:
    """The known failure of reactive autoscalers: launching again while nodes boot."""
    slow = pool(boot_seconds=1200)
    decided = plan([outlook([40, 56, 80])], fleet(a100=(5, 6)), [slow], PREDICTIVE)
    assert decided.desired == {"a100": 11}
    assert decided.decisions[0].action == "hold"


def test_nodes_needed_before_a_replacement_could_arrive_are_kept() -> None:
    """Demand dips next step but is back before a new node could boot: keep the nodes."""
    slow = pool(boot_seconds=1200)
    decided = plan([outlook([76, 20, 76])], fleet(a100=10), [slow], PREDICTIVE)
    assert decided.desired == {"a100": 10}


def test_surplus_beyond_the_lead_time_goes_at_once() -> None:
    decided = plan([outlook([20, 20])], fleet(a100=10), [pool()], PREDICTIVE)
    assert decided.desired == {"a100": 3}  # 24 GPUs
    assert decided.decisions[0].action == "scale_down"


# ---------------------------------------------------------------- flapping demand


def _run(policy: PlannerPolicy, observed: list[float], nodes: NodePool) -> list[int]:
    """Feed one observation per step (forecast = last observation), apply each plan."""
    size, memory, sizes = 2, PlannerMemory(), []
    for value in observed:
        decided = plan(
            [outlook([value, value], spread=0.0)], fleet(a100=size), [nodes], policy, memory
        )
        memory, size = decided.memory, decided.desired["a100"]
        sizes.append(size)
    return sizes


def test_flapping_demand_does_not_flap_the_fleet_with_a_scale_down_delay() -> None:
    flapping = [80.0, 40.0] * 10
    eager = _run(PREDICTIVE, flapping, pool())
    steady = _run(PREDICTIVE.model_copy(update={"scale_down_delay_steps": 2}), flapping, pool())
    changes = lambda sizes: sum(a != b for a, b in pairwise(sizes))  # noqa: E731
    assert changes(eager) >= 15
    assert changes(steady) == 0
    assert steady[-1] == 10  # 80 GPUs, held through the dips


def test_reactive_mode_waits_the_unneeded_time_before_removing() -> None:
    """Cluster Autoscaler: up at once to demand seen, down only after it stayed unneeded."""
    reactive = PlannerPolicy(mode="reactive", unneeded_steps=3)
    sizes = _run(reactive, [80.0, 40.0, 40.0, 40.0, 40.0], pool())
    assert sizes == [10, 10, 10, 5, 5]


def test_cooldown_after_scale_up_blocks_scale_down() -> None:
    policy = PREDICTIVE.model_copy(update={"scale_down_cooldown_steps": 3})
    sizes = _run(policy, [80.0, 16.0, 16.0, 16.0, 16.0], pool())
    assert sizes[:3] == [10, 10, 10]
    assert sizes[3] == 2


# ---------------------------------------------------------------- pool at max, mixes


def test_a_pool_at_max_size_caps_the_plan_and_says_so() -> None:
    small = pool(max_size=4)
    decided = plan([outlook([100, 100])], fleet(a100=2), [small], PREDICTIVE)
    assert decided.desired == {"a100": 4}
    assert "max size" in decided.decisions[0].reason


def test_overflow_goes_to_the_next_cheapest_pool_allowed() -> None:
    cheap = pool("a100-spot", price_per_hour=12.0, max_size=3, capacity_type="spot")
    dear = pool("a100", price_per_hour=32.0)
    decided = plan(
        [outlook([60, 60])], fleet(**{"a100-spot": 0, "a100": 0}), [dear, cheap], PREDICTIVE
    )
    assert decided.desired == {"a100": 5, "a100-spot": 3}  # 64 GPUs: 24 cheap + 40 dear


def test_cheapest_mix_respects_gpu_models() -> None:
    a100 = pool("a100")
    t4 = pool("t4", gpu_model="T4", gpus_per_node=4, price_per_hour=3.9, power_watts=700)
    training = outlook([30, 30], spread=2.0, group="training", models={"A100"})
    inference = outlook([10, 10], spread=2.0, group="inference")  # any model
    decided = plan([training, inference], fleet(a100=0, t4=0), [a100, t4], PREDICTIVE)
    # Training (32 GPUs) only fits A100s; inference (12) goes to the cheaper-per-GPU T4s.
    assert decided.desired == {"a100": 4, "t4": 3}


def test_each_pool_gives_the_needs_of_the_groups_it_may_serve() -> None:
    a100 = pool("a100")
    t4 = pool("t4", gpu_model="T4", gpus_per_node=4, price_per_hour=3.9, power_watts=700)
    h100 = pool("h100", gpu_model="H100")
    training = outlook([30, 30], spread=2.0, group="training", models={"A100"})
    inference = outlook([10, 10], spread=2.0, group="inference", models={"T4"})
    decided = plan([training, inference], fleet(a100=0, t4=0, h100=0), [a100, t4, h100], PREDICTIVE)
    reasons = {d.pool: d.reason for d in decided.decisions}
    assert "training: forecast upper bound 32.0" in reasons["a100"]
    assert "inference" not in reasons["a100"]
    assert "inference: forecast upper bound 12.0" in reasons["t4"]
    assert "training" not in reasons["t4"]
    assert reasons["h100"] == "fleet matches need: no demand group may use this pool"


def test_energy_objective_picks_the_least_power_per_gpu() -> None:
    frugal = pool("frugal", price_per_hour=40.0, power_watts=2000)
    cheap = pool("cheap", price_per_hour=20.0, power_watts=6000)
    demand = [outlook([30, 30], spread=2.0)]
    by_cost = plan(demand, fleet(frugal=0, cheap=0), [frugal, cheap], PREDICTIVE)
    energy = PREDICTIVE.model_copy(update={"objective": "energy"})
    by_energy = plan(demand, fleet(frugal=0, cheap=0), [frugal, cheap], energy)
    assert by_cost.desired == {"frugal": 0, "cheap": 4}
    assert by_energy.desired == {"frugal": 4, "cheap": 0}


def test_a_small_remainder_takes_a_small_node() -> None:
    """Cheapest per GPU is not cheapest for the last few GPUs."""
    big = pool("big", gpus_per_node=8, price_per_hour=16.0)  # 2.0 per GPU
    small = pool("small", gpus_per_node=1, price_per_hour=2.5)
    decided = plan([outlook([16, 16], spread=1.0)], fleet(big=0, small=0), [big, small], PREDICTIVE)
    assert decided.desired == {"big": 2, "small": 1}  # 17 GPUs
    mid = pool("mid", gpus_per_node=4, price_per_hour=10.0)  # 2.5 per GPU
    decided = plan([outlook([18, 18], spread=1.0)], fleet(big=0, mid=0), [big, mid], PREDICTIVE)
    assert decided.desired == {"big": 2, "mid": 1}  # 19 GPUs: the last 3 on a 4-GPU node


def test_scale_down_takes_only_idle_or_drainable_nodes() -> None:
    busy = PoolCapacity("a100", ready=10, removable=2)
    decided = plan([outlook([20, 20])], fleet(a100=busy), [pool()], PREDICTIVE)
    assert decided.desired == {"a100": 8}


def test_booting_nodes_are_cancelled_before_ready_ones() -> None:
    booting = PoolCapacity("a100", ready=3, booting=4, removable=0)
    decided = plan([outlook([20, 20])], fleet(a100=booting), [pool()], PREDICTIVE)
    assert decided.desired == {"a100": 3}


def test_min_size_is_kept() -> None:
    decided = plan([outlook([0, 0])], fleet(a100=5), [pool(min_size=2)], PREDICTIVE)
    assert decided.desired == {"a100": 2}


# ---------------------------------------------------------------- spot interruption


def test_spot_interruption_is_replaced_from_on_demand_during_back_off() -> None:
    spot = pool("spot", price_per_hour=10.0, capacity_type="spot")
    ondemand = pool("ondemand", price_per_hour=32.0)
    hit = PoolCapacity("spot", ready=7, lost=3)
    decided = plan([outlook([76, 76])], fleet(spot=hit, ondemand=0), [spot, ondemand], PREDICTIVE)
    # 80 GPUs = 10 nodes; 7 spot remain; the 3 replacements avoid the reclaimed pool.
    assert decided.desired == {"spot": 7, "ondemand": 3}
    spot_decision = next(d for d in decided.decisions if d.pool == "spot")
    assert "3 node(s) lost" in spot_decision.reason
    assert "backing off" in spot_decision.reason
    # Once the back-off has passed, new capacity goes to the cheaper spot pool again.
    memory = decided.memory
    for _ in range(PREDICTIVE.spot_backoff_steps):
        memory = plan(
            [outlook([76, 76])], fleet(spot=7, ondemand=3), [spot, ondemand], PREDICTIVE, memory
        ).memory
    later = plan(
        [outlook([92, 92])], fleet(spot=7, ondemand=3), [spot, ondemand], PREDICTIVE, memory
    )
    assert later.desired["spot"] > 7 and later.desired["ondemand"] == 3


def test_lost_on_demand_capacity_is_replaced_in_place() -> None:
    hit = PoolCapacity("a100", ready=7, lost=3)
    decided = plan([outlook([76, 76])], fleet(a100=hit), [pool()], PREDICTIVE)
    assert decided.desired == {"a100": 10}
    assert "3 node(s) lost" in decided.decisions[0].reason


# ---------------------------------------------------------------- margin, hybrid, guard


def test_conformal_margin_learns_the_error_quantile() -> None:
    rng = np.random.default_rng(0)
    margin = ConformalMargin(target=0.05, window=2000)
    for error in rng.normal(0.0, 10.0, size=2000):
        margin = margin.observe(100.0 + error, q_base=100.0, spread=10.0)
    # Normal(0, 10): the 95th percentile is ~16.4.
    assert margin.bound(100.0, 10.0) == pytest.approx(116.4, abs=1.5)
    assert 0.03 < margin.misses / margin.seen < 0.08


def test_margin_flows_from_past_errors_into_the_plan() -> None:
    """A forecast that is always 16 GPUs low: the bound learns to add the 16."""
    policy = PREDICTIVE.model_copy(update={"min_scores": 5})
    memory, size = PlannerMemory(), 0
    for _ in range(20):
        decided = plan(
            [outlook([40, 40], spread=4.0, observed=60.0)],
            fleet(a100=size),
            [pool()],
            policy,
            memory,
        )
        memory, size = decided.memory, decided.desired["a100"]
    assert size == 8  # 44 + 16 = 60 GPUs -> 8 nodes (the plain forecast asks 6)
    assert decided.needs[0].inputs["margin_at_lead"] == pytest.approx(16.0)


def test_hybrid_reacts_at_once_when_demand_outruns_the_bound() -> None:
    hybrid = PREDICTIVE.model_copy(update={"mode": "hybrid"})
    first = plan([outlook([40, 40])], fleet(a100=6), [pool()], hybrid)
    surprised = plan(
        [outlook([40, 40], observed=64.0)], fleet(a100=6), [pool()], hybrid, first.memory
    )
    calm = plan(
        [outlook([40, 40], observed=64.0)], fleet(a100=6), [pool()], PREDICTIVE, first.memory
    )
    # The bound for that step was 44; demand came in at 64: hybrid plans 64 + 20 = 84.
    assert surprised.desired == {"a100": 11}
    assert "outran" in surprised.needs[0].reason
    assert calm.desired == {"a100": 6}


def test_a_sudden_fall_is_held_for_the_hold_steps() -> None:
    guarded = PlannerPolicy(mode="predictive", drop_guard=0.1, drop_hold_steps=2)
    memory = plan([outlook([200, 200])], fleet(a100=26), [pool()], guarded).memory
    sizes = []
    for _ in range(4):
        decided = plan(
            [outlook([10, 10], observed=10.0)], fleet(a100=26), [pool()], guarded, memory
        )
        memory = decided.memory
        sizes.append(decided.desired["a100"])
    assert sizes[:2] == [26, 26]
    assert sizes[2] == 2


def test_observations_a_hold_covered_do_not_widen_the_margin() -> None:
    """Refills after a fall are served by the held capacity: the margin that every step pays
    for must not grow on them, while the same jumps uncovered do widen it."""
    bare = ConformalMargin(target=0.05, window=100, min_scores=10)
    held = bare
    for i in range(100):
        actual = 130.0 if i % 10 == 0 else 100.0  # a jump of 3 spreads every tenth step
        bare = bare.observe(actual, q_base=100.0, spread=10.0)
        held = held.observe(actual, q_base=100.0, spread=10.0, covered=actual > 100.0)
    assert bare.bound(100.0, 10.0) == pytest.approx(130.0)
    assert held.bound(100.0, 10.0) == pytest.approx(100.0)
    assert bare.misses > 0 and held.misses == 0


def test_a_refill_inside_a_hold_is_scored_as_covered() -> None:
    """Demand falls 200 -> 10 GPUs, the plan holds 26 nodes, demand refills to 190: the
    hold served it, so the margin learned nothing from the refill."""
    guarded = PlannerPolicy(mode="predictive", drop_guard=0.1, drop_hold_steps=3, min_scores=1)
    memory = plan([outlook([200, 200])], fleet(a100=26), [pool()], guarded).memory
    memory = plan(
        [outlook([10, 10], observed=10.0)], fleet(a100=26), [pool()], guarded, memory
    ).memory
    decided = plan([outlook([10, 10], observed=190.0)], fleet(a100=26), [pool()], guarded, memory)
    # Row 0 was issued during the hold (row 1, before the fall, had 204 GPUs as its base).
    now, ahead = decided.memory.groups["jobs"].margins
    assert now.seen == 2 and now.misses == 0
    assert float(now.scores.max()) <= 0.0
    assert ahead.misses == 0


def test_a_forecast_residue_below_a_gpu_share_launches_no_node() -> None:
    """A model's upper quantile of 0.0008 GPUs over zero demand is rounding, not demand: an
    8-GPU node for it would be paid all the time an idle group stays idle."""
    idle = DemandOutlook("jobs", 0.0, LEVELS, np.array([[0.0, 0.0008, 0.0008]] * 2))
    assert plan([idle], fleet(a100=0), [pool()], PREDICTIVE).desired == {"a100": 0}
    share = DemandOutlook("jobs", 0.0, LEVELS, np.array([[0.0, 0.002, 0.002]] * 2))
    assert plan([share], fleet(a100=0), [pool()], PREDICTIVE).desired == {"a100": 1}


# ---------------------------------------------------------------- static, output, config


def test_static_mode_follows_the_daily_schedule() -> None:
    policy = PlannerPolicy(
        mode="static",
        static_sizes={"a100": 4},
        schedule=(
            ScheduledSize(start=time(8, 0), pool="a100", size=20),
            ScheduledSize(start=time(20, 0), pool="a100", size=6),
        ),
    )
    at = lambda h: FleetCapacity(at=datetime(2024, 1, 1, h), pools=(PoolCapacity("a100", 10),))  # noqa: E731
    assert plan([], at(12), [pool()], policy).desired == {"a100": 20}
    assert plan([], at(22), [pool()], policy).desired == {"a100": 6}
    assert plan([], at(3), [pool()], policy).desired == {"a100": 6}  # yesterday's last entry
    busy = FleetCapacity(
        at=datetime(2024, 1, 1, 22), pools=(PoolCapacity("a100", 10, removable=1),)
    )
    assert plan([], busy, [pool()], policy).desired == {"a100": 9}


def test_plan_is_json_ready_with_reasons_and_inputs() -> None:
    decided = plan([outlook([40, 56])], fleet(a100=2), [pool()], PREDICTIVE)
    document = json.loads(json.dumps(decided.to_dict()))
    assert document["desired"] == {"a100": 8}
    (decision,) = document["decisions"]
    assert decision["reason"] and decision["inputs"]["ready"] == 2
    assert document["needs"][0]["inputs"]["upper_at_lead"] == pytest.approx(60.0)


def test_policy_rejects_a_median_above_the_base_quantile() -> None:
    with pytest.raises(ValueError, match="median_quantile"):
        PlannerPolicy(median_quantile=0.99, base_quantile=0.9)


def test_a_policy_at_another_knob_keeps_the_rest_and_is_validated() -> None:
    base = PlannerPolicy(
        step_seconds=300,
        static_sizes={"a100": 2},
        schedule=(ScheduledSize(start=time(8), pool="a100", size=4),),
    )
    swept = base.with_knob(target_shortage=0.01, job_wait_share=0.5)
    assert (swept.target_shortage, swept.job_wait_share) == (0.01, 0.5)
    assert swept.model_copy(update={"target_shortage": 0.001, "job_wait_share": 0.1}) == base
    for bad in ({"target_shortage": 1.0}, {"job_wait_share": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            base.with_knob(**bad)


def test_pool_config_errors_name_the_field(tmp_path: Path) -> None:
    good = {
        "name": "a",
        "gpu_model": "A100",
        "gpus_per_node": 8,
        "price_per_hour": 1,
        "max_size": 4,
    }
    assert parse_pools([good])[0].name == "a"
    with pytest.raises(InputError) as bad:
        parse_pools({"pools": [good, {**good, "name": "b", "gpus_per_node": 0}]})
    assert bad.value.column == "pools.1.gpus_per_node"
    with pytest.raises(InputError, match="twice"):
        parse_pools([good, good])
    path = tmp_path / "pools.yaml"
    path.write_text("pools:\n  - name: a\n    gpu_model: A100\n    max_size: [\n")
    with pytest.raises(InputError) as broken:
        load_pools(path)
    assert broken.value.path == str(path)


def test_gpuscale_plan_prints_a_decision_from_a_forecast_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from scaler.cli import app

    pools = tmp_path / "pools.yaml"
    pools.write_text(
        "pools:\n"
        "  - {name: a100, gpu_model: A100, gpus_per_node: 8, price_per_hour: 32, max_size: 20}\n"
        "  - {name: t4, gpu_model: T4, gpus_per_node: 4, price_per_hour: 4, max_size: 20}\n"
    )
    forecast = tmp_path / "forecast.csv"
    forecast.write_text(
        "unique_id,horizon,q0.5,q0.9,q0.99\n"
        "training,1,30,34,38\ntraining,2,40,44,50\n"
        "inference,1,6,7,8\ninference,2,6,7,8\n"
    )
    args = [
        "plan", "--pools", str(pools), "--forecast", str(forecast),
        "--observed", "training=28", "--observed", "inference=6",
        "--group-models", "training=A100", "--fleet", "a100=3+1", "--json",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    # Training needs 50 A100 GPUs: 7 nodes, 6 GPUs spare; inference (any model) uses those
    # and needs one T4 node for the last 2 of its 8.
    assert document["desired"] == {"a100": 7, "t4": 1}
    assert {d["pool"]: d["action"] for d in document["decisions"]} == {
        "a100": "scale_up",
        "t4": "scale_up",
    }
    missing = CliRunner().invoke(app, [*args[:5], "--json"])
    assert missing.exit_code != 0
    assert "observed" in str(missing.exception or missing.output)


def test_a_group_named_like_a_pool_is_served_by_that_pools_model(tmp_path: Path) -> None:
    """Demand measured per pool stays on its pool's GPU model unless configured otherwise,
    in `gpuscale plan` as in the live loop (the cheaper T4 may not take A100 demand)."""
    from typer.testing import CliRunner

    from scaler.cli import app
    from scaler.cluster.pools import serving_models

    pools = tmp_path / "pools.yaml"
    pools.write_text(
        "pools:\n"
        "  - {name: a100, gpu_model: A100, gpus_per_node: 8, price_per_hour: 32, max_size: 20}\n"
        "  - {name: t4, gpu_model: T4, gpus_per_node: 4, price_per_hour: 4, max_size: 20}\n"
    )
    parsed = load_pools(pools)
    assert serving_models("a100", {}, parsed) == frozenset({"A100"})
    assert serving_models("a100", {"a100": []}, parsed) is None  # configured: any
    assert serving_models("batch", {}, parsed) is None
    forecast = tmp_path / "forecast.csv"
    forecast.write_text("unique_id,horizon,q0.5,q0.9,q0.99\na100,1,14,15,16\na100,2,14,15,16\n")
    args = ["plan", "--pools", str(pools), "--forecast", str(forecast), "--observed", "a100=14"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["desired"] == {"a100": 2, "t4": 0}
    anywhere = CliRunner().invoke(app, [*args, "--group-models", "a100=A100|T4", "--json"])
    assert json.loads(anywhere.output)["desired"] == {"a100": 0, "t4": 4}
