"""The simulated cloud as the live system runs it: on wall-clock time, its state in one file
of the state directory, so it outlives the process as a real cloud does.

`gpuscale scale` and `gpuscale serve` on one config open the same file: what `scale
--apply` launched is what `/v1/nodepools` shows, and a loop killed with SIGKILL and started
again finds the nodes it launched (and the targets it set) where it left them, as it would
on AWS, so the journal settles what the kill left pending instead of the loop doing it
again. The first open makes the pools at `initial_sizes`, already booted.

Each call locks the file (`fcntl.flock` on a lock file beside it), reads it, moves the
simulation's clock to now (boots complete, failed launches and interrupted spot nodes go),
does its work and writes the file back whole (a temporary file renamed into place), so a
process killed at any moment leaves the state before or after a call, never half of one.
The cloud's events are not kept: each process has those it saw (`events`).
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from predictor.foundation.atomic_files import write_text
from scaler.cluster.pools import NodePool
from scaler.providers.base import Node, ProviderError
from scaler.providers.pool_group import PoolGroup
from scaler.providers.simulated import (
    CloudEvent,
    SimulatedCloud,
    SimulatedCloudConfig,
    SimulatedNodeGroup,
)

FILENAME = "simulated-cloud.json"


def utc_now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class StoredCloud:
    """A `CloudProvider`: the simulated cloud kept in `state_dir/simulated-cloud.json`."""

    def __init__(
        self,
        pools: Sequence[NodePool],
        config: SimulatedCloudConfig,
        state_dir: str | Path,
        initial_sizes: Mapping[str, int] | None = None,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self._pools = tuple(pools)
        # Only the simulation's own settings: a subclass's extra fields are not its own.
        self.config = SimulatedCloudConfig.model_validate(
            config.model_dump(include=set(SimulatedCloudConfig.model_fields))
        )
        self.path = Path(state_dir).expanduser() / FILENAME
        self._initial = dict(initial_sizes or {})
        self._clock = clock
        self._groups = {p.name: StoredNodeGroup(self, p) for p in self._pools}
        # What this process saw happen (its own calls, and the boots, failures and
        # interruptions it was the first to read), in order; the file keeps none.
        self.events: list[CloudEvent] = []

    # CloudProvider ---------------------------------------------------------------
    def name(self) -> str:
        return "simulated"

    def node_groups(self) -> list[StoredNodeGroup]:
        return list(self._groups.values())

    def node_group_for(self, node_name: str) -> StoredNodeGroup | None:
        with self.opened() as cloud:
            found = cloud.node_group_for(node_name)
        return None if found is None else self._groups[found.id()]

    def refresh(self) -> None:
        """Nothing to re-read: every call reads the file."""

    # Faults ----------------------------------------------------------------------
    def reconfigure(self, **changes: object) -> None:
        """Change how launches go from now on (`SimulatedCloud.reconfigure`), in this
        process's settings: the file keeps nodes, not settings."""
        with self.opened() as cloud:
            cloud.reconfigure(**changes)
            self.config = cloud.config

    # The file --------------------------------------------------------------------
    @contextmanager
    def opened(self) -> Iterator[SimulatedCloud]:
        """The cloud as the file holds it, its clock moved to now; written back after,
        and what happened meanwhile added to `events`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.with_suffix(".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            before = self.path.read_text(encoding="utf-8") if self.path.exists() else None
            cloud = self._made() if before is None else self._read(before)
            now = self._clock()
            if now > cloud.now:
                cloud.advance((now - cloud.now).total_seconds())
            try:
                yield cloud
            finally:
                self.events.extend(cloud.events)
            after = cloud.snapshot()
            # Only the clock moved: nothing to write (the next call moves it again, through
            # the same boots), so reading the cloud, as `serve` does often, writes nothing.
            if before is None or _without_clock(json.loads(before)) != _without_clock(after):
                write_text(self.path, json.dumps(after, sort_keys=True))

    def _read(self, text: str) -> SimulatedCloud:
        try:
            return SimulatedCloud.restore(self._pools, self.config, json.loads(text))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProviderError(f"{self.path}: not a simulated cloud's state ({exc})") from None

    def _made(self) -> SimulatedCloud:
        """A new cloud, its pools at their initial sizes (else min size), booted by now."""
        booted = max((p.boot_seconds for p in self._pools), default=0.0) + 1.0
        cloud = SimulatedCloud(
            self._pools, self.config, start=self._clock() - timedelta(seconds=booted)
        )
        for group in cloud.node_groups():
            size = self._initial.get(group.id(), group.min_size())
            if size:
                group.increase_size(size)
        cloud.advance(booted)
        return cloud


def _without_clock(snapshot: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in snapshot.items() if k != "now"}


class StoredNodeGroup(PoolGroup):
    """One pool of the stored cloud: each call is one read (and write) of the file."""

    def __init__(self, stored: StoredCloud, pool: NodePool) -> None:
        super().__init__(pool)
        self._stored = stored

    def _call(self, act: Callable[[SimulatedNodeGroup], Any]) -> Any:
        with self._stored.opened() as cloud:
            (group,) = [g for g in cloud.node_groups() if g.id() == self.id()]
            return act(group)

    def target_size(self) -> int:
        return int(self._call(lambda g: g.target_size()))

    def increase_size(self, delta: int) -> None:
        self._call(lambda g: g.increase_size(delta))

    def decrease_target_size(self, delta: int) -> None:
        self._call(lambda g: g.decrease_target_size(delta))

    def delete_nodes(self, names: Sequence[str]) -> None:
        self._call(lambda g: g.delete_nodes(names))

    def nodes(self) -> list[Node]:
        return list(self._call(lambda g: g.nodes()))

    def _holds(self, name: str) -> bool:
        return bool(self._call(lambda g: g._holds(name)))
