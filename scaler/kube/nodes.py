"""Taking a node out: cordon, drain through the Eviction API, then the provider deletes it.

`NodeRemoval.remove(node)` runs the three steps in order (`prepare` cordons, `finish`
drains and deletes, so a caller removing several nodes cordons them all before the first
drain, then drains them together with `finish_all`, which skips a node pods arrived on
since the caller checked it) and each is
idempotent, so the flow resumes wherever a crash left it: a node gpuscale cordoned carries
an annotation saying so; a drain lists what is still on the node and evicts it again; a
node whose instance the cloud no longer holds has already been deleted. A node someone
else cordoned is theirs: it is refused untouched, and gpuscale never marks it or uncordons
it, even where their cordon came between gpuscale's read and its write (the cordon is a
patch on the version read).

The drain evicts placeholder pods first (they only hold capacity) and leaves DaemonSet and
mirror pods (they go with the node) and finished pods alone. As Cluster Autoscaler, it
takes no node with a pod it must not evict (`drainability.why_undrainable`, the rules the
plan checked, asked again of the pods on the node now): such a pod stops the drain before
anything is evicted, and the node is reported as blocked. An eviction the API server
refuses with 429 because of a PodDisruptionBudget is retried until the drain's timeout;
then the node stays cordoned and is reported as blocked, naming each blocking pod and its
budget, and the provider is not asked to delete it. Nodes and pods are read as the rest of
gpuscale reads them (`read_node`, `read_pod`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from http import HTTPStatus
from typing import Any

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import (
    KUBE_NAMES,
    KubeNames,
    NodeFacts,
    PodRequest,
    read_node,
    read_pod,
)
from scaler.kube.drainability import (
    CLUSTER_AUTOSCALER_RULES,
    DrainRules,
    system_budgets,
    undrainable,
)
from scaler.kube.errors import API_ERRORS, KubeError, Refusal, kube_call, kube_error
from scaler.kube.evictions import BlockingPod, request_eviction
from scaler.providers.base import CloudProvider, NodeGroup, ProviderError


@dataclass(frozen=True)
class DrainSettings:
    timeout_s: float = 600.0
    poll_s: float = 5.0
    rules: DrainRules = CLUSTER_AUTOSCALER_RULES  # which pods keep their node


OTHERS_CORDON = "cordoned by someone else (unschedulable without gpuscale's marker)"


class RemovalStatus(StrEnum):
    REMOVED = "removed"  # the provider deleted the node (or already had)
    BLOCKED = "blocked"  # cordoned, but pods would not leave before the timeout
    REFUSED = "refused"  # not touched: no group holds it, or its group is at min size
    SKIPPED = "skipped"  # cordoned, then pods arrived that no check found room for


@dataclass(frozen=True, slots=True)
class RemovalOutcome:
    node: str  # the Kubernetes node name
    status: RemovalStatus
    reason: str
    cloud_node: str | None = None  # the provider's name for it (the instance id on AWS)
    blocking: tuple[BlockingPod, ...] = ()

    @property
    def removed(self) -> bool:
        return self.status is RemovalStatus.REMOVED


@dataclass(frozen=True, slots=True)
class _Held:
    cloud_name: str
    group: NodeGroup


@dataclass(frozen=True, slots=True)
class _Draining:
    name: str  # the Kubernetes node name
    cloud_name: str
    deadline: float  # on the removal's clock: pods still there then block the node


def arrived(pods: Iterable[PodRequest], seen: frozenset[str]) -> list[str]:
    """The real pods a drain would evict that are not among `seen` (ids), sorted."""
    return sorted(p.id for p in eviction_order(pods) if not p.placeholder and p.id not in seen)


def eviction_order(pods: Iterable[PodRequest]) -> list[PodRequest]:
    """The pods a drain must move, placeholders first."""
    movable = [p for p in pods if not p.goes_with_node and not p.finished]
    return sorted(movable, key=lambda p: (not p.placeholder, p.namespace, p.name))


class NodeRemoval:
    """Cordon -> drain -> delete through the provider, for a node or a pass's nodes. Nodes and
    pods are read as `read_node` and `read_pod` read them, with `names`' conventions."""

    def __init__(
        self,
        api: k8s.ApiClient,
        provider: CloudProvider,
        settings: DrainSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        names: KubeNames = KUBE_NAMES,
        may_act: Callable[[], None] = lambda: None,
    ) -> None:
        """`may_act` raises to stop a removal under way (a leader that lost its lease):
        it is asked before every round of evictions and right before the delete."""
        self.settings = settings or DrainSettings()
        self._may_act = may_act
        self._api = api
        self._core = k8s.CoreV1Api(api)
        self._provider = provider
        self._clock = clock
        self._sleep = sleep
        self._names = names
        self._marker = names.removal_annotation  # on the nodes gpuscale cordoned to remove

    def remove(self, node_name: str) -> RemovalOutcome:
        """Cordon, drain and delete one node: `prepare`, then `finish`."""
        return self.prepare(node_name) or self.finish(node_name)

    def prepare(self, node_name: str) -> RemovalOutcome | None:
        """Refuse the node (see `_group_of`), or cordon it: None when it is cordoned and
        `finish` may take it on. A pass removing several nodes cordons them all first, so
        what one drain evicts, or a new pod, cannot land on a node about to go."""
        found = self._group_of(node_name)
        if isinstance(found, RemovalOutcome):
            return found
        if not self.cordon(node_name):  # someone cordoned it since it was read
            return RemovalOutcome(node_name, RemovalStatus.REFUSED, OTHERS_CORDON)
        return None

    def finish(self, node_name: str, seen: frozenset[str] | None = None) -> RemovalOutcome:
        """Drain and delete one node `prepare` cordoned (`finish_all` of it alone). Raises
        KubeError or ProviderError when the API server or the provider cannot answer."""
        ((_, outcome),) = self.finish_all([(node_name, seen)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def finish_all(
        self, nodes: Sequence[tuple[str, frozenset[str] | None]]
    ) -> Iterator[tuple[str, RemovalOutcome | KubeError | ProviderError]]:
        """Drain the nodes `prepare` cordoned, all at once, and have the provider delete
        each as soon as it is empty; yields each node with how it ended, in the order they
        end (an API or provider error ends only that node's removal).

        Each node's pods are read again first: a real pod not among its `seen` (the pods
        the scale-down check found room for; None: no check to hold the node to) arrived
        since, and nothing checked that it fits elsewhere, so the node is SKIPPED, still
        cordoned, for the caller to uncordon. The drains then go in rounds: every node
        still draining is listed and its pods evicted, then one `poll_s` wait serves them
        all, so a pass of several nodes whose evictions a budget holds back lasts one
        `timeout_s`, not one per node. The refusals are checked again right before each
        delete: another removal of the pass may have brought the group to its min size."""
        draining: list[_Draining] = []
        for node_name, seen in nodes:
            try:
                started = self._start_drain(node_name, seen)
            except (KubeError, ProviderError) as exc:
                yield node_name, exc
                continue
            if isinstance(started, RemovalOutcome):
                yield node_name, started
            else:
                draining.append(started)
        while draining:
            still: list[_Draining] = []
            for node in draining:
                try:
                    ended = self._drain_round(node)
                except (KubeError, ProviderError) as exc:
                    ended = exc
                if ended is None:
                    still.append(node)
                else:
                    yield node.name, ended
            draining = still
            if draining:
                self._sleep(self.settings.poll_s)

    def _start_drain(
        self, node_name: str, seen: frozenset[str] | None
    ) -> _Draining | RemovalOutcome:
        found = self._group_of(node_name)
        if isinstance(found, RemovalOutcome):
            return found
        if seen is not None and (new := arrived(self._pods_on(node_name), seen)):
            why = "no longer removable: pods arrived since the scale-down check: "
            return RemovalOutcome(
                node_name, RemovalStatus.SKIPPED, why + ", ".join(new), found.cloud_name
            )
        return _Draining(node_name, found.cloud_name, self._clock() + self.settings.timeout_s)

    def _drain_round(self, node: _Draining) -> RemovalOutcome | None:
        """Evict what is still on the node: None while pods are leaving, else how its
        removal ended (deleted once empty; blocked by a pod no drain may take, at once, or
        by pods still there at the timeout)."""
        pods = eviction_order(self._pods_on(node.name))
        if not pods:
            return self._delete(node)
        # Evicting the others first would only disrupt them: the node cannot go anyway.
        budgets = system_budgets(self._api, pods)
        kept = [
            BlockingPod(p.namespace, p.name, why)
            for p, why in undrainable(pods, self.settings.rules, budgets)
        ]
        if kept:
            return self._blocked(node, kept)
        self._may_act()
        blocking = [b for b in map(self._evict, pods) if b is not None]
        if self._clock() < node.deadline:
            return None
        going = {(b.namespace, b.name) for b in blocking}
        return self._blocked(
            node,
            blocking
            + [
                BlockingPod(p.namespace, p.name, "still terminating")
                for p in self._pods_left(node.name, pods)
                if (p.namespace, p.name) not in going
            ],
        )

    def _blocked(self, node: _Draining, blocking: Sequence[BlockingPod]) -> RemovalOutcome:
        names = ", ".join(f"{b.namespace}/{b.name}" for b in blocking)
        return RemovalOutcome(
            node.name,
            RemovalStatus.BLOCKED,
            # Each blocking pod says why: a refused eviction, or no drain may take it.
            f"pods would not leave (drain timeout {self.settings.timeout_s:g} s): {names}",
            node.cloud_name,
            tuple(blocking),
        )

    def _delete(self, node: _Draining) -> RemovalOutcome:
        found = self._group_of(node.name)
        if isinstance(found, RemovalOutcome):
            return found
        self._may_act()
        try:
            found.group.delete_nodes([found.cloud_name])
        except ProviderError as exc:
            return RemovalOutcome(node.name, RemovalStatus.REFUSED, str(exc), found.cloud_name)
        return RemovalOutcome(
            node.name,
            RemovalStatus.REMOVED,
            f"deleted from node group {found.group.id()}",
            found.cloud_name,
        )

    def _group_of(self, node_name: str) -> _Held | RemovalOutcome:
        """The node's group, or the outcome that settles it without one: gone already;
        someone else's cordon; no group holds it; its group at its min size."""
        node = self._read_node(node_name)
        if node is None:
            return RemovalOutcome(node_name, RemovalStatus.REMOVED, "the node is gone")
        cloud_name = node.cloud_name
        ours = self._marker in node.annotations
        if node.unschedulable and not ours:
            return RemovalOutcome(node_name, RemovalStatus.REFUSED, OTHERS_CORDON, cloud_name)
        group = self._provider.node_group_for(cloud_name)
        if group is None:
            if ours:  # a removal that got as far as the provider before a restart
                return RemovalOutcome(
                    node_name, RemovalStatus.REMOVED, "the cloud no longer holds it", cloud_name
                )
            return RemovalOutcome(
                node_name, RemovalStatus.REFUSED, "no node group holds it", cloud_name
            )
        if group.target_size() - 1 < group.min_size():
            return RemovalOutcome(
                node_name,
                RemovalStatus.REFUSED,
                f"node group {group.id()} is at its min size {group.min_size()}",
                cloud_name,
            )
        return _Held(cloud_name, group)

    def cordon(self, node_name: str) -> bool:
        """Mark the node unschedulable, noting that gpuscale did it (once: a cordoned node
        keeps the time its removal started). False, the node untouched, when someone else
        cordoned it: their cordon is theirs to undo, so gpuscale never marks it its own.

        The patch applies only to the node as read (its resourceVersion), so a cordon made
        by someone else between the read and the write is never marked gpuscale's: the API
        server answers 409 and the node is read again, once. Raises KubeError when the
        node changed under both tries."""
        for _ in range(2):  # the first read, and one more after a conflict
            found = self._read_node_json(node_name)
            if found is None:
                raise KubeError(f"cordon {node_name}: no such node")
            node = read_node(found, self._names)
            if node.unschedulable:
                return self._marker in node.annotations
            started = node.annotations.get(self._marker) or datetime.now(UTC).isoformat()
            body = {
                "metadata": {
                    "annotations": {self._marker: started},
                    "resourceVersion": found["metadata"]["resourceVersion"],
                },
                "spec": {"unschedulable": True},
            }
            if self._patch_node(node_name, body, "cordon", expect=(HTTPStatus.CONFLICT,)):
                return True
        raise KubeError(f"cordon {node_name}: the node changed under each try (409 Conflict)")

    def uncordon(self, node_name: str) -> None:
        """Undo a cordon that gpuscale made (one made by someone else is left alone)."""
        node = self._read_node(node_name)
        if node is None or self._marker not in node.annotations:
            return
        body = {
            "metadata": {"annotations": {self._marker: None}},
            "spec": {"unschedulable": None},
        }
        self._patch_node(node_name, body, "uncordon")

    # ---- API calls ---------------------------------------------------------------------
    def _read_node(self, name: str) -> NodeFacts | None:
        found = self._read_node_json(name)
        return None if found is None else read_node(found, self._names)

    def _read_node_json(self, name: str) -> dict[str, Any] | None:
        """The node in its JSON form (resourceVersion included); None when it is gone."""
        found = kube_call(
            f"read node {name}", lambda: self._core.read_node(name), expect=(HTTPStatus.NOT_FOUND,)
        )
        return None if isinstance(found, Refusal) else self._api.sanitize_for_serialization(found)

    def _patch_node(self, name: str, body: dict, what: str, expect: Collection[int] = ()) -> bool:
        """Patch the node; False when the API server answers a status in `expect`."""
        done = kube_call(f"{what} {name}", lambda: self._core.patch_node(name, body), expect=expect)
        return not isinstance(done, Refusal)

    def _pods_on(self, node_name: str) -> list[PodRequest]:
        try:
            found = self._core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node_name}"
            )
        except API_ERRORS as exc:
            raise kube_error(f"list pods on {node_name}", exc) from None
        as_json = self._api.sanitize_for_serialization
        return [read_pod(as_json(p), self._names) for p in found.items]

    def _pods_left(self, node_name: str, pods: list[PodRequest]) -> list[PodRequest]:
        left = {p.id for p in self._pods_on(node_name)}
        return [p for p in pods if p.id in left]

    def _evict(self, pod: PodRequest) -> BlockingPod | None:
        """Ask for one eviction; a BlockingPod when it was refused."""
        if pod.deleting:
            return None  # already going
        return request_eviction(self._api, pod)
