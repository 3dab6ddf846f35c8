"""What every provider's node group shares: one pool behind it, and the provider contract's
checks on size requests (scaler/providers/base.py), so each provider writes only how its
cloud holds, grows and removes nodes.

- `PoolGroup`: id, bounds and template are the pool's (a provider tightens the bounds by
  overriding them, and says which bound it is in `_max_reason`); `_grown_target` caps a
  growth at the max (logging the cap and its reason), and `_lowered_target` and
  `_shrunk_target` refuse a decrease or a removal the contract forbids, before anything
  changes.
- `CloudStateGroup`: a group whose state is read from a cloud and kept until the next
  read; it reads again right before checking a change (so the change is computed from the
  cloud's current numbers) and after making it (so the group reports what it did).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from scaler.cluster.pools import NodePool
from scaler.providers.base import ProviderError

StateT = TypeVar("StateT")

log = logging.getLogger(__name__)


def grown_target(seen: int, delta: int, current: int, maximum: int) -> int:
    """The target a growth by `delta` sets: `delta` above `seen`, the target the caller
    decided from, at most `maximum`, and never below `current`, what the cloud holds now.

    Set, not added to `current`: when someone else (a person, a scheduled action, a
    change of ours the cloud's read did not show yet) raised the target between the
    caller's read and now, `current + delta` would launch the caller's nodes on top of
    theirs, and the same decision taken twice would launch twice. Never below `current`:
    lowering a desired capacity lets the cloud terminate instances of its own choosing,
    and the contract removes only the nodes it is told to."""
    return max(current, min(seen + delta, maximum))


def lowered_target(seen: int, delta: int, current: int) -> int:
    """The target a decrease by `delta` sets: `delta` below `seen`, the target the caller
    decided from, and never above `current`, what the cloud holds now.

    Set from `seen`, as a growth is, so the same decision taken twice lowers once. Never
    above `current`: when the target dropped since the caller's read (a launch failed, a
    node was removed), raising it back would launch what nobody asked for now."""
    return min(current, seen - delta)


class PoolGroup(ABC):
    """A node group backed by one pool."""

    def __init__(self, pool: NodePool) -> None:
        self._pool = pool

    def id(self) -> str:
        return self._pool.name

    def min_size(self) -> int:
        return self._pool.min_size

    def max_size(self) -> int:
        return self._pool.max_size

    def template(self) -> NodePool:
        return self._pool

    @abstractmethod
    def target_size(self) -> int: ...

    @abstractmethod
    def _holds(self, name: str) -> bool:
        """Whether `name` is one of this group's nodes."""

    def _fresh_target(self) -> int:
        """The target to check a change against (a cached group reads the cloud first)."""
        return self.target_size()

    def _max_reason(self) -> str:
        """Which bound `max_size()` is, for the log line of a capped growth."""
        return "the pool's max_size"

    def _grown_target(self, delta: int) -> int:
        """The target after growing by `delta` (`grown_target`), capped at `max_size()` as
        the cloud reports it now; raises `ProviderError` if `delta` is not positive."""
        if delta <= 0:
            raise ProviderError(f"{self.id()}: size increase must be positive, got {delta}")
        seen = self.target_size()  # before the fresh read: the number the caller saw
        current = self._fresh_target()
        maximum = self.max_size()
        target = grown_target(seen, delta, current, maximum)
        if seen + delta > maximum:
            # The planner caps at the pool's max_size only; the cloud's own max may be
            # lower (an ASG's MaxSize, a NodePool's limits.nodes), and growing as far as
            # it allows beats refusing the whole growth.
            log.warning(
                "%s: %d nodes asked, target %d: max %d (%s)",
                self.id(),
                seen + delta,
                target,
                maximum,
                self._max_reason(),
            )
        return target

    def _lowered_target(self, delta: int) -> int:
        """The target after lowering by `delta` (`lowered_target`); raises `ProviderError`
        if `delta` is not positive, or the target would go below the nodes the group holds
        as the cloud reports them now (lower, the cloud would terminate nodes of its own
        choosing) or below its min."""
        if delta <= 0:
            raise ProviderError(f"{self.id()}: target decrease must be positive, got {delta}")
        seen = self.target_size()
        target = lowered_target(seen, delta, self._fresh_target())
        held = len(self.nodes())
        if target < held:
            raise ProviderError(
                f"{self.id()}: lowering target {seen} by {delta} would go below the {held}"
                " nodes the group holds (only launches not made yet can be cancelled)"
            )
        if target < self.min_size():
            raise ProviderError(
                f"{self.id()}: lowering target {seen} by {delta} would go below min size"
                f" {self.min_size()}"
            )
        return target

    def _shrunk_target(self, names: Sequence[str]) -> int:
        """The target after removing the named nodes; raises `ProviderError` if one is not
        this group's, one is named twice, or the group would go below its min."""
        target = self._fresh_target()
        unknown = [n for n in names if not self._holds(n)]
        if unknown:
            raise ProviderError(f"{self.id()}: not nodes of this group: {', '.join(unknown)}")
        if len(set(names)) != len(names):
            raise ProviderError(f"{self.id()}: a node is named twice")
        if target - len(names) < self.min_size():
            raise ProviderError(
                f"{self.id()}: deleting {len(names)} would go below min size {self.min_size()}"
            )
        return target - len(names)


class CloudStateGroup(PoolGroup, Generic[StateT]):
    """A pool group over state read from a cloud (`_read`), set to a new target by
    `_set_target`."""

    def __init__(self, pool: NodePool) -> None:
        super().__init__(pool)
        self._state: StateT | None = None

    @abstractmethod
    def _read(self) -> StateT:
        """This group's state as the cloud holds it now."""

    @abstractmethod
    def _set_target(self, target: int) -> None:
        """Ask the cloud for `target` nodes in this group."""

    def increase_size(self, delta: int) -> None:
        self._change_to(self._grown_target(delta))

    def decrease_target_size(self, delta: int) -> None:
        self._change_to(self._lowered_target(delta))

    def _change_to(self, target: int) -> None:
        """Set `target` unless the group, read fresh by the check before, is there."""
        if target == self.target_size():
            return
        try:
            self._set_target(target)
        finally:
            self._reload()

    def _fresh_target(self) -> int:
        self._reload()
        return self.target_size()

    def _remove_each(self, names: Sequence[str], remove: Callable[[str], None], done: str) -> None:
        """Remove the named nodes one by one; a failure says which went before it (`done`:
        the cloud's word for removed, "terminated" or "deleted")."""
        for count, name in enumerate(names):
            try:
                remove(name)
            except ProviderError as exc:
                gone = ", ".join(names[:count]) or "none"
                raise ProviderError(f"{exc} ({done} before it: {gone})") from None

    def _current(self) -> StateT:
        if self._state is None:
            self._reload()
        assert self._state is not None
        return self._state

    def _reload(self) -> None:
        self._state = self._read()
