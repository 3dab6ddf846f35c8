"""Which nodes of a pool go first when it shrinks: the one removal order.

The reconcile loop and the job simulator both take nodes out in this order, so what the
simulator measures is what the loop does:

1. booting nodes that may go (the caller says which: the loop lets only those go that
   have not registered, where no pod can run yet), newest first: the newest is furthest
   from serving;
2. ready nodes gpuscale already cordoned for removal: a removal a restart interrupted is
   finished before a new one starts;
3. the other ready nodes that may go (idle, or drainable: the scale-down check found their
   pods room elsewhere), those with the fewest pods to move first, then those idle longest
   (where the caller knows since when, as Cluster Autoscaler removes the nodes unneeded
   longest), newest first among equals.

Nodes that may not go, booting or ready (real GPU jobs run there, their pods fit nowhere
else, or a drain was blocked a moment ago), are never in the order. Nothing here knows
Kubernetes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True, slots=True)
class RemovalCandidate:
    """One node of a pool, as the removal order sees it."""

    key: Hashable  # whatever names the node to the caller
    launched_at: datetime | float  # any clock, one per call
    booting: bool = False
    removable: bool = True  # may go now: idle or drainable, or booting with nothing on it
    cordoned_by_us: bool = False
    movable_pods: int = 0
    idle_since: float | None = None  # when its last real job left, on any clock (None: unknown)


def removal_order(
    candidates: Iterable[RemovalCandidate], count: int | None = None
) -> list[RemovalCandidate]:
    """The candidates that may go, in the order they go (see the module docstring); the
    first `count` of them when given."""
    newest_first = sorted(candidates, key=lambda c: c.launched_at, reverse=True)
    may_go = [c for c in newest_first if c.removable]
    booting = [c for c in may_go if c.booting]
    ready = sorted(  # stable: newest first among equals
        (c for c in may_go if not c.booting),
        key=lambda c: (
            not c.cordoned_by_us,
            c.movable_pods,
            c.idle_since if c.idle_since is not None else float("inf"),
        ),
    )
    order = booting + ready
    return order if count is None else order[: max(count, 0)]
