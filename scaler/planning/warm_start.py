"""Warm start: the planner's memory rebuilt from demand history, as a replay of it builds it.

What the planner remembers between calls (the recent demand, the forecasts it issued and
their conformal margins, the demand and bound history in nodes its spare is tuned on, the
tuned rule) is a function of the demand history and the forecasts made on it. A process
that starts with no memory, or with one from before a gap (a restart after an outage, a
replica taking the Lease from another), rebuilds it here: `replay_memory` calls `plan` on
every past step in turn, the fleet following its own targets as the trace replay's does
(`scaler.evaluation.replay`: nodes asked for at step t ready from t + boot, removals at
once, booting nodes first), so its first live decision is the one a replay of the same
history by the same planner takes at that step.

Pure: the caller (`scaler.controller.warm_start`) builds the outlooks of each past step
from the telemetry store and its forecaster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from scaler.cluster.pools import NodePool
from scaler.planning.planner import (
    DemandOutlook,
    FleetCapacity,
    PlannerMemory,
    PlannerPolicy,
    PoolCapacity,
    plan,
)


@dataclass(frozen=True, slots=True)
class HistoryStep:
    """One past decision: when, and each group's outlook then (its `observed` the demand of
    that step, its forecast rows made from the history up to it)."""

    at: datetime
    outlooks: tuple[DemandOutlook, ...]


@dataclass(frozen=True, slots=True)
class ReplayedMemory:
    """The memory after the replayed steps, how many there were, and the fleet the replay
    had at the end (ready and booting nodes per pool)."""

    memory: PlannerMemory
    steps: int
    fleet: Mapping[str, tuple[int, int]]


@dataclass
class _PoolFleet:
    """A pool's nodes under the trace replay's rules."""

    lag: int
    ready: int = 0
    booting: list[int] | None = None  # booting[k]: nodes ready at the step after next + k

    def __post_init__(self) -> None:
        self.booting = [0] * self.lag

    def advance(self) -> None:
        assert self.booting is not None
        if self.lag:
            self.ready += self.booting[0]
            self.booting = [*self.booting[1:], 0]

    def set_target(self, target: int) -> None:
        assert self.booting is not None
        total = self.ready + sum(self.booting)
        if target > total:
            if self.lag == 0:
                self.ready += target - total
            else:
                self.booting[self.lag - 1] += target - total
        elif target < total:
            excess = total - target
            for k in range(self.lag - 1, -1, -1):  # newest launches first, then ready nodes
                take = min(excess, self.booting[k])
                self.booting[k] -= take
                excess -= take
            self.ready -= excess


def replay_memory(
    steps: Sequence[HistoryStep],
    pools: Sequence[NodePool],
    policy: PlannerPolicy,
    memory: PlannerMemory | None = None,
) -> ReplayedMemory:
    """The planner's memory once it has decided every step of `steps` in order, from
    `memory` (None: a fresh planner, as a replay from the first step starts)."""
    fleets = {p.name: _PoolFleet(p.boot_steps(policy.step_seconds)) for p in pools}
    for step in steps:
        for f in fleets.values():
            f.advance()
        capacity = FleetCapacity(
            at=step.at,
            pools=tuple(
                PoolCapacity(name, f.ready, sum(f.booting or ())) for name, f in fleets.items()
            ),
        )
        decided = plan(step.outlooks, capacity, pools, policy, memory)
        memory = decided.memory
        for name, f in fleets.items():
            f.set_target(max(int(decided.desired[name]), 0))
    return ReplayedMemory(
        memory=memory or PlannerMemory(),
        steps=len(steps),
        fleet={name: (f.ready, sum(f.booting or ())) for name, f in fleets.items()},
    )
