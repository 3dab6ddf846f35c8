"""The repartitions (MIG) a defragmentation pass plans, and how people read them.

Pending pods asking `nvidia.com/mig-<profile>` that no free instance serves may be served by
partitioning idle MIG GPUs anew. The cluster's mig-parted configs (`defrag.mig.configs`, as
the GPU operator's MIG manager has them) say which layouts a node can be given, by name
(`scaler.cluster.mig_parted`); `plan_named_repartition` picks, with the budget the moves
left, the configs that serve the most of those pods while clearing only GPUs no pod uses.
A node is left as it is when the MIG manager does not manage it (no `nvidia.com/mig.config`
label), when a change is under way there or its last one failed
(`nvidia.com/mig.config.state`), when a move of this plan leaves or lands there or moves
planned earlier are on their way (their GPU indices are its instances now), and a GPU when
a pod may hold one of its instances: recorded by our bind, or, for a pod bound without the
extender, any instance of its profile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from predictor.telemetry.kube_objects import PodRequest
from scaler.cluster.job import Job
from scaler.cluster.mig_parted import MigConfigs, MigOption, node_options
from scaler.kube.mig_manager import (
    CONFIG_LABEL,
    FAILED,
    STATE_LABEL,
    MigManagedNode,
    gpus_in_use,
)
from scaler.kube.observed import ObservedCluster
from scaler.placement.defrag import DefragPlan
from scaler.placement.policies.base import Policy
from scaler.placement.repartition import NamedRepartitionPlan, plan_named_repartition


@dataclass(frozen=True)
class RepartitionStep:
    """One node given another mig-parted config, as people read it. Layouts name only the
    GPUs that change (`1=3g.40gb@0,3g.40gb@4`)."""

    node: str
    config_before: str  # the config its label names now
    config: str
    gpus: tuple[int, ...]
    layout_before: str
    layout_after: str
    serves: tuple[str, ...]  # the pending pods its new instances take
    frees: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "config_from": self.config_before,
            "config_to": self.config,
            "gpus": list(self.gpus),
            "layout_from": self.layout_before,
            "layout_to": self.layout_after,
            "serves": list(self.serves),
            "frees": self.frees,
            "reason": self.reason,
        }


def plan_mig(
    observed: ObservedCluster,
    policy: Policy,
    configs: MigConfigs,
    plan: DefragPlan,
    mig_nodes: Mapping[str, MigManagedNode],
    max_nodes: int,
) -> NamedRepartitionPlan:
    """The pass's repartitions beside the move `plan`, at most `max_nodes`: the pending MIG
    pods no free instance serves, and the named configs that serve them (see the module
    docstring)."""
    state = observed.state
    assert state is not None  # a plan is made only of a listed cluster
    options: dict[str, list[MigOption]] = {}
    busy: dict[str, dict[int, str]] = {}
    if configs:
        on_node: dict[str, list[PodRequest]] = {}
        for pod in observed.bound_pods.values():
            if pod.mig and pod.node is not None:
                on_node.setdefault(pod.node, []).append(pod)
        for n, layout in state.mig.items():
            name = state.names[n]
            options[name] = node_options(configs, layout, int(state.gpu_count[n]))
            busy[name] = gpus_in_use(layout, on_node.get(name, ()))
    blocked = _blocked(observed, plan, mig_nodes, options)
    mig = plan_named_repartition(
        state, observed.real_pending, policy, options, max_nodes, blocked, busy
    )
    if not configs and mig.unserved:
        why = "repartitioning takes the cluster's mig-parted configs (defrag.mig.configs)"
        unserved = tuple(
            (job, f"no free instance of its profile; {why}") for job, _ in mig.unserved
        )
        mig = replace(mig, unserved=unserved)
    return mig


def _blocked(
    observed: ObservedCluster,
    plan: DefragPlan,
    mig_nodes: Mapping[str, MigManagedNode],
    options: Mapping[str, Sequence[MigOption]],
) -> dict[str, str]:
    """The MIG nodes a repartition must leave as they are, and why."""
    touched = {m.source for m in plan.moves} | {m.target for m in plan.moves}
    blocked: dict[str, str] = {}
    for name in options:
        managed = mig_nodes.get(name)
        if managed is None:
            blocked[name] = (
                f"not managed by the GPU operator's MIG manager (no {CONFIG_LABEL} label)"
            )
        elif managed.under_way:
            blocked[name] = f"a MIG change is under way ({STATE_LABEL}={managed.state})"
        elif managed.state == FAILED:
            blocked[name] = f"its last MIG change failed ({STATE_LABEL}={FAILED})"
        elif name in touched:
            blocked[name] = "a move of this plan leaves or lands there"
        elif observed.moves.get(name):
            blocked[name] = "moves planned earlier are on their way there (onto its instances)"
    return blocked


def repartition_steps(
    mig: NamedRepartitionPlan, pending: Sequence[Job], mig_nodes: Mapping[str, MigManagedNode]
) -> tuple[RepartitionStep, ...]:
    """The plan's repartitions as people read them (each on a node in `mig_nodes`: the
    others are blocked)."""
    jobs = {j.id: j for j in pending}
    steps = []
    for named in mig.changes:
        gpus = tuple(c.gpu for c in named.changes)
        serves = named.serves
        asked = sorted({f"{jobs[j].mig_count} x {jobs[j].mig_profile}" for j in serves})
        before = mig_nodes[named.node].config
        on = ", ".join(map(str, gpus))
        steps.append(
            RepartitionStep(
                node=named.node,
                config_before=before,
                config=named.config,
                gpus=gpus,
                layout_before=";".join(f"{c.gpu}={c.before}" for c in named.changes),
                layout_after=";".join(f"{c.gpu}={c.after}" for c in named.changes),
                serves=serves,
                frees=f"{'; '.join(asked)} for {', '.join(serves)}",
                reason=(
                    f"{len(serves)} pending pod(s) ask {', '.join(asked)} that no free instance"
                    f" serves; GPU(s) {on} of {named.node} run no pod, so the MIG manager may"
                    f" clear them: {before or '(none)'} -> {named.config}"
                ),
            )
        )
    return tuple(steps)
