"""The kube-scheduler extender over the placement engine: pods become jobs, nodes become
node specs, and filter / prioritize / bind answer with the engine's own decisions.

- filter: a node passes when the engine finds it feasible for the pod now. A node that
  could never hold the pod (selector or taints, GPU model, too few GPUs or CPU or memory
  in all) is reported as unresolvable, so the scheduler does not try preemption there;
  one that is only full now is a plain failure.
- prioritize: the engine's policy ranks the candidates the way `place` would choose among
  them (`engine.candidates`: feasible, non-draining while any fit): its first choice
  scores 10 (MaxExtenderPriority), the next 9, ... and the rest 0, so the scheduler's top
  node is the engine's placement.
- bind: the engine chooses the GPU indices on the node the scheduler picked.

Everything here is a pure function of a `ClusterState`, a job and the policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from kubernetes.utils import parse_quantity

from scaler.cluster.job import WHOLE_GPU_MILLI
from scaler.cluster.predicates import feasible, full_now, never_on
from scaler.placement import ClusterState, Job, NodeSpec, Placement, Policy, Unschedulable
from scaler.placement.engine import candidates as engine_candidates
from scaler.service.models import Container, KubeNode, KubePod, Taint, Toleration

MAX_EXTENDER_PRIORITY = 10
SCHEDULING_EFFECTS = ("NoSchedule", "NoExecute")  # PreferNoSchedule never rules a node out


@dataclass(frozen=True)
class KubeNames:
    """Where Kubernetes objects carry what placement needs."""

    gpu_resource: str = "nvidia.com/gpu"
    gpu_model_label: str = "nvidia.com/gpu.product"
    gpu_milli_annotation: str = "gpuscale.io/gpu-milli"
    gpus_annotation: str = "gpuscale.io/gpus"


def taint_text(taint: Taint) -> str:
    return f"{taint.key}={taint.value or ''}:{taint.effect}"


def parse_taint(text: str) -> Taint:
    """The inverse of `taint_text`."""
    rest, _, effect = text.rpartition(":")
    key, _, value = rest.partition("=")
    return Taint(key=key, value=value or None, effect=effect)


def node_spec(node: KubeNode, names: KubeNames) -> NodeSpec:
    allocatable = node.status.allocatable or node.status.capacity
    labels = node.metadata.labels
    return NodeSpec(
        name=node.metadata.name,
        cpu_milli=int(parse_quantity(allocatable.get("cpu", 0)) * 1000),
        memory_mib=int(parse_quantity(allocatable.get("memory", 0)) / 2**20),
        gpus=int(parse_quantity(allocatable.get(names.gpu_resource, 0))),
        model=labels.get(names.gpu_model_label, ""),
        labels=tuple(sorted(labels.items())),
        taints=frozenset(taint_text(t) for t in node.spec.taints if t.effect in SCHEDULING_EFFECTS),
    )


def tolerates(toleration: Toleration, taint: Taint) -> bool:
    """Kubernetes' rule: an empty key with Exists tolerates every taint; an empty effect
    matches every effect; Exists ignores the value."""
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if not toleration.key:
        return toleration.operator == "Exists"
    if toleration.key != taint.key:
        return False
    if toleration.operator == "Exists":
        return True
    return (toleration.value or "") == (taint.value or "")


def _requests(pod: KubePod, resource: str) -> float:
    """A pod's request of one resource: its containers together, or its largest init
    container if more. Extended resources may be given as a limit only."""

    def amount(container: Container) -> float:
        res = container.resources
        for table in (res.requests, res.limits):
            if resource in table:
                return float(parse_quantity(table[resource]))
        return 0.0

    main = sum(amount(c) for c in pod.spec.containers)
    init = max((amount(c) for c in pod.spec.initContainers), default=0.0)
    return max(main, init)


def pod_job(pod: KubePod, names: KubeNames, taints: Iterable[Taint] = ()) -> Job:
    """The job a pod is. `taints` are the candidate nodes' taints, so the job's tolerations
    can be matched against them exactly."""
    gpus = int(_requests(pod, names.gpu_resource))
    share = WHOLE_GPU_MILLI if gpus else 0
    asked = pod.metadata.annotations.get(names.gpu_milli_annotation)
    if gpus == 1 and asked is not None:
        share = int(asked)
        if not 0 < share <= WHOLE_GPU_MILLI:
            raise ValueError(f"annotation {names.gpu_milli_annotation} must be 1..1000")
    selector = dict(pod.spec.nodeSelector)
    model = selector.pop(names.gpu_model_label, None)
    tolerated = frozenset(
        taint_text(t)
        for t in taints
        if t.effect in SCHEDULING_EFFECTS and any(tolerates(o, t) for o in pod.spec.tolerations)
    )
    labels = pod.metadata.labels
    return Job(
        id=f"{pod.metadata.namespace}/{pod.metadata.name}",
        cpu_milli=int(_requests(pod, "cpu") * 1000),
        memory_mib=int(_requests(pod, "memory") / 2**20),
        num_gpu=gpus,
        gpu_milli=share,
        gpu_models=frozenset({model}) if model else frozenset(),
        priority=pod.spec.priority or 0,
        placeholder=labels.get("app.kubernetes.io/component") == "placeholder"
        and labels.get("app.kubernetes.io/managed-by") == "gpuscale",
        node_selector=tuple(sorted(selector.items())),
        tolerations=tolerated,
    )


def gpus_of(pod: KubePod, names: KubeNames) -> tuple[int, ...] | None:
    """The GPU indices a bound pod was given (recorded by our bind), if any."""
    text = pod.metadata.annotations.get(names.gpus_annotation)
    if not text:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        return None


@dataclass(frozen=True)
class FilterResult:
    passing: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]


def filter_nodes(state: ClusterState, job: Job, candidates: Sequence[str]) -> FilterResult:
    """Split the candidates into those that can take the job now and those that cannot,
    with why; names the state does not know fail."""
    index = {name: i for i, name in enumerate(state.names)}
    problem = job.problem()
    fits = feasible(state, job) if problem is None else np.zeros(state.size, dtype=bool)
    passing: list[str] = []
    failed: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    for name in candidates:
        n = index.get(name)
        if problem is not None:
            unresolvable[name] = f"the pod's request is malformed: {problem}"
        elif n is None:
            failed[name] = "node unknown to gpuscale"
        elif fits[n]:
            passing.append(name)
        else:
            never = never_on(state, job, n)
            if never:
                unresolvable[name] = never
            else:
                failed[name] = full_now(state, job, n)
    return FilterResult(passing, failed, unresolvable)


def rank(
    state: ClusterState, job: Job, policy: Policy, candidates: Sequence[str]
) -> list[tuple[str, int]]:
    """Scores 0..10 for the candidates: the policy's choice among the engine's candidates
    (`engine.candidates`, those `place` chooses among) first, then its choice among the
    rest, and so on for the top ten; once the non-draining ones are ranked, the draining
    ones follow."""
    index = {name: i for i, name in enumerate(state.names)}
    scores = dict.fromkeys(candidates, 0)
    if job.problem() is not None:
        return list(scores.items())
    unranked = np.array(sorted({index[c] for c in candidates if c in index}), dtype=np.int64)
    pool = engine_candidates(state, job, unranked)
    for score in range(MAX_EXTENDER_PRIORITY, 0, -1):
        if pool.size == 0:
            pool = engine_candidates(state, job, unranked)
            if pool.size == 0:
                break
        node, _ = policy.choose(state, job, pool)
        scores[state.names[node]] = score
        pool, unranked = pool[pool != node], unranked[unranked != node]
    return list(scores.items())


def place_on(state: ClusterState, job: Job, policy: Policy, node: str) -> Placement | Unschedulable:
    """The GPUs the policy gives `job` on `node` (the node the scheduler chose)."""
    if job.problem() is not None:
        return Unschedulable(job.id, job.problem() or "")
    if node not in state.names:
        return Unschedulable(job.id, f"node {node} is unknown to gpuscale")
    n = state.names.index(node)
    if not feasible(state, job)[n]:
        return Unschedulable(job.id, never_on(state, job, n) or full_now(state, job, n))
    chosen, gpus = policy.choose(state, job, np.array([n]))
    return Placement(job.id, node, chosen, gpus, policy.name)
