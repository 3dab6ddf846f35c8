"""A defragmentation pass's plan over the listed cluster, as people read it, and what it
frees.

`plan_report` plans with the placement policy the service places with, within what the
window leaves (`move_budget`), moving only pods that may move (`why_unmovable`): labelled
`gpuscale.io/movable=true` or of an allowed priority class, recreated by a controller, not
marked safe-to-evict "false", not a placeholder, not a gang member (`GANG_LABELS`). The
budget the moves leave goes to repartitions (`scaler.controller.repartition_plan`). The
moves of earlier passes whose successors have not landed yet keep their room (`awaited`,
`hold_awaited`). The report says what the plan frees: idle GPUs per node before and after,
and which pending pods and job-mix shapes then fit where they did not. Nothing here reads
or changes the cluster (`scaler.controller.defrag` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from predictor.telemetry.kube_objects import KubeNames, PodRequest
from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.predicates import feasible
from scaler.cluster.snapshot import ClusterState
from scaler.controller.config import DefragSection
from scaler.controller.repartition_plan import RepartitionStep, plan_mig, repartition_steps
from scaler.kube.mig_manager import MigManagedNode
from scaler.kube.moves import PlannedMove, shape_of
from scaler.kube.observed import ObservedCluster
from scaler.placement.defrag import DefragPlan, Goal, Move, apply_plan, plan_defrag
from scaler.placement.policies.base import Policy
from scaler.placement.repartition import RefusedRepartition, apply_repartition

REFUSED = "its eviction was refused (a PodDisruptionBudget)"
# Pod labels that make a pod one member of a gang (distributed training): coscheduling's
# pod group (both spellings), Kueue's plain pod groups, JobSet, LeaderWorkerSet, the
# Kubeflow training operator and Volcano. Evicting one member stops or restarts the whole
# job, and moves are made one pod at a time, so no member is moved.
GANG_LABELS = (
    "scheduling.x-k8s.io/pod-group",
    "pod-group.scheduling.sigs.k8s.io",
    "kueue.x-k8s.io/pod-group-name",
    "jobset.sigs.k8s.io/jobset-name",
    "leaderworkerset.sigs.k8s.io/name",
    "training.kubeflow.org/job-name",
    "volcano.sh/job-name",
)


def why_unmovable(pod: PodRequest, settings: DefragSection, names: KubeNames) -> str | None:
    """Why defragmentation must leave `pod` where it is; None when it may move it."""
    if pod.placeholder:
        return "a gpuscale placeholder"
    if not pod.safe_to_evict:
        return 'annotated safe-to-evict "false"'
    if pod.deleting:
        return "already terminating"
    if pod.controller_uid is None:
        return "no controller would recreate it"
    labels = dict(pod.labels)
    gang = next((f"{k}={labels[k]}" for k in GANG_LABELS if k in labels), None)
    if gang is None and pod.topology is not None:
        gang = "Kueue's podset topology"  # placed with its pod set's other members
    if gang is not None:
        return f"a gang member ({gang}): its members are not moved one at a time"
    labelled = labels.get(names.movable_label) == "true"
    if not labelled and pod.priority_class not in settings.priority_classes:
        return f"not labelled {names.movable_label}=true nor of an allowed priority class"
    return None


def why_changed(
    step: PlannedStep,
    listed: PodRequest,
    now: PodRequest,
    settings: DefragSection,
    names: KubeNames,
) -> str | None:
    """Why `step` must not be carried out, `now` being its pod read again just before the
    eviction and `listed` the pod the plan was made from; None when it still may. The
    plan's listing is minutes old by then (the dry runs, the wait for the service, the
    evictions before): the pod may have been marked safe-to-evict "false", finished, or
    been replaced by another under its name elsewhere (a StatefulSet's pod)."""
    if now.finished:
        return f"{now.phase} since the listing"
    if now.node != step.source:
        return f"now on {now.node or 'no node'}, not {step.source}"
    if now.controller_uid != listed.controller_uid:
        return f"another pod of that name now (of {now.controller or 'no controller'})"
    asked = (now.gpus, now.gpu_milli, now.cpu_milli, now.memory_mib, now.mig)
    if asked != (listed.gpus, listed.gpu_milli, listed.cpu_milli, listed.memory_mib, listed.mig):
        return "it asks for other resources now than the plan placed"
    return why_unmovable(now, settings, names)


def awaited(observed: ObservedCluster, now: float) -> list[tuple[str, PlannedMove]]:
    """The live moves noted by earlier passes whose successor has not landed yet (target
    node, move): no pod on the target that the move matches holds its GPUs. A successor
    bound without its GPUs recorded is not recognised, so its room stays held until the
    note expires: too much held, never too little."""
    state = observed.state
    if state is None:
        return []
    waiting = []
    for node, moves in sorted(observed.moves.items()):
        if node not in state.names:
            continue
        on_node = [state.jobs[j] for j in state.node_jobs[state.node_index(node)]]
        for move in moves:
            landed = any(
                a.gpus == move.gpus
                and a.job.id in observed.bound_pods
                and move.matches(observed.bound_pods[a.job.id], a.job)
                for a in on_node
            )
            if move.live(now) and not landed:
                waiting.append((node, move))
    return waiting


def hold_awaited(state: ClusterState, moves: Sequence[tuple[str, PlannedMove]]) -> ClusterState:
    """`state` with a stand-in bound where each awaited move's successor is to land: the
    plan neither moves another pod onto those GPUs nor empties that node (a stand-in never
    moves), which the successor would fill again. A stand-in that no longer fits (the
    noted GPUs taken since) is left out: that room is gone anyway."""
    held = state.copy()
    for node, move in moves:
        cpu, memory, num_gpu, gpu_milli = move.shape
        gpus = move.gpus if len(move.gpus) == num_gpu else ()  # a MIG move: instances
        stand_in = Job(f"awaited {move.id}", cpu, memory, len(gpus), gpu_milli if gpus else 0)
        with contextlib.suppress(ValueError):
            held.bind(stand_in, held.node_index(node), gpus)
    return held


def move_budget(max_moves: int, made_in_window: int) -> int:
    """The moves and repartitions a pass may still make in the window."""
    return max(max_moves - made_in_window, 0)


@dataclass(frozen=True)
class PlannedStep:
    """One move of the plan, as people read it."""

    job: str
    controller: str
    source: str
    target: str
    target_gpus: tuple[int, ...]
    unit: str  # what its group of moves empties: "node n3" or "GPU 2 of n3"
    frees: str  # "" unless this move completes its unit
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "controller": self.controller,
            "from": self.source,
            "to": self.target,
            "gpus": list(self.target_gpus),
            "unit": self.unit,
            "frees": self.frees,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class NodeGain:
    node: str
    idle_gpus_before: int
    idle_gpus_after: int
    free_share_before: int  # free thousandths on partly used GPUs
    free_share_after: int


@dataclass(frozen=True)
class ShapeGain:
    """One shape: how many nodes can take one such job before and after the plan."""

    label: str  # "pending ml/train (4 GPUs)" or "mix: 8 GPUs, 64 CPU, 256 GiB"
    nodes_before: int
    nodes_after: int


@dataclass(frozen=True)
class DefragReport:
    goal: Goal
    max_moves: int
    window_s: float
    made_in_window: int
    policy: str
    unmovable: Mapping[str, int]  # why not -> how many bound jobs
    plan: DefragPlan
    steps: tuple[PlannedStep, ...] = ()
    nodes: tuple[NodeGain, ...] = ()  # the nodes whose idle GPUs or free shares change
    shapes: tuple[ShapeGain, ...] = ()
    idle_gpus_before: int = 0  # in the whole cluster
    idle_gpus_after: int = 0
    idle_nodes_before: int = 0  # GPU nodes with every GPU idle
    idle_nodes_after: int = 0
    largest_idle_before: int = 0  # the most idle GPUs on one node
    largest_idle_after: int = 0
    repartitions: tuple[RepartitionStep, ...] = ()
    mig_unserved: tuple[tuple[str, str], ...] = ()  # pending MIG pod, why nothing serves it
    mig_refused: tuple[RefusedRepartition, ...] = ()  # would serve pods, refused: why

    @property
    def budget(self) -> int:
        return move_budget(self.max_moves, self.made_in_window)

    def to_dict(self) -> dict[str, Any]:
        return {
            "goal": self.goal,
            "policy": self.policy,
            "max_moves": self.max_moves,
            "window_s": self.window_s,
            "made_in_window": self.made_in_window,
            "budget": self.budget,
            "moves": [s.to_dict() for s in self.steps],
            "freed_nodes": list(self.plan.freed_nodes),
            "freed_gpus": [f"GPU {g} of {n}" for n, g in self.plan.freed_gpus],
            "nodes": [vars(n) for n in self.nodes],
            "shapes": [vars(s) for s in self.shapes],
            "unmovable": dict(self.unmovable),
            "idle_gpus": {"before": self.idle_gpus_before, "after": self.idle_gpus_after},
            "idle_nodes": {"before": self.idle_nodes_before, "after": self.idle_nodes_after},
            "largest_idle": {
                "before": self.largest_idle_before,
                "after": self.largest_idle_after,
            },
            "repartitions": [r.to_dict() for r in self.repartitions],
            "mig_unserved": [{"pod": pod, "why": why} for pod, why in self.mig_unserved],
            "mig_refused": [
                {
                    "node": r.node,
                    "config": r.config,
                    "why": r.why,
                    "would_serve": list(r.would_serve),
                }
                for r in self.mig_refused
            ],
        }


def units(moves: Sequence[Move]) -> list[list[int]]:
    """The plan's moves (indices) grouped by the node or GPU they empty together: each
    group ends with the move whose `frees` names it."""
    groups: list[list[int]] = [[]]
    for i, move in enumerate(moves):
        groups[-1].append(i)
        if move.frees:
            groups.append([])
    return [g for g in groups if g]


def without_units(plan: DefragPlan, stopped: Collection[int]) -> DefragPlan:
    """`plan` less its units (`units`) that have a move in `stopped` (indices): the plan
    carried out when those are not started. The moves left still fit in order: a unit's
    moves only take room, and what they leave is a freed node or GPU, never a target."""
    groups = units(plan.moves)
    kept = [k for k, group in enumerate(groups) if not any(i in stopped for i in group)]
    # plan_defrag frees one node (goal nodes) or one GPU (goal gpus) a unit, in unit order.
    nodes, gpus = (kept, []) if plan.goal == "nodes" else ([], kept)
    return DefragPlan(
        plan.goal,
        tuple(plan.moves[i] for k in kept for i in groups[k]),
        tuple(plan.freed_nodes[k] for k in nodes),
        tuple(plan.freed_gpus[k] for k in gpus),
    )


def plan_report(
    observed: ObservedCluster,
    policy: Policy,
    settings: DefragSection,
    names: KubeNames,
    mix: Sequence[Job] = (),
    made_in_window: int = 0,
    refused: Collection[str] = (),
    mig_nodes: Mapping[str, MigManagedNode] | None = None,
    now: float = 0.0,
    moves: DefragPlan | None = None,
) -> DefragReport:
    """The plan for `observed` within the window's budget, and what it frees. `refused`:
    the pods (job ids) whose eviction was refused in a dry run, left in place;
    `mig_nodes`: the nodes the MIG manager manages, as their labels say; `now` (Unix
    time) says which moves of earlier passes are still awaited (`awaited`): their room is
    held; `moves`: the moves to make, planned already (`without_units`), in place of a
    new plan of them (the repartitions are planned with what they leave)."""
    state = observed.state
    if state is not None:
        state = hold_awaited(state, awaited(observed, now))
    mig_nodes = mig_nodes or {}
    unmovable: dict[str, int] = {}
    allowed: set[str] = set()
    for job_id, pod in observed.bound_pods.items():
        why = REFUSED if job_id in refused else why_unmovable(pod, settings, names)
        if why is None:
            allowed.add(job_id)
        else:
            unmovable[why] = unmovable.get(why, 0) + 1
    report = partial(
        DefragReport,
        settings.goal, settings.max_moves, settings.window_s, made_in_window, policy.name,
        unmovable,
    )  # fmt: skip
    if state is None:
        return report(DefragPlan(settings.goal, (), (), ()))
    budget = move_budget(settings.max_moves, made_in_window)
    plan = (
        plan_defrag(state, policy, settings.goal, budget, lambda job: job.id in allowed)
        if moves is None
        else moves
    )
    # plan_defrag keeps within the budget: what it leaves goes to repartitions.
    mig = plan_mig(
        observed, policy, settings.mig.configs, plan, mig_nodes, budget - len(plan.moves)
    )
    after = state.copy()
    apply_plan(after, plan)
    apply_repartition(after, mig.by_gpu())  # on nodes no move touches (plan_mig blocks them)
    return report(
        plan,
        steps=_steps(plan, observed.bound_pods, policy.name),
        nodes=_node_gains(state, after),
        shapes=_shape_gains(state, after, observed.real_pending, mix),
        **_idle("before", state),
        **_idle("after", after),
        repartitions=repartition_steps(mig, observed.real_pending, mig_nodes),
        mig_unserved=mig.unserved,
        mig_refused=mig.refused,
    )


def _steps(
    plan: DefragPlan, pods: Mapping[str, PodRequest], policy: str
) -> tuple[PlannedStep, ...]:
    if plan.goal == "gpus":
        where = "target: the fullest other partly used GPU that holds it"
    else:
        where = f"target: the {policy} policy's choice among the nodes in use that hold it"
    steps: list[PlannedStep] = []
    for group in units(plan.moves):
        unit = plan.moves[group[-1]].frees
        for k, i in enumerate(group, start=1):
            move = plan.moves[i]
            pod = pods.get(move.job_id)
            steps.append(
                PlannedStep(
                    job=move.job_id,
                    controller=(pod.controller if pod else None) or "",
                    source=move.source,
                    target=move.target,
                    target_gpus=move.target_gpus,
                    unit=unit,
                    frees=move.frees,
                    reason=f"{k} of the {len(group)} jobs on {unit}: all move, so it empties;"
                    f" {where}",
                )
            )
    return tuple(steps)


def _idle_gpus(state: ClusterState) -> np.ndarray:
    """Per node, its GPUs with nothing on them."""
    return (state.gpu_free == WHOLE_GPU_MILLI).sum(axis=1)


def _idle(when: str, state: ClusterState) -> dict[str, int]:
    idle = _idle_gpus(state)
    gpu_nodes = state.gpu_count > 0
    return {
        f"idle_gpus_{when}": int(idle.sum()),
        f"idle_nodes_{when}": int(((idle == state.gpu_count) & gpu_nodes).sum()),
        f"largest_idle_{when}": int(idle.max(initial=0)),
    }


def _free_share(state: ClusterState) -> np.ndarray:
    """Per node, the free thousandths on its partly used GPUs."""
    partly = (state.gpu_free > 0) & (state.gpu_free < WHOLE_GPU_MILLI)
    return np.where(partly, state.gpu_free, 0).sum(axis=1)


def _node_gains(before: ClusterState, after: ClusterState) -> tuple[NodeGain, ...]:
    idle_b, idle_a = _idle_gpus(before), _idle_gpus(after)
    share_b, share_a = _free_share(before), _free_share(after)
    changed = np.flatnonzero((idle_b != idle_a) | (share_b != share_a))
    return tuple(
        NodeGain(before.names[n], int(idle_b[n]), int(idle_a[n]), int(share_b[n]), int(share_a[n]))
        for n in changed
    )


def _shape_label(job: Job) -> str:
    if job.mig_profile is not None:
        gpus = f"{job.mig_count} x MIG {job.mig_profile}"
    elif job.num_gpu == 0:
        gpus = "no GPU"
    elif job.is_sharing:
        gpus = f"{job.gpu_milli / WHOLE_GPU_MILLI:g} of a GPU"
    else:
        gpus = f"{job.num_gpu} GPU{'s' if job.num_gpu > 1 else ''}"
    models = f" {'/'.join(sorted(job.gpu_models))}" if job.gpu_models else ""
    return f"{gpus}{models}, {job.cpu_milli / 1000:g} CPU, {job.memory_mib / 1024:g} GiB"


def _shape_gains(
    before: ClusterState, after: ClusterState, pending: Sequence[Job], mix: Sequence[Job]
) -> tuple[ShapeGain, ...]:
    """Pending pods first, then the distinct job-mix shapes: nodes that can take one."""

    def gain(label: str, job: Job) -> ShapeGain:
        return ShapeGain(label, int(feasible(before, job).sum()), int(feasible(after, job).sum()))

    gains = [
        gain(f"pending {job.id} ({_shape_label(job)})", job)
        for job in pending
        if job.problem() is None
    ]
    seen: set[tuple[Any, ...]] = set()
    for job in mix:
        key = (*shape_of(job), job.gpu_models)
        if key not in seen:
            seen.add(key)
            gains.append(gain(f"mix: {_shape_label(job)}", job))
    return tuple(gains)
