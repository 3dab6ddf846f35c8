"""A simulated cloud: node groups with a boot delay, failed launches, capacity limits and spot
interruptions, all configurable and seeded, on a clock the caller advances.

Every random outcome of a node is drawn when it is launched (whether its launch fails, its
boot jitter, when a spot interruption hits it), so a run depends only on the seed and the
sequence of calls, never on how finely the clock is advanced.

A launch refused for capacity stays asked for, as an Auto Scaling group's desired capacity
does after InsufficientInstanceCapacity: the group's target counts it, and the cloud makes
it when `reconfigure` has given the pool room, unless the target was lowered first
(`decrease_target_size`). Room that nodes leave as they go is not retried on its own, so
that a run still depends only on the sequence of calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from scaler.cluster.pools import NodePool
from scaler.providers.base import Node, NodeStatus, ProviderError
from scaler.providers.pool_group import PoolGroup

EventKind = Literal["launched", "ready", "launch_failed", "no_capacity", "interrupted", "deleted"]


class SimulatedCloudConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = 0
    launch_failure_rate: float = Field(
        default=0.0, ge=0, le=1, description="share of launches that never become ready"
    )
    capacity: dict[str, int] = Field(
        default_factory=dict,
        description="most nodes the cloud can run per pool at once (absent: unlimited)",
    )
    spot_interruptions_per_hour: float = Field(
        default=0.0, ge=0, description="rate at which each ready spot node is reclaimed"
    )
    boot_jitter_seconds: float = Field(default=0.0, ge=0, description="uniform extra boot")


@dataclass(frozen=True, slots=True)
class CloudEvent:
    at: datetime
    pool: str
    node: str
    kind: EventKind


@dataclass(slots=True)
class _Instance:
    name: str
    pool: str
    launched_at: datetime
    ready_at: datetime
    fails: bool
    interrupted_at: datetime | None


_TIMES = ("launched_at", "ready_at", "interrupted_at")


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()


class SimulatedCloud:
    """A `CloudProvider` whose time moves only when `advance` is called."""

    def __init__(
        self,
        pools: Sequence[NodePool],
        config: SimulatedCloudConfig | None = None,
        start: datetime = datetime(2024, 1, 1),
    ) -> None:
        self.config = config or SimulatedCloudConfig()
        self._now = start
        self._rng = np.random.default_rng(self.config.seed)
        self._next_id = 0
        self._pools = {p.name: p for p in pools}
        self._instances: dict[str, dict[str, _Instance]] = {p.name: {} for p in pools}
        self._unfulfilled = {p.name: 0 for p in pools}  # launches refused for capacity
        self._groups = {p.name: SimulatedNodeGroup(self, p) for p in pools}
        self.events: list[CloudEvent] = []

    # CloudProvider ---------------------------------------------------------------
    def name(self) -> str:
        return "simulated"

    def node_groups(self) -> list[SimulatedNodeGroup]:
        return list(self._groups.values())

    def node_group_for(self, node_name: str) -> SimulatedNodeGroup | None:
        for pool, instances in self._instances.items():
            if node_name in instances:
                return self._groups[pool]
        return None

    def refresh(self) -> None:
        """Nothing to re-read: the simulation's state is always current."""

    # Clock ---------------------------------------------------------------------
    @property
    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> list[CloudEvent]:
        """Move the clock on; boots complete, failed launches and interrupted spot nodes
        vanish. Returns the events of the interval, in time order."""
        if seconds < 0:
            raise ValueError("time only moves forward")
        until = self._now + timedelta(seconds=seconds)
        happened: list[CloudEvent] = []
        for pool, instances in self._instances.items():
            for inst in list(instances.values()):
                if self._now < inst.ready_at <= until:
                    if inst.fails:
                        del instances[inst.name]
                        happened.append(CloudEvent(inst.ready_at, pool, inst.name, "launch_failed"))
                        continue
                    happened.append(CloudEvent(inst.ready_at, pool, inst.name, "ready"))
                hit = inst.interrupted_at
                if hit is not None and hit <= until and not inst.fails:
                    del instances[inst.name]
                    happened.append(CloudEvent(hit, pool, inst.name, "interrupted"))
        happened.sort(key=lambda e: e.at)
        self._now = until
        self.events.extend(happened)
        return happened

    # Faults ----------------------------------------------------------------------
    def reconfigure(self, **changes: object) -> None:
        """Change how launches go from now on (`launch_failure_rate`, `boot_jitter_seconds`,
        `capacity`, ...), as a failing zone or a slow image does for a while: nodes launched
        later draw from the new settings, nodes already launched keep what they drew, and
        the random generator goes on from where it was (the seed is not re-read). A pool
        retries the launches it was refused and still asks for."""
        self.config = type(self.config).model_validate(self.config.model_dump() | changes)
        for name, pool in self._pools.items():
            retry, self._unfulfilled[name] = self._unfulfilled[name], 0
            self._launch(pool, retry)  # those still without room stay asked for

    def interrupt(self, name: str) -> CloudEvent:
        """Reclaim a node now, as a spot interruption does, whatever time its launch drew."""
        group = self.node_group_for(name)
        if group is None:
            raise ProviderError(f"no node {name} to interrupt")
        del self._instances[group.id()][name]
        event = CloudEvent(self._now, group.id(), name, "interrupted")
        self.events.append(event)
        return event

    # State -----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The cloud as JSON-ready data, for `restore`: the clock, the random generator
        where it is, the next node id, every instance and the launches refused for
        capacity. The events are not part of it."""
        return {
            "now": self._now.isoformat(),
            "rng": self._rng.bit_generator.state,
            "next_id": self._next_id,
            "instances": [
                asdict(i) | {k: _iso(getattr(i, k)) for k in _TIMES}
                for instances in self._instances.values()
                for i in instances.values()
            ],
            "unfulfilled": dict(self._unfulfilled),
        }

    @classmethod
    def restore(
        cls,
        pools: Sequence[NodePool],
        config: SimulatedCloudConfig,
        snapshot: dict[str, Any],
    ) -> SimulatedCloud:
        """The cloud `snapshot` holds, with `config` for what happens from now on. A pool
        the snapshot does not know starts empty; one no longer in `pools` is dropped with
        its nodes."""
        cloud = cls(pools, config, start=datetime.fromisoformat(snapshot["now"]))
        cloud._rng.bit_generator.state = snapshot["rng"]
        cloud._next_id = int(snapshot["next_id"])
        for raw in snapshot["instances"]:
            if raw["pool"] in cloud._instances:
                times = {
                    k: None if raw[k] is None else datetime.fromisoformat(raw[k]) for k in _TIMES
                }
                inst = _Instance(**(raw | times))
                cloud._instances[inst.pool][inst.name] = inst
        for pool, count in snapshot["unfulfilled"].items():
            if pool in cloud._unfulfilled:
                cloud._unfulfilled[pool] = int(count)
        return cloud

    # Used by the groups -----------------------------------------------------------
    def _launch(self, pool: NodePool, count: int) -> None:
        limit = self.config.capacity.get(pool.name)
        instances = self._instances[pool.name]
        for _ in range(count):
            name = f"{pool.name}-{self._next_id:06d}"
            self._next_id += 1
            if limit is not None and len(instances) >= limit:
                self._unfulfilled[pool.name] += 1
                self.events.append(CloudEvent(self._now, pool.name, name, "no_capacity"))
                continue
            jitter = self._rng.uniform(0.0, self.config.boot_jitter_seconds)
            fails = bool(self._rng.random() < self.config.launch_failure_rate)
            ready_at = self._now + timedelta(seconds=pool.boot_seconds + jitter)
            interrupted_at = None
            rate = self.config.spot_interruptions_per_hour
            if pool.is_spot and rate > 0:
                interrupted_at = ready_at + timedelta(hours=float(self._rng.exponential(1 / rate)))
            instances[name] = _Instance(name, pool.name, self._now, ready_at, fails, interrupted_at)
            self.events.append(CloudEvent(self._now, pool.name, name, "launched"))

    def _cancel(self, pool: str, count: int) -> None:
        """Stop asking for `count` of the pool's refused launches (the group's check keeps
        the target at or above the nodes held, so there are that many)."""
        self._unfulfilled[pool] -= count

    def _delete(self, pool: str, names: Sequence[str]) -> None:
        for name in names:
            del self._instances[pool][name]
            self.events.append(CloudEvent(self._now, pool, name, "deleted"))

    def _nodes(self, pool: str) -> list[Node]:
        return [
            Node(
                name=i.name,
                pool=pool,
                status=NodeStatus.READY if i.ready_at <= self._now else NodeStatus.BOOTING,
                launched_at=i.launched_at,
                ready_at=i.ready_at,
            )
            for i in self._instances[pool].values()
        ]


class SimulatedNodeGroup(PoolGroup):
    """One pool of the simulated cloud (a `NodeGroup`)."""

    def __init__(self, cloud: SimulatedCloud, pool: NodePool) -> None:
        super().__init__(pool)
        self._cloud = cloud

    def target_size(self) -> int:
        name = self._pool.name
        return len(self._cloud._instances[name]) + self._cloud._unfulfilled[name]

    def increase_size(self, delta: int) -> None:
        launch = self._grown_target(delta) - self.target_size()
        if launch:
            self._cloud._launch(self._pool, launch)

    def decrease_target_size(self, delta: int) -> None:
        self._cloud._cancel(self._pool.name, self.target_size() - self._lowered_target(delta))

    def delete_nodes(self, names: Sequence[str]) -> None:
        self._shrunk_target(names)
        self._cloud._delete(self._pool.name, names)

    def nodes(self) -> list[Node]:
        return self._cloud._nodes(self._pool.name)

    def _holds(self, name: str) -> bool:
        return name in self._cloud._instances[self._pool.name]
