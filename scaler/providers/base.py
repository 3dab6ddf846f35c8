"""The provider interface, in the spirit of Cluster Autoscaler's `CloudProvider` and
`NodeGroup`: a cloud is a set of node groups (one per pool), and a group can report its
target size and nodes, grow by a number of nodes, and delete exactly the nodes it is told
to (so the node that goes is the idle or drained one the planner chose, never a random one),
and lower a target the cloud has not fulfilled (Cluster Autoscaler's `DecreaseTargetSize`).

Invariants every provider keeps (tests/provider_contract.py checks them):
- `target_size()` is the number of nodes the group holds or is launching, plus those the
  cloud could not launch yet (an Auto Scaling group's desired capacity stays where it was
  set after InsufficientInstanceCapacity, and the group launches them once capacity
  returns); it stays within `[min_size(), max_size()]`;
- `increase_size(delta)` needs delta > 0, else raises `ProviderError` and changes
  nothing; it sets the target to `target_size()` (as the caller read it) + delta, capped
  at `max_size()` as the cloud reports it now, and never lowers the cloud's current
  target (a cap is logged with its reason);
- `decrease_target_size(delta)` needs delta > 0; it sets the target to `target_size()`
  (as the caller read it) - delta, never above the cloud's current target, and refuses
  (`ProviderError`, nothing changed) a target below the nodes the group holds now, booting
  ones included, or below min: it only cancels launches not made, no node goes;
- `delete_nodes(names)` removes exactly those nodes and lowers the target by as many; a
  name not in the group, a repeated name, or going below min raises `ProviderError` and
  changes nothing;
- nodes vanish on their own only through the cloud (failed launches, spot interruptions),
  and then the target drops with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Protocol, runtime_checkable

from scaler.cluster.pools import NodePool


class ProviderError(RuntimeError):
    """The cloud refused or could not carry out a request; nothing was changed."""


class NodeStatus(StrEnum):
    BOOTING = "booting"
    READY = "ready"


@dataclass(frozen=True, slots=True)
class Node:
    name: str  # the provider's id (instance id); Kubernetes maps it via providerID
    pool: str
    status: NodeStatus
    launched_at: datetime
    ready_at: datetime | None = None  # when it became (or is expected to become) ready


def kube_time(text: object) -> datetime:
    """A Kubernetes timestamp (`2025-03-01T12:00:00Z`) on the loop's clock (naive UTC);
    now when there is none, for providers whose nodes are Kubernetes objects."""
    try:
        parsed = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        parsed = datetime.now(UTC)
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(UTC)
    return parsed.replace(tzinfo=None)


@runtime_checkable
class NodeGroup(Protocol):
    def id(self) -> str: ...

    def min_size(self) -> int: ...

    def max_size(self) -> int: ...

    def target_size(self) -> int: ...

    def increase_size(self, delta: int) -> None: ...

    def decrease_target_size(self, delta: int) -> None:
        """Lower the target by `delta` without removing a node (see the module docstring)."""
        ...

    def delete_nodes(self, names: Sequence[str]) -> None: ...

    def nodes(self) -> list[Node]: ...

    def template(self) -> NodePool:
        """What a new node of this group offers (GPU model, GPUs, CPU, memory, price)."""
        ...


@runtime_checkable
class CloudProvider(Protocol):
    def name(self) -> str: ...

    def node_groups(self) -> list[NodeGroup]: ...

    def node_group_for(self, node_name: str) -> NodeGroup | None: ...

    def refresh(self) -> None:
        """Re-read the cloud's state (called once at the start of every loop iteration)."""
        ...
