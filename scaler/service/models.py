"""The service's API contract: request and response models.

Two families. Our own (`/v1/placements`, forecasts, plan, node pools) in snake_case. The
kube-scheduler extender's (`/v1/extender/*`) exactly as the scheduler sends and reads them:
the Go structs of k8s.io/kube-scheduler/extender/v1 carry no JSON tags, so their keys are
the Go field names (`Pod`, `Nodes`, `NodeNames`, `FailedNodes`, ...); Go decodes keys
case-insensitively, so lower-case keys are accepted too. The embedded Pod and Node are
ordinary Kubernetes JSON; only the fields placement reads are checked, the rest is kept
and echoed back untouched.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from kubernetes.utils import parse_quantity
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from scaler.cluster.limits import MAX_NODE_GPUS
from scaler.cluster.mig import MigInstance, profile_problem
from scaler.placement import Job, Placement

MAX_NAME = 253
# A taint as `key[=value]:Effect`, the form `Job.tolerations` matches node taints in.
TAINT_TEXT = r"^[^=:]+(=[^:]*)?:(NoSchedule|PreferNoSchedule|NoExecute)$"
MAX_QUANTITY = 2**53  # far above any node; keeps every sum within int64


def _quantity(value: str | int | float) -> str | int | float:
    try:
        amount = parse_quantity(value)
    except (ValueError, TypeError, ArithmeticError):
        raise ValueError(f"not a Kubernetes quantity: {value!r}") from None
    if not math.isfinite(float(amount)) or amount < 0:
        raise ValueError(f"quantity must be finite and not negative: {value!r}")
    if amount > MAX_QUANTITY:
        raise ValueError(f"quantity too large: {value!r}")
    return value


Quantity = Annotated[str | int | float, AfterValidator(_quantity)]


def _whole_extended(resources: dict[str, Any]) -> dict[str, Any]:
    """Kubernetes' rule for extended resources (`nvidia.com/gpu`, any name in a domain of
    its own outside kubernetes.io): whole numbers only. `500m` GPUs would read as none."""
    for name, value in resources.items():
        domain, slash, _ = name.partition("/")
        if slash and not domain.endswith("kubernetes.io") and parse_quantity(value) % 1:
            raise ValueError(f"{name} is an extended resource: a whole number, not {value!r}")
    return resources


Resources = Annotated[dict[str, Quantity], AfterValidator(_whole_extended)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]


def _go(name: str) -> Any:
    """A field the scheduler sends under its Go name; any case is accepted, as Go does."""
    return Field(validation_alias=AliasChoices(name, name.lower(), name[0].lower() + name[1:]))


# ---------------------------------------------------------------------------- our API


class JobRequest(BaseModel):
    """One job (a pod, say) to place: what it asks of a node."""

    # Strict: `"num_gpu": true` or `"preempt": "yes"` is a client's mistake, not 1 or True.
    model_config = ConfigDict(extra="forbid", strict=True)

    id: Name = Field(
        pattern=r"^[^/]+$",
        description="the job's name; no '/': pods bound through the extender are"
        " namespace/name, and one id must never name both",
    )
    cpu_milli: int = Field(default=0, ge=0, le=10**9)
    memory_mib: int = Field(default=0, ge=0, le=10**10)
    num_gpu: int = Field(default=0, ge=0, le=MAX_NODE_GPUS)
    gpu_milli: int | None = Field(
        default=None, ge=1, le=1000, description="share of one GPU (thousandths); none: whole"
    )
    gpu_models: list[Annotated[str, Field(min_length=1)]] = Field(default=[], max_length=64)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    node_selector: dict[str, str] = Field(default={}, max_length=64)
    tolerations: list[Annotated[str, Field(pattern=TAINT_TEXT)]] = Field(
        default=[], max_length=64, description="taints tolerated, as key=value:Effect"
    )
    mode: Literal["pack", "spread"] = "pack"
    service: str | None = Field(default=None, min_length=1, max_length=MAX_NAME)
    mig_profile: str | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        description="MIG profile (e.g. 1g.10gb, as in nvidia.com/mig-1g.10gb): the job takes"
        " MIG instances of it instead of GPUs",
    )
    mig_count: int = Field(default=1, ge=1, le=56, description="MIG instances of mig_profile")
    preempt: bool = Field(default=False, description="may evict lower-priority jobs")
    dry_run: bool = Field(default=False, description="answer without committing")

    @field_validator("gpu_milli")
    @classmethod
    def _share(cls, value: int | None, info: ValidationInfo) -> int | None:
        gpus = info.data.get("num_gpu", 0)
        if value is not None and gpus == 0:
            raise ValueError("a GPU share needs num_gpu 1")
        if value is not None and gpus > 1 and value != 1000:
            raise ValueError("several GPUs are whole GPUs: gpu_milli must be 1000")
        return value

    @model_validator(mode="after")
    def _spread(self) -> JobRequest:
        if self.mode == "spread" and self.service is None:
            raise ValueError("mode spread needs a service (whose replicas are spread)")
        return self

    @field_validator("mig_profile")
    @classmethod
    def _mig(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        if problem := profile_problem(value):
            raise ValueError(problem)
        if info.data.get("num_gpu") or info.data.get("gpu_models"):
            raise ValueError("a MIG job asks no num_gpu or gpu_models: the profile names both")
        return value

    def to_job(self) -> Job:
        share = 0 if self.num_gpu == 0 else (self.gpu_milli or 1000)
        return Job(
            id=self.id,
            cpu_milli=self.cpu_milli,
            memory_mib=self.memory_mib,
            num_gpu=self.num_gpu,
            gpu_milli=share,
            gpu_models=frozenset(self.gpu_models),
            priority=self.priority,
            mode=self.mode,
            service=self.service,
            node_selector=tuple(sorted(self.node_selector.items())),
            tolerations=frozenset(self.tolerations),
            mig_profile=self.mig_profile,
            mig_count=self.mig_count,
        )


class MigInstanceModel(BaseModel):
    """A MIG instance: `profile` on GPU `gpu` from memory slice `start`; `index` is its
    place in the node's layout (what the GPU index annotation records for a MIG pod)."""

    index: int
    gpu: int
    profile: str
    start: int


class PlacementResponse(BaseModel):
    job_id: str
    node: str
    gpus: list[int] = Field(description="GPU indices on the node (a MIG job: its instances' GPUs)")
    mig_instances: list[MigInstanceModel] = Field(
        default=[], description="the MIG instances a MIG job takes"
    )
    policy: str
    evict: list[str] = Field(description="jobs to evict first (preemption)")
    explanation: str = Field(
        description="why this node: its GPU and price, and how it compares with the other"
        " GPUs that could hold the job (empty where the engine did not choose the node)"
    )
    committed: bool

    @classmethod
    def of(
        cls, decided: Placement, instances: list[tuple[int, MigInstance]], committed: bool
    ) -> PlacementResponse:
        """The answer for a placement; `instances`: its MIG instances (index, instance)."""
        return cls(
            job_id=decided.job_id,
            node=decided.node,
            gpus=sorted({i.gpu for _, i in instances}) if instances else list(decided.gpus),
            mig_instances=[
                MigInstanceModel(index=k, gpu=i.gpu, profile=i.profile, start=i.start)
                for k, i in instances
            ],
            policy=decided.policy,
            evict=list(decided.evict),
            explanation=decided.explanation,
            committed=committed,
        )


class Refused(BaseModel):
    """A refusal's body: why, in words (400, 401, 404, 413, 415)."""

    detail: str


class Unplaceable(BaseModel):
    job_id: str
    reason: str


class UnplaceableAnswer(BaseModel):
    """The 409 body: FastAPI's error envelope around why the job cannot be placed."""

    detail: Unplaceable


class ReleaseResponse(BaseModel):
    job_id: str
    node: str
    gpus: list[int]


class SeriesForecast(BaseModel):
    series: str
    observed: float | None
    newest: str | None
    age_s: float | None
    problem: str | None
    gpu_models: list[str] | None
    horizons: list[dict[str, float | int | str]]


class ForecastResponse(BaseModel):
    at: str
    model: str
    step_seconds: float
    problems: list[str]
    series: list[SeriesForecast]


class PoolPlan(BaseModel):
    pool: str
    current: int
    target: int
    desired: int
    action: str
    reason: str
    held: str | None


class PlanResponse(BaseModel):
    at: str
    mode: str
    step: str
    problems: list[str]
    pools: list[PoolPlan]
    removals: list[dict[str, Any]]
    placeholders: list[dict[str, Any]]
    # `pre_position: capacity-buffer`: the CapacityBuffer each pool would get (pool, replicas,
    # unit, reason), as the loop would set them.
    capacity_buffers: list[dict[str, Any]]
    needs: list[dict[str, Any]]
    # How each demand group's need is sized (tuned, job-level-spare, forecast-bound,
    # reactive-fallback: too little history to tune on), and, where this plan's planner
    # state was rebuilt from the store's history, how (why, steps, forecasts).
    sizing: dict[str, str] = {}
    warm_start: dict[str, Any] | None = None


class NodePoolNode(BaseModel):
    name: str
    status: str
    launched_at: str


class NodePoolResponse(BaseModel):
    name: str
    gpu_model: str
    gpus_per_node: int
    price_per_hour: float
    capacity_type: str
    boot_seconds: float
    min_size: int
    max_size: int
    target_size: int
    ready: int
    booting: int
    nodes: list[NodePoolNode]


# ---------------------------------------------------------------------------- Kubernetes


class _Kube(BaseModel):
    """A Kubernetes object part: fields placement reads are checked, others kept."""

    model_config = ConfigDict(extra="allow")


class ObjectMeta(_Kube):
    name: Name
    namespace: str = Field(default="default", max_length=63)
    uid: str = Field(default="", max_length=128)
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class ResourceRequirements(_Kube):
    requests: Resources = {}
    limits: Resources = {}


class Container(_Kube):
    name: str = ""
    resources: ResourceRequirements = ResourceRequirements()


class Toleration(_Kube):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute", ""] | None = None


class PreferredSchedulingTerm(_Kube):
    weight: int = Field(ge=1, le=100)


class NodeAffinity(_Kube):
    preferredDuringSchedulingIgnoredDuringExecution: list[PreferredSchedulingTerm] = Field(
        default=[], max_length=256
    )


class Affinity(_Kube):
    nodeAffinity: NodeAffinity | None = None


class PodSpec(_Kube):
    containers: list[Container] = Field(default=[], max_length=256)
    initContainers: list[Container] = Field(default=[], max_length=256)
    nodeSelector: dict[str, str] = {}
    tolerations: list[Toleration] = Field(default=[], max_length=256)
    affinity: Affinity | None = None  # the preferred pool is read from its weights
    priority: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    nodeName: str | None = None


class PodStatus(_Kube):
    phase: str | None = None


class KubePod(_Kube):
    metadata: ObjectMeta
    spec: PodSpec = PodSpec()
    status: PodStatus = PodStatus()


class Taint(_Kube):
    key: str = Field(min_length=1)
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]


class KubeNodeSpec(_Kube):
    unschedulable: bool = False
    taints: list[Taint] = Field(default=[], max_length=256)
    providerID: str | None = None


class KubeNodeStatus(_Kube):
    allocatable: Resources = {}
    capacity: Resources = {}


class KubeNode(_Kube):
    metadata: ObjectMeta
    spec: KubeNodeSpec = KubeNodeSpec()
    status: KubeNodeStatus = KubeNodeStatus()


class KubeNodeList(_Kube):
    items: list[KubeNode] = Field(default=[], max_length=20_000)

    @field_validator("items")
    @classmethod
    def _unique(cls, items: list[KubeNode]) -> list[KubeNode]:
        names = [n.metadata.name for n in items]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"node names must be unique; listed more than once: {twice[:5]}")
        return items


class ExtenderArgs(BaseModel):
    """What kube-scheduler posts to filter and prioritize: the pod and its candidates,
    as full nodes (nodeCacheCapable false) or as names (true)."""

    Pod: KubePod = _go("Pod")
    Nodes: KubeNodeList | None = Field(
        default=None, validation_alias=AliasChoices("Nodes", "nodes")
    )
    NodeNames: list[Name] | None = Field(
        default=None,
        max_length=20_000,
        validation_alias=AliasChoices("NodeNames", "nodenames", "nodeNames"),
    )


class ExtenderFilterResult(BaseModel):
    Nodes: dict[str, Any] | None = None
    NodeNames: list[str] | None = None
    FailedNodes: dict[str, str] = {}
    FailedAndUnresolvableNodes: dict[str, str] = {}
    Error: str = ""


class HostPriority(BaseModel):
    Host: str
    Score: int = Field(ge=0, le=10, description="0..MaxExtenderPriority (10)")


class ExtenderBindingArgs(BaseModel):
    PodName: Name = _go("PodName")
    PodNamespace: str = Field(
        default="default",
        max_length=63,
        validation_alias=AliasChoices("PodNamespace", "podnamespace", "podNamespace"),
    )
    PodUID: str = Field(
        default="", max_length=128, validation_alias=AliasChoices("PodUID", "poduid", "podUID")
    )
    Node: Name = _go("Node")


class ExtenderBindingResult(BaseModel):
    Error: str = ""
