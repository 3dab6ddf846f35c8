"""Defragmentation that runs: the bounded move plan over the live cluster and, with
`apply`, the moves carried out through the Eviction API.

One pass (`Defragmenter.run`):

1. Moves a killed run left pending in the journal are settled (the pod is gone: done;
   else superseded).
2. The cluster is listed once (`observe_cluster`, as the live loop lists it).
3. The moves made in the last `window_s` (kept in the journal's state, in the state
   directory) leave `max_moves - made` for this pass; never more, however often it runs.
4. `plan_defrag` plans with the placement policy the service places with, moving only
   pods that may move (`why_unmovable`): labelled `gpuscale.io/movable=true` or of an
   allowed priority class, recreated by a controller, not marked safe-to-evict "false",
   not a placeholder. The report says what each move frees: idle GPUs per node before and
   after, and which pending pods and job-mix shapes then fit where they did not.
5. With `apply`, every eviction is first asked as a dry run (`dryRun=All`: the API
   server checks the PodDisruptionBudgets and changes nothing). A unit (the node or GPU a
   group of moves empties) with a move a budget refuses is not started, since moving the
   rest would disrupt pods without freeing anything: the refused move is reported blocked
   with the API server's reason and its budget, and the plan is made again with that pod
   left in place (up to `REPLANS` times), so the move budget goes to units that can go.
   The moves of the units that go are noted on their target nodes (`scaler.kube.moves`),
   the pass waits one `placement.sync_s` so the service has listed them, then evicts in
   plan order. Each eviction is journaled pending before it is asked and counted in the window
   before it is asked, so a run killed in between never exceeds the window. An eviction
   refused after all (a budget that changed since the dry run) ends its unit there; the
   moves not carried out are taken off their target nodes.

The evicted pods' successors are steered by the extender (`scaler.service.steering`).

Repartitions (MIG): pending pods asking `nvidia.com/mig-<profile>` that no free instance
serves may be served by partitioning idle MIG GPUs anew. The cluster's mig-parted configs
(`defrag.mig.configs`, as the GPU operator's MIG manager has them) say which layouts a
node can be given, by name (`scaler.cluster.mig_parted`); `plan_named_repartition` picks,
with the budget the moves left, the configs that serve the most of those pods while
clearing only GPUs no pod uses. A node is left as it is when the MIG manager does not
manage it (no `nvidia.com/mig.config` label), when a change is under way there or its last
one failed (`nvidia.com/mig.config.state`), when a move of this plan leaves or lands there
or moves planned earlier are on their way (their GPU indices are its instances now), and a
GPU when a pod may hold one of its instances: recorded by our bind, or, for a pod bound
without the extender, any instance of its profile. With `apply`, each repartition is
counted in the window and journaled pending, the node's pods are listed again and the
change asked only if its GPUs are still idle (`scaler.kube.mig_manager`: the config label
set, the state `pending`); the pass then waits up to `defrag.mig.wait_s` for `success`
(gpuscale's layout annotation, where the node has one, is rewritten) or `failed`; a change
still under way is settled by a later pass.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KubeNames, PodRequest
from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.mig_parted import MigOption, node_options
from scaler.cluster.predicates import feasible
from scaler.cluster.snapshot import ClusterState
from scaler.controller.config import DefragSection, LiveConfig, kube_names, mix_jobs, workload_mix
from scaler.controller.journal import ActionStatus, DecisionJournal
from scaler.kube.errors import KubeError
from scaler.kube.evictions import request_eviction
from scaler.kube.mig_manager import (
    CONFIG_LABEL,
    FAILED,
    STATE_LABEL,
    SUCCESS,
    MigManagedNode,
    gpus_in_use,
    layout_annotation,
    managed_nodes,
    node_pods,
    read_managed,
    request_config,
    write_layout,
)
from scaler.kube.moves import PlannedMove, set_moves, shape_of
from scaler.kube.observed import ObserveCluster, ObservedCluster, observe_cluster
from scaler.placement import make_policy
from scaler.placement.defrag import DefragPlan, Goal, Move, apply_plan, plan_defrag
from scaler.placement.policies.base import Policy
from scaler.placement.repartition import (
    NamedRepartitionPlan,
    RefusedRepartition,
    apply_repartition,
    plan_named_repartition,
)

WINDOW_KEY = "defrag_window"  # journal state: Unix times of the evictions, repartitions asked
ACTION = "defrag_move"
REPARTITION = "defrag_repartition"  # journal: a node given another mig-parted config
REPLANS = 3  # plans made again around pods whose eviction a dry run refused
REFUSED = "its eviction was refused (a PodDisruptionBudget)"


# ---- which pods may move ------------------------------------------------------------------
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
    labelled = dict(pod.labels).get(names.movable_label) == "true"
    if not labelled and pod.priority_class not in settings.priority_classes:
        return f"not labelled {names.movable_label}=true nor of an allowed priority class"
    return None


# ---- the plan and what it frees (pure) ---------------------------------------------------
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
    plan: DefragPlan
    steps: tuple[PlannedStep, ...]
    nodes: tuple[NodeGain, ...]  # the nodes whose idle GPUs or free shares change
    shapes: tuple[ShapeGain, ...]
    unmovable: Mapping[str, int]  # why not -> how many bound jobs
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
        return max(self.max_moves - self.made_in_window, 0)

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


def plan_report(
    observed: ObservedCluster,
    policy: Policy,
    settings: DefragSection,
    names: KubeNames,
    mix: Sequence[Job] = (),
    made_in_window: int = 0,
    refused: Mapping[str, str] | None = None,
    mig_nodes: Mapping[str, MigManagedNode] | None = None,
) -> DefragReport:
    """The plan for `observed` within the window's budget, and what it frees. `refused`:
    pods whose eviction was refused in a dry run (job id -> why), left in place;
    `mig_nodes`: the nodes the MIG manager manages, as their labels say."""
    state = observed.state
    refused = refused or {}
    unmovable: dict[str, int] = {}
    allowed: set[str] = set()
    for job_id, pod in observed.bound_pods.items():
        why = REFUSED if job_id in refused else why_unmovable(pod, settings, names)
        if why is None:
            allowed.add(job_id)
        else:
            unmovable[why] = unmovable.get(why, 0) + 1
    budget = max(settings.max_moves - made_in_window, 0)
    if state is None:
        plan = DefragPlan(settings.goal, (), (), ())
        return DefragReport(
            settings.goal, settings.max_moves, settings.window_s, made_in_window,
            policy.name, plan, (), (), (), unmovable,
        )  # fmt: skip
    plan = plan_defrag(state, policy, settings.goal, budget, lambda job: job.id in allowed)
    after = state.copy()
    apply_plan(after, plan)
    steps = _steps(state, plan, observed.bound_pods, policy.name)
    mig = _plan_mig(observed, policy, settings, plan, mig_nodes or {}, budget - len(plan.moves))
    apply_repartition(after, mig.by_gpu())  # on nodes no move touches: see _blocked
    return DefragReport(
        goal=settings.goal,
        max_moves=settings.max_moves,
        window_s=settings.window_s,
        made_in_window=made_in_window,
        policy=policy.name,
        plan=plan,
        steps=steps,
        nodes=_node_gains(state, after),
        shapes=_shape_gains(state, after, observed.real_pending, mix),
        unmovable=unmovable,
        **_idle("before", state),
        **_idle("after", after),
        repartitions=_repartition_steps(mig, observed.real_pending, mig_nodes or {}),
        mig_unserved=mig.unserved,
        mig_refused=mig.refused,
    )


def _plan_mig(
    observed: ObservedCluster,
    policy: Policy,
    settings: DefragSection,
    plan: DefragPlan,
    mig_nodes: Mapping[str, MigManagedNode],
    budget: int,
) -> NamedRepartitionPlan:
    """The repartitions of the pass: the pending MIG pods no free instance serves, and
    the named configs that serve them (see the module docstring)."""
    state = observed.state
    assert state is not None
    configs = settings.mig.configs
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
        state, observed.real_pending, policy, options, max(budget, 0), blocked, busy
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


def _repartition_steps(
    mig: NamedRepartitionPlan, pending: Sequence[Job], mig_nodes: Mapping[str, MigManagedNode]
) -> tuple[RepartitionStep, ...]:
    jobs = {j.id: j for j in pending}
    steps = []
    for named in mig.changes:
        gpus = tuple(c.gpu for c in named.changes)
        serves = named.serves
        asked = sorted({f"{jobs[j].mig_count} x {jobs[j].mig_profile}" for j in serves})
        before = mig_nodes[named.node].config if named.node in mig_nodes else ""
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


def _steps(
    state: ClusterState, plan: DefragPlan, pods: Mapping[str, PodRequest], policy: str
) -> tuple[PlannedStep, ...]:
    steps: list[PlannedStep] = []
    for group in units(plan.moves):
        unit = plan.moves[group[-1]].frees
        if plan.goal == "gpus":
            where = "target: the fullest other partly used GPU that holds it"
        else:
            where = f"target: the {policy} policy's choice among the nodes in use that hold it"
        for k, i in enumerate(group, start=1):
            move = plan.moves[i]
            why = f"{k} of the {len(group)} jobs on {unit}: all move, so it empties; {where}"
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
                    reason=why,
                )
            )
    return tuple(steps)


def _idle(when: str, state: ClusterState) -> dict[str, int]:
    idle = (state.gpu_free == WHOLE_GPU_MILLI).sum(axis=1)
    gpu_nodes = state.gpu_count > 0
    return {
        f"idle_gpus_{when}": int(idle.sum()),
        f"idle_nodes_{when}": int(((idle == state.gpu_count) & gpu_nodes).sum()),
        f"largest_idle_{when}": int(idle.max(initial=0)),
    }


def _node_gains(before: ClusterState, after: ClusterState) -> tuple[NodeGain, ...]:
    def idle(state: ClusterState) -> np.ndarray:
        return (state.gpu_free == WHOLE_GPU_MILLI).sum(axis=1)

    def share(state: ClusterState) -> np.ndarray:
        partly = (state.gpu_free > 0) & (state.gpu_free < WHOLE_GPU_MILLI)
        return np.where(partly, state.gpu_free, 0).sum(axis=1)

    idle_b, idle_a, share_b, share_a = idle(before), idle(after), share(before), share(after)
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
    gains = [
        ShapeGain(
            f"pending {job.id} ({_shape_label(job)})",
            int(feasible(before, job).sum()),
            int(feasible(after, job).sum()),
        )
        for job in pending
        if job.problem() is None
    ]
    seen: set[tuple[Any, ...]] = set()
    for job in mix:
        key = (*shape_of(job), job.gpu_models)
        if key in seen:
            continue
        seen.add(key)
        gains.append(
            ShapeGain(
                f"mix: {_shape_label(job)}",
                int(feasible(before, job).sum()),
                int(feasible(after, job).sum()),
            )
        )
    return tuple(gains)


# ---- carrying it out -----------------------------------------------------------------------
@dataclass(frozen=True)
class MoveResult:
    step: PlannedStep
    status: str  # done, blocked (a budget refused it), skipped (its unit could not go), failed
    result: str

    def to_dict(self) -> dict[str, Any]:
        return self.step.to_dict() | {"status": self.status, "result": self.result}


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


@dataclass
class DefragOutcome:
    report: DefragReport
    applied: bool
    decision_id: int
    results: list[MoveResult] = field(default_factory=list)
    repartitions: list[RepartitionResult] = field(default_factory=list)
    settled: list[dict[str, Any]] = field(default_factory=list)  # from a killed run
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision_id": self.decision_id,
            "applied": self.applied,
            "plan": self.report.to_dict(),
            "results": [r.to_dict() for r in self.results],
            "repartitions": [r.to_dict() for r in self.repartitions],
            "settled": self.settled,
            "errors": self.errors,
        }

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    def window_used(self) -> int:
        """What this pass added to the window: the evictions made and the repartitions
        asked (a change under way holds its place in the window too)."""
        return self.count("done") + sum(r.asked for r in self.repartitions)


class Defragmenter:
    """One pass at a time (see the module docstring); `run(apply=False)` changes nothing in
    the cluster (it records its decision in the journal, as a dry run of the loop does)."""

    def __init__(
        self,
        config: LiveConfig,
        api: k8s.ApiClient,
        journal: DecisionJournal,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        observe: ObserveCluster = observe_cluster,
    ) -> None:
        self.config = config
        self.api = api
        self.journal = journal
        self.names = kube_names(config.kubernetes)
        placement = config.placement
        self.policy = make_policy(
            placement.policy, mix=workload_mix(placement.mix), seed=placement.seed
        )
        self.mix = mix_jobs(placement.mix)
        self.clock = clock
        self.sleep = sleep
        self.observe = observe
        self.identity = f"defrag@{socket.gethostname()}"

    def run(self, apply: bool, settings: DefragSection | None = None) -> DefragOutcome:
        """Plan and, with `apply`, move. Raises KubeError when the cluster cannot be read."""
        settings = settings or self.config.defrag
        settled = self._settle() if apply else []
        observed = self.observe(self.api, self.names)
        mig_nodes = self._mig_nodes(observed, settings)
        now = self.clock()
        made = len(self._window(now, settings.window_s))
        refused: dict[str, tuple[PlannedStep, str]] = {}  # job -> its refused step, why
        for attempt in range(REPLANS + 1):
            reasons = {job: why for job, (_, why) in refused.items()}
            report = plan_report(
                observed, self.policy, settings, self.names, self.mix, made, reasons, mig_nodes
            )
            asked = self._ask(report, observed) if apply else {}
            if not asked or attempt == REPLANS:
                break
            # Plan again without them: the move budget goes to units that can go.
            refused |= {report.steps[i].job: (report.steps[i], why) for i, why in asked.items()}
        inputs = {
            "goal": settings.goal,
            "nodes": len(observed.nodes),
            "pending": len(observed.real_pending),
            "made_in_window": made,
            "mig_managed_nodes": len(mig_nodes),
        }
        decision_id = self.journal.record(self.identity, apply, inputs, report.to_dict())
        outcome = DefragOutcome(report, apply, decision_id, settled=settled)
        if not apply:
            self.journal.finish(decision_id, {"dry_run": True})
            return outcome
        try:
            for step, why in refused.values():
                outcome.results.append(self._journal_refusal(decision_id, step, why, observed))
            self._apply(observed, report, asked, settings, outcome)
            self._repartition(observed, report, settings, outcome)
        finally:
            self.journal.finish(decision_id, outcome.to_dict() | {"plan": None})
        return outcome

    # ---- acting ---------------------------------------------------------------------------
    def _ask(self, report: DefragReport, observed: ObservedCluster) -> dict[int, str]:
        """Ask every move's eviction as a dry run, unit by unit; the first move of each
        unit that would be refused (step index -> why)."""
        refused: dict[int, str] = {}
        for group in units(report.plan.moves):
            for i in group:
                pod = observed.bound_pods[report.steps[i].job]
                blocked = request_eviction(self.api, pod, dry_run=True)
                if blocked is not None:
                    refused[i] = _refusal_text(blocked.reason, blocked.budget)
                    break
        return refused

    def _apply(
        self,
        observed: ObservedCluster,
        report: DefragReport,
        refused: Mapping[int, str],
        settings: DefragSection,
        outcome: DefragOutcome,
    ) -> None:
        """Carry out the plan's units that no dry run refused (`refused`: step -> why)."""
        steps = report.steps
        pods = observed.bound_pods
        going: list[list[int]] = []
        for group in units(report.plan.moves):
            refusal = next(((i, refused[i]) for i in group if i in refused), None)
            if refusal is None:
                going.append(group)
            else:  # a unit one of whose moves would be refused is not started
                outcome.results.extend(_refused(steps, group, *refusal))
        now = self.clock()
        jobs = {} if observed.state is None else observed.state.jobs
        planned: dict[int, tuple[str, PlannedMove]] = {}
        for group in going:
            for i in group:
                job_id = steps[i].job
                move = planned_move(steps[i], pods[job_id], jobs[job_id].job, now, settings.steer_s)
                planned[i] = move
        targets = self._note(observed, planned.values(), now)
        if planned and self.config.placement.sync_s > 0:
            self.sleep(self.config.placement.sync_s)  # the service lists the notes first
        unused: list[PlannedMove] = []
        for group in going:
            for k, i in enumerate(group):
                result = self._evict(outcome.decision_id, steps[i], pods[steps[i].job], observed)
                outcome.results.append(result)
                if result.status != "done":
                    rest = group[k + 1 :]
                    why = f"{steps[i].unit} would not be freed: {result.result}"
                    outcome.results.extend(MoveResult(steps[j], "skipped", why) for j in rest)
                    unused.extend(planned[j][1] for j in group[k:])
                    break
        if unused:
            self._unnote(targets, unused)
        outcome.errors.extend(r.result for r in outcome.results if r.status == "failed")

    def _note(
        self, observed: ObservedCluster, planned: Iterable[tuple[str, PlannedMove]], now: float
    ) -> dict[str, list[PlannedMove]]:
        """Write the new moves onto their target nodes beside the live ones already there;
        expired moves are dropped from every node that carries any."""
        targets: dict[str, list[PlannedMove]] = {
            node: [m for m in moves if m.live(now)] for node, moves in observed.moves.items()
        }
        changed = {n for n, moves in observed.moves.items() if len(moves) != len(targets[n])}
        for node, move in planned:
            targets.setdefault(node, []).append(move)
            changed.add(node)
        for node in sorted(changed):
            set_moves(self.api, node, targets[node], self.names)
        return targets

    def _unnote(self, targets: dict[str, list[PlannedMove]], unused: list[PlannedMove]) -> None:
        gone = {m.id for m in unused}
        for node, moves in sorted(targets.items()):
            kept = [m for m in moves if m.id not in gone]
            if len(kept) != len(moves):
                # An unused note that stays expires by itself; its pod is not coming.
                with contextlib.suppress(KubeError):
                    set_moves(self.api, node, kept, self.names)

    def _evict(
        self, decision_id: int, step: PlannedStep, pod: PodRequest, observed: ObservedCluster
    ) -> MoveResult:
        """Journal, count in the window, then ask the eviction."""
        node = observed.nodes.get(step.source)
        pool = (node.pool if node else None) or ""
        at = self.clock()
        made = self.journal.load(WINDOW_KEY, [])
        self.journal.save(WINDOW_KEY, [*made, at])
        action = self.journal.begin(decision_id, pool, ACTION, step.job, step.to_dict())
        try:
            blocked = request_eviction(self.api, pod)
        except KubeError as exc:
            self._uncount(at)
            self.journal.complete(action, "failed", str(exc))
            return MoveResult(step, "failed", str(exc))
        if blocked is not None:
            self._uncount(at)
            why = _refusal_text(blocked.reason, blocked.budget)
            self.journal.complete(action, "blocked", why)
            return MoveResult(step, "blocked", why)
        why = f"evicted from {step.source}; steered to {step.target}"
        self.journal.complete(action, "done", why)
        return MoveResult(step, "done", why)

    def _journal_refusal(
        self, decision_id: int, step: PlannedStep, why: str, observed: ObservedCluster
    ) -> MoveResult:
        """A move a dry run refused: journaled as blocked, never evicted."""
        node = observed.nodes.get(step.source)
        pool = (node.pool if node else None) or ""
        action = self.journal.begin(decision_id, pool, ACTION, step.job, step.to_dict())
        result = MoveResult(step, "blocked", f"not evicted: {why}")
        self.journal.complete(action, "blocked", result.result)
        return result

    # ---- repartitioning ----------------------------------------------------------------
    def _mig_nodes(
        self, observed: ObservedCluster, settings: DefragSection
    ) -> dict[str, MigManagedNode]:
        """The MIG manager's nodes, read only where a repartition could be planned."""
        if not settings.mig.configs or observed.state is None or not observed.state.mig:
            return {}
        return managed_nodes(self.api, self.names)

    def _repartition(
        self,
        observed: ObservedCluster,
        report: DefragReport,
        settings: DefragSection,
        outcome: DefragOutcome,
    ) -> None:
        """Ask the MIG manager for the plan's repartitions whose GPUs are still idle, then
        wait for its answers (see the module docstring)."""
        state = observed.state
        asked: list[tuple[RepartitionStep, int]] = []
        for step in report.repartitions:
            assert state is not None
            at = self.clock()
            self.journal.save(WINDOW_KEY, [*self.journal.load(WINDOW_KEY, []), at])
            node = observed.nodes.get(step.node)
            pool = (node.pool if node else None) or ""
            action = self.journal.begin(
                outcome.decision_id, pool, REPARTITION, step.node, step.to_dict()
            )
            layout = state.mig[state.node_index(step.node)]
            try:
                in_use = gpus_in_use(layout, node_pods(self.api, step.node, self.names))
                hit = next((in_use[g] for g in step.gpus if g in in_use), None)
                if hit is None:
                    request_config(self.api, step.node, step.config)
            except KubeError as exc:
                self._uncount(at)
                self.journal.complete(action, "failed", str(exc))
                outcome.repartitions.append(RepartitionResult(step, "failed", str(exc), False))
                outcome.errors.append(str(exc))
                continue
            if hit is not None:
                self._uncount(at)
                why = f"not asked: {hit} (the node's pods listed again just before)"
                self.journal.complete(action, "blocked", why)
                outcome.repartitions.append(RepartitionResult(step, "blocked", why, False))
                continue
            asked.append((step, action))
        self._await(asked, settings, outcome)

    def _await(
        self,
        asked: Sequence[tuple[RepartitionStep, int]],
        settings: DefragSection,
        outcome: DefragOutcome,
    ) -> None:
        """Read the asked nodes' state until each is settled or `defrag.mig.wait_s` ends."""
        deadline = self.clock() + settings.mig.wait_s
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
                outcome.repartitions.append(RepartitionResult(step, status, why))
                if status == "failed":
                    outcome.errors.append(why)
            waiting = still
            if not waiting or self.clock() >= deadline:
                break
            self.sleep(settings.mig.poll_s)
        for step, _ in waiting:  # journaled pending: a later pass settles them
            why = (
                f"asked; after {settings.mig.wait_s:g} s the node shows {seen.get(step.node)}:"
                " a later pass settles it"
            )
            outcome.repartitions.append(RepartitionResult(step, "requested", why))

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
            changed = {
                int(gpu): [item.partition("@")[0] for item in rest.split(",") if item]
                for gpu, _, rest in (part.partition("=") for part in layout_after.split(";"))
            }
            try:
                text = layout_annotation(node.layout_annotation, changed)
                if text != node.layout_annotation:
                    write_layout(self.api, node.name, text, self.names)
            except (KubeError, ValueError) as exc:
                why += f" (its layout annotation is not rewritten: {exc})"
        return "done", why

    # ---- the window and the journal -------------------------------------------------------
    def _window(self, now: float, window_s: float) -> list[float]:
        made = [t for t in self.journal.load(WINDOW_KEY, []) if t > now - window_s]
        return made

    def _uncount(self, at: float) -> None:
        made = list(self.journal.load(WINDOW_KEY, []))
        if at in made:
            made.remove(at)
            self.journal.save(WINDOW_KEY, made)

    def _settle(self) -> list[dict[str, Any]]:
        """Moves a killed run left pending: done when the pod has gone, else superseded.
        Repartitions an earlier pass asked: as the MIG manager reports them now (still
        under way: left pending)."""
        pending = self.journal.pending()
        moves = [a for a in pending if a.kind == ACTION]
        settled = []
        if moves:
            observed = self.observe(self.api, self.names)
            present = set(observed.bound_pods) | {j.id for j in observed.pending}
            for action in moves:
                if action.target in present:
                    status, why = "superseded", "interrupted by a restart; re-planned"
                else:
                    status, why = "done", "the pod was gone after a restart"
                self.journal.complete(action.id, status, why)
                settled.append({"job": action.target, "status": status, "result": why})
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


def planned_move(
    step: PlannedStep, pod: PodRequest, job: Job, now: float, steer_s: float
) -> tuple[str, PlannedMove]:
    """The note for `step`'s target node: who the successor is (the evicted pod's
    namespace, controller and shape) and the GPUs it is to get."""
    return step.target, PlannedMove(
        id=f"{step.job}@{now:.3f}",
        namespace=pod.namespace,
        controller_uid=pod.controller_uid or "",
        controller=pod.controller or "",
        shape=shape_of(job),
        gpus=step.target_gpus,
        at=now,
        expires=now + steer_s,
    )


def _refusal_text(reason: str, budget: str | None) -> str:
    return f"{reason} (PodDisruptionBudget {budget})" if budget else reason


def _refused(steps: Sequence[PlannedStep], group: list[int], i: int, why: str) -> list[MoveResult]:
    """A unit not started because move `i` would be refused."""
    results = []
    for j in group:
        if j == i:
            results.append(MoveResult(steps[j], "blocked", f"not evicted: {why}"))
        else:
            skipped = f"not evicted: {steps[j].unit} would not be freed ({steps[i].job}: {why})"
            results.append(MoveResult(steps[j], "skipped", skipped))
    return results
