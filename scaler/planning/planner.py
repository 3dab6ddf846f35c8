"""The capacity planner: how many nodes of each pool the cluster should have right now.

One pure function, `plan`, serves the live reconcile loop, the trace replay and the
simulator alike. It takes the demand outlook (forecast quantiles over the coming steps, in
GPUs, per demand group), the fleet (ready and booting nodes per pool, and how many ready
nodes could go now), the pools' economics and the policy, plus the planner's own memory
from the previous call; it returns the desired size of every pool, the reason and inputs of
each decision, and the memory for the next call. Nothing here reads a clock or a file.

Timing (one step = `policy.step_seconds`): at the start of step t the planner has seen
demand up to step t-1. Row k-1 of an outlook forecasts step t-1+k, so row 0 is the step
being decided. A node requested now serves from step t+L (L = the pool's boot time in
steps) and is paid from now; a removed node stops at once. So:

- nodes are added to cover the upper bound of demand at step t+L (the lead time), and
- nodes are kept while the upper bound over steps t..t+L needs them (a node removed now
  could not be back before t+L); beyond that, keeping a node only costs.

The forecast's upper bound is a quantile plus a conformal safety margin learned from its
recent errors (`margin.ConformalMargin`). Once a group has a day of history, its size is
tuned on that history instead (`buffer_tuning`): the planner replays buffer rules (last
demand or a recent peak plus spare nodes, the forecast bound plus spare nodes, the demand
sustained over the last few steps) in whole
nodes of the group's pool and follows the cheapest one whose share of short steps stayed
within the service-level knob `target_shortage`. Nodes already booting count as capacity
on the way, so the planner never launches twice for one need.

Where the caller sees the jobs (`DemandOutlook.requests`: the whole nodes they asked for
since the previous call), a group's spare is sized on those requests instead: every spare
level replayed over them, one price of waiting for all such groups (`job_spare`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, time
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from predictor.models.requests import RequestRateForecast
from scaler.cluster.pools import NodePool, whole_nodes
from scaler.planning.buffer_tuning import RULES, RuleRecord, target_of, tune
from scaler.planning.job_spare import (
    GroupSpare,
    NodeRequests,
    RateModel,
    ScheduledNodes,
    SpareReplay,
    choose_spares,
)
from scaler.planning.margin import ConformalMargin

Mode = Literal["static", "reactive", "predictive", "hybrid"]
Objective = Literal["cost", "energy"]
ShortHistory = Literal["forecast-bound", "reactive"]
# How a group's need was sized (`GroupNeed.sizing`): its tuned rule, the job-level spare,
# the forecast bound or the reactive fallback before it has the history to tune on, or
# the reactive mode.
Sizing = Literal["tuned", "job-level-spare", "forecast-bound", "reactive-fallback", "reactive"]
# The finest GPU share a job can ask (gpu-milli); a bound below it is a forecast's rounding
# residue (a quantile of 0.0008 GPUs less a margin), not demand worth a node.
GPU_SHARE = 1e-3


class ScheduledSize(BaseModel):
    """From `start` (time of day) on, until the next entry, pool `pool` has `size` nodes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: time
    pool: str
    size: int = Field(ge=0)


class PlannerPolicy(BaseModel):
    """How the planner decides; every field has a safe default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode = "predictive"
    step_seconds: float = Field(default=600.0, gt=0)
    target_shortage: float = Field(
        default=0.001,
        gt=0,
        lt=1,
        description="share of steps allowed to lack capacity: lower costs more, waits less",
    )
    # 0.1 was chosen on the synthetic workload's validation seeds 10-14 (21 days,
    # `simulate --synthetic --frontier`, knobs 0.05-0.3, nodes beyond the plan removed at
    # once): the knob with the largest mean saving against the frontier of the buffers a
    # team chooses among (1-8 spare nodes per pool, spares tuned per pool on the week
    # before): 6.8 % fewer GPU-hours at the same GPU-minutes waited (2.2 to 13.7 % per
    # seed), against 5.8 % at 0.05 and 2.6 % at 0.2 (measured with the request forecast's
    # shape setting the price; earlier 3.8 % at 0.15 and 2.2 % at 0.3). The
    # step-level knob's 0.001 here would hold spare for almost every request.
    job_wait_share: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="where the jobs' node requests are seen (a live loop with its pending "
        "pods, the job simulator): the share of the requested GPUs' boot time they may wait "
        "(GPU-minutes waited over GPUs requested x boot; Cluster Autoscaler alone waits "
        "about 1)",
    )
    request_rate: RateModel = Field(
        default="forecast",
        description="job level: what scales the spare to the hour ahead: `forecast` (the "
        "learned forecast of node requests where the outlook has one, else the seasonal "
        "table), `seasonal` (the hour-of-week table of the requests seen), `flat` (none)",
    )
    base_quantile: float = Field(
        default=0.99, gt=0.5, lt=1, description="forecast quantile the margin is added to"
    )
    median_quantile: float = Field(default=0.5, gt=0, lt=1)
    min_spread: float = Field(
        default=1.0, gt=0, description="floor of a forecast's spread (GPUs), against zeros"
    )
    calibration_window: int = Field(
        default=4032, ge=10, description="scores and demand history kept (steps)"
    )
    tuning_min_steps: int = Field(
        default=144,
        ge=1,
        description="steps of history before the spare capacity is tuned on it (until then "
        "the forecast bound sizes the group)",
    )
    short_history: ShortHistory = Field(
        default="forecast-bound",
        description="how a group is sized before it has `tuning_min_steps` of history: "
        "`forecast-bound` (the forecast's upper bound plus its margin) or `reactive` (the "
        "demand seen, in whole nodes, with the job-level spare where the jobs are seen: "
        "never more than the demand asks until the tuned rule can size the spare). The "
        "live loop's default is `reactive` (`LivePolicy`)",
    )
    retune_steps: int = Field(default=6, ge=1, description="steps between two tunings")
    forecast_rules: bool = Field(
        default=True,
        description="off: no decision reads the demand forecast. The tuning chooses among "
        "the rules built on the observed demand alone (no `forecast` rule), and until it "
        "has a day of history the group is sized on the last demand plus the conformal "
        "margin learned from its own changes since (persistence in the forecast's place). "
        "The benchmark's `predictive-no-forecast` rows: what the models add to the plan",
    )
    min_scores: int = Field(default=30, ge=1)
    adapt_rate: float = Field(
        default=0.0, ge=0, description="ACI step size moving alpha toward the target"
    )
    objective: Objective = "cost"
    # Hysteresis and cooldowns.
    scale_down_enabled: bool = Field(
        default=True, description="off: only ever add (a reactive floor under another plan)"
    )
    scale_down_delay_steps: int = Field(
        default=0, ge=0, description="steps a surplus must last before nodes go"
    )
    scale_down_cooldown_steps: int = Field(
        default=0, ge=0, description="no scale-down within this many steps of a scale-up"
    )
    min_scale_down_nodes: int = Field(default=1, ge=1)
    drop_guard: float = Field(
        default=0.03,
        ge=0,
        description="a fall of demand by more than this share in one step is held as a dip",
    )
    drop_guard_min: float = Field(default=8.0, ge=0, description="smallest fall (GPUs) held")
    drop_hold_steps: int = Field(default=3, ge=0)
    # Reactive mode: Cluster Autoscaler's scale-down-unneeded-time, in steps.
    unneeded_steps: int = Field(default=1, ge=0)
    # Spot: after an interruption, prefer other pools for new nodes for this many steps.
    spot_backoff_steps: int = Field(default=6, ge=0)
    # Static mode: fixed sizes, optionally overridden by a daily schedule.
    static_sizes: dict[str, int] = Field(default_factory=dict)
    schedule: tuple[ScheduledSize, ...] = ()

    @model_validator(mode="after")
    def _quantiles(self) -> PlannerPolicy:
        if self.median_quantile >= self.base_quantile:
            raise ValueError("median_quantile must lie below base_quantile")
        return self

    def with_knob(self, **knob: float) -> PlannerPolicy:
        """This policy at another setting of a knob (`target_shortage`, `job_wait_share`),
        validated as a new policy would be: a sweep's value out of range fails here, where
        `model_copy` would carry it into the planner unchecked."""
        return type(self).model_validate({**self.model_dump(), **knob})


@dataclass(frozen=True, slots=True)
class DemandOutlook:
    """What is known and forecast about one demand group.

    `values[k-1, j]` is the forecast quantile `levels[j]` of demand at the k-th step after
    the last observation (row 0 = the step being decided); `observed` is the demand of the
    last step (GPUs). `gpu_models` limits which pools may serve it (None: any).
    `requests` is job-level input, from a caller that sees the jobs (the job simulator): the
    whole nodes they asked for since the previous call; where given, the group's spare
    nodes are sized on them (`job_spare`) instead of on the demand history.
    `request_rate` (job level): the forecast of the GPUs those requests will ask per hour
    over the hour a boot ahead, when nodes asked for now serve, and of its shape over the
    week (`predictor.models.requests.RequestRateForecast`); None leaves the spare to the
    seasonal table of the requests seen. `scheduled` (job
    level): the nodes scheduled jobs (CronJobs) will ask for, and when.
    """

    group: str
    observed: float
    levels: tuple[float, ...] = ()
    values: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))
    gpu_models: frozenset[str] | None = None
    requests: NodeRequests | None = None
    request_rate: RequestRateForecast | None = None
    scheduled: ScheduledNodes | None = None

    def quantile(self, level: float) -> np.ndarray:
        """Forecast of `level` over every row (exact level, as the planner asks for)."""
        try:
            return self.values[:, self.levels.index(level)]
        except ValueError:
            raise KeyError(f"outlook of {self.group!r} has no quantile {level}") from None


@dataclass(frozen=True, slots=True)
class PoolCapacity:
    """A pool's nodes at decision time. `removable`: ready nodes that are idle or drainable
    now (the only ready nodes the planner may remove); `lost`: nodes that vanished since the
    previous decision (spot interruptions, failed launches)."""

    pool: str
    ready: int
    booting: int = 0
    removable: int | None = None
    lost: int = 0

    @property
    def total(self) -> int:
        return self.ready + self.booting

    @property
    def can_remove(self) -> int:
        ready = self.ready if self.removable is None else min(self.removable, self.ready)
        return ready + self.booting


@dataclass(frozen=True, slots=True)
class FleetCapacity:
    at: datetime
    pools: tuple[PoolCapacity, ...]

    def by_pool(self) -> dict[str, PoolCapacity]:
        return {p.pool: p for p in self.pools}


@dataclass(frozen=True, slots=True)
class GroupMemory:
    """What the planner remembers of one demand group between calls."""

    recent: tuple[float, ...] = ()  # last observations, newest last
    # Forecasts made at previous calls, newest first: (base quantile, spread) per row, and
    # the level a hold after a sudden fall kept then (0 when none).
    issued: tuple[tuple[np.ndarray, np.ndarray, float], ...] = ()
    margins: tuple[ConformalMargin, ...] = ()  # one per horizon row
    last_keep: float = 0.0
    last_upper: float = math.nan  # the bound the last call set for the step it decided
    hold_level: float = 0.0
    hold_until: int = -1
    # The buffer tuning's history (nodes of the group's pool): demand observed at each call
    # and the forecast bound issued then; the rule followed and how it had done.
    observed_nodes: np.ndarray = field(default_factory=lambda: np.empty(0))
    bound_nodes: np.ndarray = field(default_factory=lambda: np.empty(0))
    tuned: RuleRecord | None = None  # the rule followed, as of the step it was chosen
    tuned_step: int = 0
    spare_replay: SpareReplay | None = None  # job level: the spare levels replayed

    def with_recent(self, recent: tuple[float, ...]) -> GroupMemory:
        """This memory with other recent observations (`dataclasses.replace` costs several
        times more, and the reactive planner calls this every minute per group)."""
        return GroupMemory(
            recent,
            self.issued,
            self.margins,
            self.last_keep,
            self.last_upper,
            self.hold_level,
            self.hold_until,
            self.observed_nodes,
            self.bound_nodes,
            self.tuned,
            self.tuned_step,
            self.spare_replay,
        )


@dataclass(frozen=True, slots=True)
class PlannerMemory:
    step: int = 0
    groups: Mapping[str, GroupMemory] = field(default_factory=dict)
    surplus_since: Mapping[str, int] = field(default_factory=dict)  # pool -> step
    last_scale_up: Mapping[str, int] = field(default_factory=dict)  # pool -> step
    spot_backoff_until: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GroupNeed:
    """The capacity one demand group needs (GPUs): `add_to` is what nodes requested now must
    reach at the lead time; `keep` is what must not be removed."""

    group: str
    add_to: float
    keep: float
    reason: str
    inputs: Mapping[str, float]
    spare_nodes: int | None = None  # job level: spare nodes on top of the nodes in use or asked
    sizing: Sizing = "forecast-bound"


@dataclass(frozen=True, slots=True)
class PoolDecision:
    pool: str
    current: int
    desired: int
    action: Literal["scale_up", "scale_down", "hold"]
    reason: str
    inputs: Mapping[str, float | int | str]

    @property
    def delta(self) -> int:
        return self.desired - self.current


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    at: datetime
    mode: Mode
    desired: Mapping[str, int]
    decisions: tuple[PoolDecision, ...]
    needs: tuple[GroupNeed, ...]
    memory: PlannerMemory

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (what `gpuscale plan --json` prints and the loop records)."""
        return {
            "at": self.at.isoformat(),
            "mode": self.mode,
            "desired": dict(self.desired),
            "decisions": [
                {
                    "pool": d.pool,
                    "current": d.current,
                    "desired": d.desired,
                    "delta": d.delta,
                    "action": d.action,
                    "reason": d.reason,
                    "inputs": dict(d.inputs),
                }
                for d in self.decisions
            ],
            "needs": [
                {
                    "group": n.group,
                    "add_to": n.add_to,
                    "keep": n.keep,
                    "reason": n.reason,
                    "sizing": n.sizing,
                    "inputs": dict(n.inputs),
                }
                for n in self.needs
            ],
        }


def plan(
    outlooks: Sequence[DemandOutlook],
    fleet: FleetCapacity,
    pools: Sequence[NodePool],
    policy: PlannerPolicy,
    memory: PlannerMemory | None = None,
) -> CapacityPlan:
    """Decide the desired size of every pool (see the module docstring)."""
    memory = memory or PlannerMemory()
    step = memory.step
    current = fleet.by_pool()
    routing = _routing(
        tuple(o.gpu_models for o in outlooks),
        tuple(
            (p.name, p.gpu_model, p.gpus_per_node, p.boot_steps(policy.step_seconds)) for p in pools
        ),
    )
    group_memory = dict(memory.groups)
    needs: list[GroupNeed] = []
    if policy.mode != "static":
        # The pool each group grows first, looked up once a call (reactive sizes none).
        first = (
            [None] * len(outlooks)
            if policy.mode == "reactive"
            else [_first_pool(pools, o, policy.objective) for o in outlooks]
        )
        spares = _job_level_spares(outlooks, first, group_memory, fleet.at, policy, step)
        for outlook, pool, group_lead in zip(outlooks, first, routing.group_lead, strict=True):
            old = group_memory.get(outlook.group) or GroupMemory()
            node_gpus = 1 if pool is None else pool.gpus_per_node
            need, group_memory[outlook.group] = _group_need(
                outlook, old, policy, group_lead, step, node_gpus, spares.get(outlook.group)
            )
            needs.append(need)

    backoff = dict(memory.spot_backoff_until)
    for pool in pools:
        if pool.is_spot and current.get(pool.name, PoolCapacity(pool.name, 0)).lost:
            backoff[pool.name] = step + policy.spot_backoff_steps

    if policy.mode == "static":
        desired, decisions = _static(fleet, pools, policy, current)
        surplus_since: dict[str, int] = {}
        last_up = dict(memory.last_scale_up)
    else:
        desired, decisions, surplus_since, last_up = _size_pools(
            needs, outlooks, pools, routing, current, policy, memory, backoff, step
        )
    new_memory = PlannerMemory(
        step=step + 1,
        groups=group_memory,
        surplus_since=surplus_since,
        last_scale_up=last_up,
        spot_backoff_until={k: v for k, v in backoff.items() if v > step},
    )
    return CapacityPlan(
        at=fleet.at,
        mode=policy.mode,
        desired=desired,
        decisions=tuple(decisions),
        needs=tuple(needs),
        memory=new_memory,
    )


# --------------------------------------------------------------------------- demand side


def _first_pool(
    pools: Sequence[NodePool], outlook: DemandOutlook, objective: Objective
) -> NodePool | None:
    """The pool a group grows first (the cheapest per GPU it may use): its spare capacity
    is sized in that pool's nodes (its GPUs per node: the unit the spare is tuned in)."""
    allowed = [p for p in pools if _serves(p, outlook)]
    if not allowed:
        return None
    return min(allowed, key=lambda p: (_unit_cost(p, objective), -p.gpus_per_node))


def _job_level_spares(
    outlooks: Sequence[DemandOutlook],
    first: Sequence[NodePool | None],
    group_memory: dict[str, GroupMemory],
    at: datetime,
    policy: PlannerPolicy,
    step: int,
) -> dict[str, tuple[int, str]]:
    """The spare nodes of the groups with job-level input (`DemandOutlook.requests`), in
    nodes of the pool each grows first (`first`, per outlook), and why: each group's
    replay takes in its requests (stored in `group_memory`); once a group has
    `tuning_min_steps` of them, one price of waiting sets every such group's spare
    (`job_spare.choose_spares`). A group still learning has no entry: until then it is
    sized like one without job-level input (the forecast bound, then its tuned rule),
    so a fresh deploy does not run without spare capacity for its first day."""
    if policy.mode not in ("predictive", "hybrid"):
        return {}
    minute = step * policy.step_seconds / 60
    tuned: dict[str, GroupSpare] = {}
    for outlook, pool in zip(outlooks, first, strict=True):
        if outlook.requests is None or pool is None:
            continue
        old = group_memory.get(outlook.group) or GroupMemory()
        replay = (old.spare_replay or SpareReplay.start(minute)).observe(
            outlook.requests, minute, at, pool.gpus_per_node, pool.boot_seconds / 60
        )
        group_memory[outlook.group] = replace(old, spare_replay=replay)
        if replay.hours.sum() * 3600 >= policy.tuning_min_steps * policy.step_seconds:
            tuned[outlook.group] = GroupSpare(
                replay,
                pool.gpus_per_node,
                pool.boot_seconds / 60,
                pool.max_size,
                outlook.request_rate,
            )
    out: dict[str, tuple[int, str]] = {}
    if tuned:
        choice = choose_spares(tuned, policy.job_wait_share, at, policy.request_rate)
        by_group = {o.group: o for o in outlooks}
        for group, nodes in choice.nodes.items():
            reason = (
                f"job-level spare {nodes} node(s) (waiting priced {choice.price:.3g} GPU-min"
                f" per GPU-h: replayed wait share {choice.share:.3f}, knob"
                f" {policy.job_wait_share:g}"
            )
            rate = tuned[group].forecast
            if policy.request_rate == "forecast" and rate is not None:
                reason += f"; request forecast {rate.ahead:.3g} GPUs/h"
            # A scheduled run's nodes are known demand: held on top of the spare for the
            # requests nobody announced, from a boot (and a step) before it fires.
            scheduled = by_group[group].scheduled
            due = (
                0
                if scheduled is None
                else scheduled.due(tuned[group].boot_minutes + policy.step_seconds / 60)
            )
            if due:
                reason += f"; {due} node(s) for scheduled jobs due within a boot"
            out[group] = (min(nodes + due, tuned[group].most), reason + ")")
    return out


def _forecast_rows(
    outlook: DemandOutlook, policy: PlannerPolicy, rows: int, observed: float
) -> tuple[np.ndarray, np.ndarray]:
    """The base and median quantiles of the next `rows` steps the bound is built on (GPUs):
    the outlook's, or, with the forecast rules off, the last demand for both (persistence:
    the conformal margin then learns the spread of the group's own changes)."""
    if not policy.forecast_rules:
        last = np.full(rows, observed)
        return last, last
    base = outlook.quantile(policy.base_quantile)[:rows].astype(float)
    median = outlook.quantile(policy.median_quantile)[:rows].astype(float)
    return base, median


def _group_need(
    outlook: DemandOutlook,
    old: GroupMemory,
    policy: PlannerPolicy,
    lead: int,
    step: int,
    node_gpus: int,
    spare: tuple[int, str] | None = None,
) -> tuple[GroupNeed, GroupMemory]:
    """`node_gpus`: GPUs per node of the pool the group grows first, the unit its spare is
    tuned in; `spare`: job level, the group's spare nodes and why (`_job_level_spares`)."""
    observed = float(outlook.observed)
    window = max(policy.unneeded_steps, 2)
    recent = (*old.recent[1 - window :], observed)
    if policy.mode == "reactive":
        # Cluster Autoscaler: add what was seen unmet; a node goes only once it has been
        # unneeded for the whole unneeded time.
        keep = max(recent[-max(policy.unneeded_steps, 1) :])
        # Positional: the minute loops build three of these a minute.
        need = GroupNeed(
            outlook.group,
            observed,
            keep,
            f"reactive: demand seen {observed:g}, peak over unneeded time {keep:g}",
            {"observed": observed, "unneeded_peak": keep},
            sizing="reactive",
        )
        return need, old.with_recent(recent)

    rows = min(lead + 1, outlook.values.shape[0])
    if rows == 0:
        raise ValueError(f"outlook of {outlook.group!r} has no forecast rows")
    base, median = _forecast_rows(outlook, policy, rows, observed)
    spread = np.maximum(base - median, policy.min_spread)

    # Score the observation against every forecast issued for it, per horizon row.
    margins = list(old.margins) or [
        ConformalMargin(
            target=policy.target_shortage,
            window=policy.calibration_window,
            min_scores=policy.min_scores,
            step_size=policy.adapt_rate,
        )
        for _ in range(rows)
    ]
    margins.extend(margins[-1] for _ in range(rows - len(margins)))
    for k, (issued_base, issued_spread, *was_held) in enumerate(old.issued[:rows]):
        # A memory the live loop saved before holds were recorded has no held level.
        held = was_held[0] if was_held else 0.0
        if k < issued_base.size:
            margins[k] = margins[k].observe(
                observed, issued_base[k], issued_spread[k], covered=observed <= held
            )
    upper = np.array([margins[k].bound(base[k], spread[k]) for k in range(rows)])
    upper = np.where(upper < GPU_SHARE, 0.0, upper)

    add_to = float(upper[rows - 1])
    keep = float(upper.max())
    reason = f"forecast upper bound {add_to:.1f} at lead {rows - 1}"
    inputs: dict[str, float] = {
        "observed": observed,
        "q_base_at_lead": float(base[rows - 1]),
        "margin_at_lead": float(upper[rows - 1] - base[rows - 1]),
        "upper_at_lead": add_to,
        "keep_upper": keep,
    }

    hold_level, hold_until = old.hold_level, old.hold_until
    previous = old.recent[-1] if old.recent else observed
    fall = previous - observed
    if policy.drop_hold_steps and fall > max(policy.drop_guard * previous, policy.drop_guard_min):
        # A sudden fall is often a blip (a telemetry gap, a requeue) that comes straight
        # back; removing nodes on it would leave the rebound short.
        hold_level, hold_until = old.last_keep, step + policy.drop_hold_steps
    if step < hold_until and keep < hold_level:
        keep = hold_level
        reason += f"; holding {hold_level:.1f} after a sudden fall"
        inputs["hold_level"] = hold_level

    held = hold_level if step < hold_until else 0.0
    forecast_keep, bound_now = keep, float(upper[0])

    # The spare capacity, tuned on the group's own history (see `buffer_tuning`).
    history = policy.calibration_window + 1
    observed_nodes = np.append(old.observed_nodes, observed / node_gpus)[-history:]
    bound_nodes = np.append(old.bound_nodes, keep / node_gpus)[-history:]
    tuned, tuned_step = old.tuned, old.tuned_step
    sizing: Sizing = "forecast-bound"
    history_steps = observed_nodes.size - 1 - (rows - 1)
    if spare is not None:
        # Job level: the spare rides on the nodes in use or asked for now (`job_spare`).
        nodes = whole_nodes(observed / node_gpus) + spare[0]
        add_to = keep = bound_now = float(nodes * node_gpus)
        reason = f"{spare[1]} on {nodes - spare[0]} in use or asked, of {node_gpus} GPUs"
        inputs["spare_nodes"] = spare[0]
        sizing = "job-level-spare"
    elif history_steps >= policy.tuning_min_steps:
        if tuned is None or step - tuned_step >= policy.retune_steps:
            tuned = tune(
                observed_nodes,
                bound_nodes,
                rows - 1,
                policy.target_shortage,
                policy.forecast_rules,
            )
            tuned_step = step
        rule = RULES[tuned.rule]
        nodes = target_of(rule, observed_nodes, bound_nodes)
        add_to = keep = bound_now = float(nodes * node_gpus)
        reason = (
            f"tuned spare capacity {nodes} node(s) of {node_gpus} GPUs: {rule.label} (short "
            f"on {tuned.short_share:.2%} of the last {tuned.steps} steps, knob "
            f"{policy.target_shortage:g}); forecast bound {forecast_keep:.1f} GPUs"
        )
        inputs["tuned_nodes"] = nodes
        inputs["tuned_short_share"] = tuned.short_share
        sizing = "tuned"
    elif policy.short_history == "reactive":
        # Too little history to tune the spare on: the demand seen, in whole nodes. The raw
        # bound (the quantile plus a margin learned on a few scores) is what no benchmark
        # scores and can ask for several times the demand; the live loop's reactive floor
        # adds what pending pods need, with the job-level spare on top.
        nodes = whole_nodes(observed / node_gpus)
        add_to = keep = bound_now = float(nodes * node_gpus)
        reason = (
            f"too little history to tune the spare ({max(history_steps, 0)} of"
            f" {policy.tuning_min_steps} steps): reactive fallback, {nodes} node(s) of"
            f" {node_gpus} GPUs for the demand seen {observed:g}; forecast bound"
            f" {forecast_keep:.1f} GPUs not used"
        )
        inputs["history_steps"] = max(history_steps, 0)
        sizing = "reactive-fallback"

    if policy.mode == "hybrid" and not math.isnan(old.last_upper) and observed > old.last_upper:
        # Demand outran the bound set for it: correct reactively by the overshoot, at once.
        overshoot = observed - old.last_upper
        add_to = max(add_to, observed + overshoot)
        keep = max(keep, add_to)
        reason += f"; demand {observed:g} outran its bound by {overshoot:.1f}"
        inputs["overshoot"] = overshoot

    new = GroupMemory(
        recent=recent,
        issued=((base, spread, held), *old.issued)[:rows],
        margins=tuple(margins),
        last_keep=forecast_keep,
        last_upper=bound_now,
        hold_level=hold_level,
        hold_until=hold_until,
        observed_nodes=observed_nodes,
        bound_nodes=bound_nodes,
        tuned=tuned,
        tuned_step=tuned_step,
        spare_replay=old.spare_replay,
    )
    spare_nodes = None if spare is None else spare[0]
    return GroupNeed(outlook.group, add_to, keep, reason, inputs, spare_nodes, sizing), new


# --------------------------------------------------------------------------- supply side


def _serves(pool: NodePool, outlook: DemandOutlook) -> bool:
    return outlook.gpu_models is None or pool.gpu_model in outlook.gpu_models


def _unit_cost(pool: NodePool, objective: Objective) -> float:
    return pool.watts_per_gpu() if objective == "energy" else pool.price_per_gpu_hour()


@dataclass(frozen=True, slots=True)
class _Routing:
    """Which pools may serve each demand group: groups in the order they are served
    (tightest first, fewest pools allowed), each group's pools least contested first, the
    groups each pool serves, and the lead times (steps) of pools and groups."""

    order: tuple[int, ...]
    pools: tuple[tuple[str, ...], ...]  # per group, in serving order
    gpus: tuple[tuple[str, int], ...]  # every pool's GPUs per node
    served: Mapping[str, tuple[int, ...]]  # pool -> the groups it may serve
    lead: Mapping[str, int]  # pool -> boot time in steps
    group_lead: tuple[int, ...]  # per group: the longest lead of its pools (0: none)


# Every `_unmet` of a call, and every call of a loop (the same groups and pools each
# minute), asks the same question: it is answered once.
@functools.lru_cache(maxsize=64)
def _routing(
    group_models: tuple[frozenset[str] | None, ...], pools: tuple[tuple[str, str, int, int], ...]
) -> _Routing:
    """`_Routing` of groups allowed `group_models` (None: any) onto pools given as (name,
    GPU model, GPUs per node, lead in steps)."""
    allowed = [
        [name for name, model, _, _ in pools if models is None or model in models]
        for models in group_models
    ]
    contest = {name: sum(name in a for a in allowed) for name, *_ in pools}
    lead = {name: steps for name, _, _, steps in pools}
    return _Routing(
        order=tuple(sorted(range(len(allowed)), key=lambda i: len(allowed[i]))),
        pools=tuple(tuple(sorted(a, key=contest.__getitem__)) for a in allowed),
        gpus=tuple((name, gpus) for name, _, gpus, _ in pools),
        served={name: tuple(g for g, a in enumerate(allowed) if name in a) for name, *_ in pools},
        lead=lead,
        group_lead=tuple(max((lead[name] for name in a), default=0) for a in allowed),
    )


def _unmet(counts: Mapping[str, int], needs: Sequence[float], routing: _Routing) -> list[float]:
    """GPUs each group lacks when the pools have `counts` nodes. Groups are served tightest
    first (fewest pools allowed), each from the least contested pools first: exact when
    allowed sets nest (any model vs one model), a close greedy otherwise."""
    free = {name: counts.get(name, 0) * gpus for name, gpus in routing.gpus}
    lack = [0.0] * len(needs)
    for g in routing.order:
        want = needs[g]
        for name in routing.pools[g]:
            take = min(want, free[name])
            free[name] -= take
            want -= take
            if want <= 0:
                break
        lack[g] = max(want, 0.0)
    return lack


def _size_pools(
    needs: Sequence[GroupNeed],
    outlooks: Sequence[DemandOutlook],
    pools: Sequence[NodePool],
    routing: _Routing,
    current: Mapping[str, PoolCapacity],
    policy: PlannerPolicy,
    memory: PlannerMemory,
    backoff: Mapping[str, int],
    step: int,
) -> tuple[dict[str, int], list[PoolDecision], dict[str, int], dict[str, int]]:
    fleets = {p.name: current.get(p.name) or PoolCapacity(p.name, 0) for p in pools}
    desired = {p.name: max(fleets[p.name].total, p.min_size) for p in pools}
    notes: dict[str, list[str]] = {p.name: [] for p in pools}
    add_to = [n.add_to for n in needs]
    keep = [n.keep for n in needs]

    # Scale up: cover every group's need at the lead time with the cheapest nodes.
    lack = _unmet(desired, add_to, routing)
    short = max(lack, default=0.0) > 1e-9
    for g in sorted(range(len(needs)), key=lambda i: -lack[i]) if short else ():
        while lack[g] > 1e-9:
            choice = _cheapest(pools, outlooks[g], desired, lack[g], policy, backoff, step)
            if choice is None:
                for p in pools:
                    if _serves(p, outlooks[g]):
                        notes[p.name].append(
                            f"{needs[g].group} lacks {lack[g]:.1f} GPUs with every pool "
                            "that may serve it at max size"
                        )
                break
            pool, nodes = choice
            desired[pool.name] += nodes
            lack = _unmet(desired, add_to, routing)

    # Scale down: drop what no group needs before a replacement could arrive, most
    # expensive first, only idle/drainable or booting nodes, after the hysteresis.
    surplus_since = dict(memory.surplus_since)
    order = sorted(pools, key=lambda p: -_unit_cost(p, policy.objective))
    # Whether the sizes cover every group's keep: a removal keeps them covering, so this
    # is asked once per call at most.
    covered: bool | None = None
    for pool in order if policy.scale_down_enabled else ():
        name = pool.name
        if desired[name] > fleets[name].total:
            surplus_since.pop(name, None)
            continue
        limit = min(fleets[name].can_remove, desired[name] - pool.min_size)
        if limit > 0 and covered is None:
            covered = _covers(desired, keep, routing)
        removable = _max_removable(name, limit, desired, keep, routing) if covered else 0
        if removable < policy.min_scale_down_nodes:
            surplus_since.pop(name, None)
            continue
        since = surplus_since.setdefault(name, step)
        last_up = memory.last_scale_up.get(name, -(10**9))
        if step - since < policy.scale_down_delay_steps:
            notes[name].append(
                f"surplus of {removable} for {step - since + 1} steps, waiting "
                f"{policy.scale_down_delay_steps} before removing"
            )
            continue
        if step - last_up < policy.scale_down_cooldown_steps:
            notes[name].append(f"scale-down cooldown after the scale-up at step {last_up}")
            continue
        desired[name] -= removable

    decisions: list[PoolDecision] = []
    last_scale_up = dict(memory.last_scale_up)
    for pool in pools:
        name = pool.name
        fleet = fleets[name]
        # Only the needs this pool may serve, each named: with one group per pool, every
        # pool's reason listed every group's bound without saying whose it was.
        served = [f"{needs[g].group}: {needs[g].reason}" for g in routing.served[name]]
        need_text = "; ".join(served) or "no demand group may use this pool"
        delta = desired[name] - fleet.total
        if delta > 0:
            action: Literal["scale_up", "scale_down", "hold"] = "scale_up"
            last_scale_up[name] = step
            why = f"add {delta}: {need_text}"
            if fleet.booting:
                why += f" ({fleet.booting} booting counted)"
        elif delta < 0:
            action = "scale_down"
            why = f"remove {-delta} surplus node(s): {need_text}"
            surplus_since.pop(name, None)
        else:
            action = "hold"
            why = f"fleet matches need: {need_text}"
        if fleet.lost:
            why += f"; {fleet.lost} node(s) lost since last decision"
        if name in backoff and backoff[name] > step:
            why += "; spot pool backing off after an interruption"
        if notes[name]:
            why += "; " + "; ".join(notes[name])
        decisions.append(
            PoolDecision(
                pool=name,
                current=fleet.total,
                desired=desired[name],
                action=action,
                reason=why,
                inputs={
                    "ready": fleet.ready,
                    "booting": fleet.booting,
                    "removable": fleet.can_remove,
                    "lost": fleet.lost,
                    "lead_steps": routing.lead[name],
                    "max_size": pool.max_size,
                },
            )
        )
    return desired, decisions, surplus_since, last_scale_up


def _cheapest(
    pools: Sequence[NodePool],
    outlook: DemandOutlook,
    desired: Mapping[str, int],
    lack: float,
    policy: PlannerPolicy,
    backoff: Mapping[str, int],
    step: int,
) -> tuple[NodePool, int] | None:
    """The next nodes to add for `lack` GPUs: whole nodes the lack fills, from the pool
    cheapest per GPU (or per watt); when the lack is smaller than any node, the pool whose
    covering nodes cost least in total (one small node may beat a big one that is cheaper
    per GPU). Spot pools backing off after an interruption come last."""
    candidates = [p for p in pools if _serves(p, outlook) and desired[p.name] < p.max_size]
    if not candidates:
        return None

    def backing_off(p: NodePool) -> bool:
        return backoff.get(p.name, -1) > step

    filled = [p for p in candidates if p.gpus_per_node <= lack + 1e-9]
    if filled:
        best = min(filled, key=lambda p: (backing_off(p), _unit_cost(p, policy.objective)))
        nodes = int((lack + 1e-9) // best.gpus_per_node)
    else:
        best = min(
            candidates,
            key=lambda p: (
                backing_off(p),
                whole_nodes(lack / p.gpus_per_node)
                * p.gpus_per_node
                * _unit_cost(p, policy.objective),
            ),
        )
        nodes = whole_nodes(lack / best.gpus_per_node)
    return best, min(nodes, best.max_size - desired[best.name])


def _max_removable(
    name: str,
    limit: int,
    desired: Mapping[str, int],
    keep: Sequence[float],
    routing: _Routing,
) -> int:
    """The most nodes of pool `name` (at most `limit`) whose removal leaves every group's
    `keep` covered, which `desired` does (coverage is monotone in the count, so bisect)."""
    counts = dict(desired)

    def fits(r: int) -> bool:
        counts[name] = desired[name] - r
        return _covers(counts, keep, routing)

    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _covers(counts: Mapping[str, int], needs: Sequence[float], routing: _Routing) -> bool:
    return all(x <= 1e-9 for x in _unmet(counts, needs, routing))


def _static(
    fleet: FleetCapacity,
    pools: Sequence[NodePool],
    policy: PlannerPolicy,
    current: Mapping[str, PoolCapacity],
) -> tuple[dict[str, int], list[PoolDecision]]:
    clock = fleet.at.time()
    desired: dict[str, int] = {}
    decisions = []
    for pool in pools:
        size = policy.static_sizes.get(pool.name, pool.min_size)
        source = "fixed size"
        entries = [e for e in policy.schedule if e.pool == pool.name]
        if entries:
            # The latest entry started today, else the last one of yesterday.
            started = [e for e in entries if e.start <= clock]
            entry = max(started or entries, key=lambda e: e.start)
            size, source = entry.size, f"schedule from {entry.start.isoformat('minutes')}"
        size = min(max(size, pool.min_size), pool.max_size)
        fleet_now = current.get(pool.name, PoolCapacity(pool.name, 0))
        have = fleet_now.total
        if size < have - fleet_now.can_remove:
            size = have - fleet_now.can_remove
            source += " (busy nodes stay)"
        desired[pool.name] = size
        action: Literal["scale_up", "scale_down", "hold"] = (
            "scale_up" if size > have else "scale_down" if size < have else "hold"
        )
        decisions.append(
            PoolDecision(
                pool.name, have, size, action, f"static: {source} {size}", {"static_size": size}
            )
        )
    return desired, decisions
