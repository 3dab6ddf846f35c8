"""A defragmentation pass's repartitions carried out by the GPU operator's MIG manager
(`scaler.kube.mig_manager`).

Each planned repartition is counted in the window and journaled pending, the node's pods
are listed again and the change asked only if its GPUs are still idle (the config label
set, the state `pending`); the pass then waits up to `defrag.mig.wait_s` for `success`
(gpuscale's layout annotation, where the node has one, is rewritten) or `failed`. A change
still under way is left pending in the journal and settled by a later pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KubeNames
from scaler.controller.defrag_journal import REPARTITION, MoveWindow, pool_of
from scaler.controller.journal import Action, ActionStatus, DecisionJournal
from scaler.controller.repartition_plan import RepartitionStep
from scaler.kube.errors import KubeError
from scaler.kube.mig_manager import (
    CONFIG_LABEL,
    FAILED,
    STATE_LABEL,
    SUCCESS,
    MigManagedNode,
    MigManagerSettings,
    gpus_in_use,
    layout_annotation,
    managed_nodes,
    node_pods,
    read_managed,
    request_config,
    write_layout,
)
from scaler.kube.observed import ObservedCluster


@dataclass(frozen=True)
class RepartitionResult:
    step: RepartitionStep
    # done (the MIG manager applied it), requested (still under way when the pass stopped
    # waiting), blocked (a pod holds one of its GPUs now: not asked), superseded, failed
    status: str
    result: str
    asked: bool = True  # the MIG manager was asked: it holds its place in the window

    def to_dict(self) -> dict[str, Any]:
        return self.step.to_dict() | {
            "status": self.status,
            "result": self.result,
            "asked": self.asked,
        }


class Repartitioner:
    """Asks the MIG manager for a pass's repartitions and follows them (see the module
    docstring)."""

    def __init__(
        self,
        api: k8s.ApiClient,
        journal: DecisionJournal,
        names: KubeNames,
        window: MoveWindow,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        self.api = api
        self.journal = journal
        self.names = names
        self.window = window
        self.clock = clock
        self.sleep = sleep

    def mig_nodes(
        self, observed: ObservedCluster, settings: MigManagerSettings
    ) -> dict[str, MigManagedNode]:
        """The MIG manager's nodes, read only where a repartition could be planned."""
        if not settings.configs or observed.state is None or not observed.state.mig:
            return {}
        return managed_nodes(self.api, self.names)

    def carry_out(
        self,
        decision_id: int,
        observed: ObservedCluster,
        steps: Sequence[RepartitionStep],
        settings: MigManagerSettings,
    ) -> Iterator[RepartitionResult]:
        """Ask the MIG manager for `steps` whose GPUs are still idle, then wait for its
        answers. Each result is yielded as soon as it is known, so the pass has recorded it
        before the next request can fail."""
        asked: list[tuple[RepartitionStep, int]] = []
        for step in steps:
            at = self.clock()
            self.window.count(at)
            action = self.journal.begin(
                decision_id, pool_of(observed, step.node), REPARTITION, step.node, step.to_dict()
            )
            refusal = self._request(observed, step)
            if refusal is None:
                asked.append((step, action))
                continue
            status, why = refusal
            self.window.uncount(at)
            self.journal.complete(action, status, why)
            yield RepartitionResult(step, status, why, asked=False)
        yield from self._await(asked, settings)

    def settle(self, pending: Iterable[Action]) -> list[dict[str, Any]]:
        """The repartitions an earlier pass asked, as the MIG manager reports them now
        (still under way, or its node not read: left pending)."""
        settled = []
        for action in (a for a in pending if a.kind == REPARTITION):
            try:
                node = read_managed(self.api, action.target, self.names)
            except KubeError:
                continue  # read again by the next pass
            concluded = self._conclude(action.params["config_to"], action.params["layout_to"], node)
            if concluded is not None:
                status, why = concluded
                self.journal.complete(action.id, status, why)
                settled.append({"node": action.target, "status": status, "result": why})
        return settled

    def _request(
        self, observed: ObservedCluster, step: RepartitionStep
    ) -> tuple[ActionStatus, str] | None:
        """Ask for `step` unless a pod holds one of its GPUs now (the node's pods listed
        again); why it was not asked (status, why), None once it was."""
        state = observed.state
        assert state is not None  # a repartition is planned only on a listed node
        layout = state.mig[state.node_index(step.node)]
        try:
            in_use = gpus_in_use(layout, node_pods(self.api, step.node, self.names))
            hit = next((in_use[g] for g in step.gpus if g in in_use), None)
            if hit is not None:
                return "blocked", f"not asked: {hit} (the node's pods listed again just before)"
            request_config(self.api, step.node, step.config)
        except KubeError as exc:
            return "failed", str(exc)
        return None

    def _await(
        self, asked: Sequence[tuple[RepartitionStep, int]], settings: MigManagerSettings
    ) -> Iterator[RepartitionResult]:
        """Read the asked nodes' state until each is settled or `wait_s` ends."""
        deadline = self.clock() + settings.wait_s
        waiting = list(asked)
        seen: dict[str, str] = {}
        while waiting:
            still = []
            for step, action in waiting:
                try:
                    node = read_managed(self.api, step.node, self.names)
                except KubeError as exc:
                    seen[step.node] = str(exc)
                    still.append((step, action))
                    continue
                seen[step.node] = f"{STATE_LABEL}={node.state or '(none)'}"
                concluded = self._conclude(step.config, step.layout_after, node)
                if concluded is None:
                    still.append((step, action))
                    continue
                status, why = concluded
                self.journal.complete(action, status, why)
                yield RepartitionResult(step, status, why)
            waiting = still
            if not waiting or self.clock() >= deadline:
                break
            self.sleep(settings.poll_s)
        for step, _ in waiting:  # journaled pending: a later pass settles them
            why = (
                f"asked; after {settings.wait_s:g} s the node shows {seen.get(step.node)}:"
                " a later pass settles it"
            )
            yield RepartitionResult(step, "requested", why)

    def _conclude(
        self, config: str, layout_after: str, node: MigManagedNode
    ) -> tuple[ActionStatus, str] | None:
        """How a repartition to `config` stands on `node` (status, why); None while the MIG
        manager is still at it. On success the layout annotation, if any, follows."""
        if node.config != config:
            return "superseded", f"the node's {CONFIG_LABEL} is {node.config or '(none)'} now"
        if node.state == FAILED:
            return "failed", (
                f"the MIG manager failed to apply {config} on {node.name} ({STATE_LABEL}="
                f"{FAILED}; its log says why): the node is left out of later plans until fixed"
            )
        if node.state != SUCCESS:
            return None
        why = f"the MIG manager applied {config}: {layout_after}"
        if node.layout_annotation is not None:
            try:
                text = layout_annotation(node.layout_annotation, layout_after)
                if text != node.layout_annotation:
                    write_layout(self.api, node.name, text, self.names)
            except (KubeError, ValueError) as exc:
                why += f" (its layout annotation is not rewritten: {exc})"
        return "done", why
