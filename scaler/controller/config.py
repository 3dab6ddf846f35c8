"""Configuration of the live loop (`gpuscale scale`) and the service (`gpuscale serve`).

One YAML file plus environment variables, validated at start (pydantic-settings). The
environment overrides the file: `GPUSCALE_STATE_DIR=/var/lib/gpuscale`,
`GPUSCALE_SERVICE__TOKEN=...`, `GPUSCALE_LEASE__IDENTITY=$(POD_NAME)` (nested fields joined
by `__`). An invalid value is an `InputError` naming the file, the line and the field, so a
bad config never reaches a running loop.

```yaml
state_dir: /var/lib/gpuscale          # the telemetry store and the decision log
reconcile_interval_s: 60
pools: [{name: a100, gpu_model: A100, gpus_per_node: 8, price_per_hour: 32, max_size: 20}]
provider:
  kind: aws
  aws: {region: us-east-1, bindings: [{pool: a100, auto_scaling_group: gpu-a100}]}
kubernetes: {kubeconfig: ~/.kube/config}   # absent: no cordon/drain, no placeholders
demand: {metric: gpu_demand, stale_after_s: 300}
model: {name: gpuscale}
policy: {mode: predictive}
lease: {namespace: gpuscale-system}
service: {token_file: /var/run/secrets/gpuscale/token}
```
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from predictor.foundation.config_files import FieldError, FileSettings, load_model
from predictor.foundation.errors import InputError
from predictor.telemetry.config import KubernetesSettings
from predictor.telemetry.kube_objects import KUBE_NAMES, KubeNames
from predictor.telemetry.kubernetes import kube_names as collector_names
from scaler.cluster.job import Job
from scaler.cluster.mig import layout_of
from scaler.cluster.pools import NodePool
from scaler.cluster.topology import parse_gpu_domains
from scaler.kube.capacity_buffers import BufferSettings
from scaler.kube.drainability import DrainRules
from scaler.kube.mig_manager import MigManagerSettings
from scaler.kube.placeholders import PlaceholderSettings
from scaler.kube.watched import STALE_AFTER_S
from scaler.placement.mix import WorkloadMix
from scaler.placement.policies import POLICIES
from scaler.planning.planner import PlannerPolicy, ShortHistory
from scaler.providers.aws import AwsSettings
from scaler.providers.karpenter import KarpenterSettings
from scaler.providers.simulated import SimulatedCloudConfig

_PLACEHOLDER_POOL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")

MAX_GPU_INDEX = 1024  # GPU domains by model are checked for syntax against this many GPUs


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimulatedProvider(SimulatedCloudConfig):
    """The simulated cloud, for trying the loop without a cloud account. It is kept in the
    state directory (`simulated-cloud.json`), so it outlives the process as a cloud does:
    `scale` and `serve` on one config share it, and a restart finds the nodes where they
    were. Delete the file to start over at `initial_sizes`."""

    initial_sizes: dict[str, int] = Field(
        default_factory=dict,
        description="ready nodes per pool when the state directory holds no simulated cloud"
        " yet (default: min_size)",
    )


# Who removes a pool's surplus nodes: gpuscale cordons and drains them and the provider
# deletes them (drain); the provider takes the named node out and drains it itself
# (provider: Karpenter's termination, for a static NodePool); or nobody here, the node
# autoscaler's own scale-down does (none).
ScaleDown = Literal["drain", "provider", "none"]
DEFAULT_SCALE_DOWN: dict[str, ScaleDown] = {
    "simulated": "drain",
    "aws": "drain",
    "karpenter": "provider",
    "autoscaler": "none",
}


class ProviderSection(_Section):
    """Who changes the number of nodes: the simulated cloud, AWS node groups, static
    Karpenter NodePools (`spec.replicas`), or the cluster's node autoscaler (Cluster
    Autoscaler, Karpenter's dynamic NodePools), which gpuscale only observes and asks for
    spare capacity (`kubernetes.pre_position`)."""

    kind: Literal["simulated", "aws", "karpenter", "autoscaler"] = "simulated"
    simulated: SimulatedProvider = SimulatedProvider()
    aws: AwsSettings | None = None
    karpenter: KarpenterSettings | None = None
    scale_down: ScaleDown | None = Field(
        default=None,
        description="drain (gpuscale drains, the provider deletes), provider (the provider"
        " drains and deletes the node named), none (the node autoscaler's scale-down);"
        " default: none for autoscaler, provider for karpenter, else drain",
    )

    @model_validator(mode="after")
    def _aws_needs_bindings(self) -> ProviderSection:
        # A section for another kind is never read: refused, so that an `aws` section
        # without `kind: aws` does not quietly run the simulated cloud.
        for other in ("simulated", "aws", "karpenter"):
            if other != self.kind and other in self.model_fields_set:
                default = "" if "kind" in self.model_fields_set else " (the default)"
                raise FieldError(
                    f"provider.{other}",
                    f"given but provider.kind is {self.kind}{default}: set kind {other}"
                    " or remove the section",
                )
        if self.kind == "aws" and self.aws is None:
            raise ValueError("provider kind aws needs an `aws` section with bindings")
        if self.kind == "karpenter" and self.karpenter is None:
            raise ValueError("provider kind karpenter needs a `karpenter` section with node_pools")
        if self.scale_down is None:
            object.__setattr__(self, "scale_down", DEFAULT_SCALE_DOWN[self.kind])
        if self.kind == "autoscaler" and self.scale_down != "none":
            raise ValueError("provider kind autoscaler removes no node: scale_down must be none")
        if self.scale_down == "provider" and self.kind != "karpenter":
            raise ValueError("scale_down provider is Karpenter's drain: provider kind karpenter")
        return self

    @property
    def sets_sizes(self) -> bool:
        """gpuscale grows pools itself (else the node autoscaler provisions the room)."""
        return self.kind != "autoscaler"


class DrainSection(_Section):
    timeout_s: float = Field(default=120.0, gt=0, description="how long evictions may take")
    poll_s: float = Field(default=5.0, gt=0)
    unremovable_s: float = Field(
        default=600.0, ge=0, description="a node whose drain was blocked is not chosen again"
    )
    max_nodes: int = Field(
        default=3,
        ge=1,
        description="registered nodes one pass removes at most (nodes not registered yet,"
        " with nothing to drain, aside); the rest of the surplus waits for the next pass,"
        " checked on what the cluster shows then. The pass's drains run together, each up to"
        " timeout_s, and no scale-up is planned until the pass ends, so a pass lasts about"
        " timeout_s however many nodes it drains",
    )
    skip_nodes_with_system_pods: bool = Field(
        default=True,
        description="as Cluster Autoscaler's flag: a node running a kube-system pod that is"
        " no DaemonSet or mirror pod and that no PodDisruptionBudget covers is not removed,"
        ' unless the pod is annotated cluster-autoscaler.kubernetes.io/safe-to-evict: "true"',
    )
    skip_nodes_with_local_storage: bool = Field(
        default=True,
        description="as Cluster Autoscaler's flag: a node running a pod with local storage (a"
        " hostPath, or an emptyDir not in memory) is not removed, unless the pod is annotated"
        ' safe-to-evict: "true" or its cluster-autoscaler.kubernetes.io/'
        "safe-to-evict-local-volumes annotation names each such volume",
    )

    def rules(self) -> DrainRules:
        """Which pods keep their node (`scaler.kube.drainability`)."""
        return DrainRules(
            system_pods=self.skip_nodes_with_system_pods,
            local_storage=self.skip_nodes_with_local_storage,
        )


class KubernetesSection(KubernetesSettings):
    """Access to the cluster (kubeconfig, in-cluster service account, or a plain `host`
    such as `kubectl proxy`), and what the loop does there."""

    host: str | None = Field(
        default=None,
        pattern=r"^https?://",
        description="API server URL used without credentials (kubectl proxy); overrides kubeconfig",
    )
    drain: DrainSection = DrainSection()
    cache_stale_after_s: float = Field(
        default=STALE_AFTER_S,
        gt=0,
        description="a watch of the cluster cache down longer than this makes each pass hold"
        " its scale-downs (the view may miss a pod a drain would strand); scale-ups go on",
    )
    pre_position: Literal["placeholders", "capacity-buffer", "none"] = Field(
        default="placeholders",
        description="hold the spare capacity the plan provides: with placeholder pods, with"
        " one CapacityBuffer per pool (the node autoscaler provisions it), or not at all"
        " (true and false read as placeholders and none)",
    )
    placeholder_gpus: int | None = Field(
        default=None,
        gt=0,
        description="GPUs of every placeholder (at most a node's); none: placeholders shaped"
        " like the jobs of placement.mix, packed onto the room the plan provides",
    )
    placeholders: PlaceholderSettings = PlaceholderSettings()
    capacity_buffers: BufferSettings = BufferSettings()
    gpus_annotation: str = Field(
        default=KUBE_NAMES.gpus_annotation,
        description="pod annotation recording its GPU indices",
    )
    rack_label: str = Field(
        default=KUBE_NAMES.rack_label,
        min_length=1,
        description="node label naming its rack (placement keeps whole racks free)",
    )
    gpu_domains_label: str = Field(
        default=KUBE_NAMES.gpu_domains_label,
        min_length=1,
        description="node label (or annotation) giving its GPUs' NVLink domains, e.g. 0-3_4-7",
    )
    gpu_domains: dict[str, str] = Field(
        default_factory=dict,
        description="GPU model -> NVLink domains of its nodes' GPUs (e.g. nvswitch), where"
        " the node label says none",
    )

    @field_validator("gpu_domains")
    @classmethod
    def _domains_read(cls, value: dict[str, str]) -> dict[str, str]:
        for model, text in value.items():
            try:  # the indices are checked against each node's GPUs when it is read
                parse_gpu_domains(text, MAX_GPU_INDEX)
            except ValueError as exc:
                raise ValueError(f"{model}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _placeholders_follow_the_cluster(self) -> KubernetesSection:
        # Placeholders select the pool and ask the GPU resource the cluster names, unless
        # their own section says otherwise.
        follow = {"node_pool_label": self.pool_label, "gpu_resource": self.gpu_resource}
        update = {k: v for k, v in follow.items() if k not in self.placeholders.model_fields_set}
        if update:
            object.__setattr__(self, "placeholders", self.placeholders.model_copy(update=update))
        given = self.capacity_buffers.model_fields_set
        update = {k: v for k, v in follow.items() if k not in given}
        if update:
            buffers = self.capacity_buffers.model_copy(update=update)
            object.__setattr__(self, "capacity_buffers", buffers)
        return self

    @model_validator(mode="before")
    @classmethod
    def _pre_position_named(cls, data: Any) -> Any:
        # Older configs (and GPUSCALE_KUBERNETES__PRE_POSITION) say true or false.
        named = {True: "placeholders", False: "none", "true": "placeholders", "false": "none"}
        if isinstance(data, dict) and isinstance(data.get("pre_position"), bool | str):
            value = data["pre_position"]
            value = value.lower() if isinstance(value, str) else value
            if value in named:
                data = {**data, "pre_position": named[value]}
        return data

    def names(self) -> KubeNames:
        """Where this cluster's objects carry what gpuscale needs: the collector's names
        (so telemetry and the scaler read a pod alike) and the bind's GPU index annotation."""
        return replace(
            collector_names(self),
            gpus_annotation=self.gpus_annotation,
            rack_label=self.rack_label,
            gpu_domains_label=self.gpu_domains_label,
            model_gpu_domains=tuple(sorted(self.gpu_domains.items())),
        )


def kube_names(section: KubernetesSection | None) -> KubeNames:
    """The configured object conventions; the defaults without a `kubernetes` section."""
    return section.names() if section is not None else KUBE_NAMES


class DemandGroup(_Section):
    gpu_models: tuple[str, ...] = Field(default=(), description="empty: any pool may serve it")


class DemandSection(_Section):
    metric: str = Field(default="gpu_demand", min_length=1, description="store metric")
    series: tuple[str, ...] | None = Field(
        default=None, description="store series to forecast (none: every series of the metric)"
    )
    groups: dict[str, DemandGroup] = Field(
        default_factory=dict,
        description="GPU models each series may use; a series named like a pool defaults to"
        " that pool's model",
    )
    history_s: float = Field(default=7 * 86400, gt=0, description="history read per decision")
    stale_after_s: float = Field(
        default=300.0,
        gt=0,
        description="a series whose newest point is older than this is stale: no scale-down",
    )


class ModelSection(_Section):
    name: str = Field(default="gpuscale", min_length=1)
    registry: Path | None = Field(
        default=None, description="model registry root; none: fit on the store's history"
    )
    version: int | None = Field(default=None, ge=1, description="registry version; none: latest")
    refit_s: float = Field(
        default=86400.0, gt=0, description="refit interval when fitting on the store's history"
    )
    requests: str = Field(
        default="requests",
        min_length=1,
        description="registry name of the request-rate model (`gpuscale retrain-requests`);"
        " where the registry serves none, the planner keeps its seasonal table",
    )


class LeaseSection(_Section):
    enabled: bool = True
    name: str = Field(default="gpuscale-scaler", min_length=1)
    namespace: str = Field(default="gpuscale-system", min_length=1)
    identity: str = Field(default_factory=socket.gethostname, min_length=1)
    duration_s: int = Field(default=15, ge=1, description="how long a lease holds unrenewed")
    renew_deadline_s: float = Field(
        default=10.0, gt=0, description="a leader that could not renew for this long stops"
    )
    retry_s: float = Field(default=2.0, gt=0, description="renew at least this often")

    @model_validator(mode="after")
    def _deadline(self) -> LeaseSection:
        if self.renew_deadline_s >= self.duration_s:
            raise ValueError("renew_deadline_s must be below duration_s")
        return self


class PlacementNode(_Section):
    """A node of a fixed cluster for the placement service (without Kubernetes)."""

    name: str = Field(min_length=1)
    pool: str | None = None
    gpus: int = Field(default=0, ge=0)
    gpu_model: str = ""
    cpu_milli: int = Field(ge=0)
    memory_mib: int = Field(ge=0)
    labels: dict[str, str] = Field(default_factory=dict)
    mig_layout: str | None = Field(
        default=None,
        description="MIG instances of its partitioned GPUs, as the node annotation"
        " gpuscale.io/mig-layout writes them (e.g. 8=3g.40gb,3g.40gb;9=7g.80gb)",
    )
    gpu_domains: str | None = Field(
        default=None, description="NVLink domains of its GPUs (e.g. 0-3_4-7, nvswitch)"
    )
    rack: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _topology_read(self) -> PlacementNode:
        # Read once here so a bad layout is an error naming the node's field at start.
        if self.mig_layout:
            layout_of(self.mig_layout, self.gpu_model)
        if self.gpu_domains:
            parse_gpu_domains(self.gpu_domains, self.gpus)
        return self


class MixShape(_Section):
    """One typical job shape and its share of jobs (the fragmentation policies need them)."""

    cpu_milli: int = Field(default=0, ge=0)
    memory_mib: int = Field(default=0, ge=0)
    num_gpu: int = Field(default=1, ge=0)
    gpu_milli: int = Field(default=1000, ge=0, le=1000)
    gpu_models: tuple[str, ...] = ()
    weight: int = Field(default=1, ge=1)


def mix_jobs(shapes: Sequence[MixShape]) -> list[Job]:
    """The configured typical job shapes as jobs, each repeated by its weight."""
    return [
        Job(
            id=f"mix-{i}-{k}",
            cpu_milli=s.cpu_milli,
            memory_mib=s.memory_mib,
            num_gpu=s.num_gpu,
            gpu_milli=s.gpu_milli if s.num_gpu else 0,
            gpu_models=frozenset(s.gpu_models),
        )
        for i, s in enumerate(shapes)
        for k in range(s.weight)
    ]


def workload_mix(shapes: Sequence[MixShape]) -> WorkloadMix:
    """The configured job shapes as the fragmentation policies' view of the workload."""
    return WorkloadMix.from_jobs(mix_jobs(shapes))


DEFAULT_MIX: tuple[MixShape, ...] = (
    MixShape(cpu_milli=4000, memory_mib=16384, num_gpu=1, gpu_milli=500, weight=2),
    MixShape(cpu_milli=8000, memory_mib=32768, num_gpu=1, weight=4),
    MixShape(cpu_milli=16000, memory_mib=65536, num_gpu=2, weight=2),
    MixShape(cpu_milli=32000, memory_mib=131072, num_gpu=4, weight=1),
    MixShape(cpu_milli=64000, memory_mib=262144, num_gpu=8, weight=1),
    MixShape(cpu_milli=2000, memory_mib=4096, num_gpu=0, gpu_milli=0, weight=2),
)


class PlacementSection(_Section):
    policy: str = Field(default="gpuscale", description="placement policy (scaler.placement)")
    seed: int = 0
    mix: tuple[MixShape, ...] = Field(default=DEFAULT_MIX, min_length=1)
    nodes: tuple[PlacementNode, ...] = Field(
        default=(),
        description="a fixed cluster; none: Kubernetes nodes, else the provider's nodes",
    )
    sync_s: float = Field(default=5.0, ge=0, description="re-list Kubernetes at most this often")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        # Checked here, not on the first pass: every pass makes the policy again.
        if value not in POLICIES:
            raise ValueError(f"unknown placement policy {value!r} (known: {', '.join(POLICIES)})")
        return value


class DefragSection(_Section):
    """`gpuscale defrag`: which pods may be moved, how many moves a window allows, and how
    long the extender steers a moved pod's successor to its planned node."""

    goal: Literal["nodes", "gpus"] = Field(
        default="nodes", description="empty whole nodes, or whole GPUs of shared ones"
    )
    max_moves: int = Field(
        default=10, ge=0, description="evictions and MIG repartitions per window, at most"
    )
    window_s: float = Field(default=3600.0, gt=0, description="the window max_moves counts in")
    priority_classes: tuple[str, ...] = Field(
        default=(),
        description="pods of these priority classes may be moved, as may pods labelled"
        " gpuscale.io/movable=true",
    )
    steer_s: float = Field(
        default=900.0, gt=0, description="a planned move steers its pod's successor this long"
    )
    hold_s: float = Field(
        default=60.0,
        ge=0,
        description="while the planned node cannot take the successor yet (the evicted pod"
        " still terminating), the extender keeps it pending this long",
    )
    mig: MigManagerSettings = Field(
        default_factory=MigManagerSettings,
        description="repartitioning idle MIG GPUs through the GPU operator's MIG manager",
    )


class ServiceSection(_Section):
    token: SecretStr | None = Field(default=None, description="bearer token for mutating calls")
    token_file: Path | None = Field(default=None, description="file holding the token (Secret)")
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    bind_needs_token: bool = Field(
        default=True,
        description="kube-scheduler sends no bearer token: false lets /v1/extender/bind in"
        " without one (put the service behind a NetworkPolicy then)",
    )
    plan_cache_s: float = Field(default=10.0, ge=0, description="reuse a plan this long")

    def bearer_token(self) -> str | None:
        """The configured token (the file wins), or None when mutating calls are off."""
        if self.token_file is not None:
            try:
                text = self.token_file.read_text().strip()
            except OSError as exc:
                raise InputError(f"cannot read: {exc.strerror}", path=self.token_file) from None
            return text or None
        return self.token.get_secret_value() if self.token is not None else None


class LivePolicy(PlannerPolicy):
    """The planner's policy in the live loop: before a group has the history to tune its
    spare on (a store holding less than `tuning_min_steps`), it is sized reactively, on the
    demand seen, not on the raw forecast bound (the replays' cold start)."""

    short_history: ShortHistory = Field(
        default="reactive", description=PlannerPolicy.model_fields["short_history"].description
    )


class LiveConfig(FileSettings):
    """Everything `gpuscale scale`, `gpuscale serve` and `gpuscale defrag` need."""

    state_dir: Path = Field(description="holds the telemetry store and the decision log")
    reconcile_interval_s: float = Field(default=60.0, gt=0)
    pools: tuple[NodePool, ...] = Field(min_length=1)
    provider: ProviderSection = ProviderSection()
    kubernetes: KubernetesSection | None = None
    demand: DemandSection = DemandSection()
    model: ModelSection = ModelSection()
    policy: LivePolicy = LivePolicy()
    lease: LeaseSection = LeaseSection()
    placement: PlacementSection = PlacementSection()
    service: ServiceSection = ServiceSection()
    defrag: DefragSection = DefragSection()

    @model_validator(mode="after")
    def _consistent(self) -> LiveConfig:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError("a pool name appears twice")
        if self.provider.kind == "aws" and self.provider.aws is not None:
            bound = {b.pool for b in self.provider.aws.bindings}
            unbound = sorted(set(names) - bound)
            if unbound:
                raise ValueError(f"pools without an AWS binding: {', '.join(unbound)}")
        if self.provider.kind == "karpenter" and self.provider.karpenter is not None:
            bound = {b.pool for b in self.provider.karpenter.node_pools}
            unbound = sorted(set(names) - bound)
            if unbound:
                raise ValueError(f"pools without a Karpenter NodePool: {', '.join(unbound)}")
        if self.provider.kind in ("karpenter", "autoscaler") and self.kubernetes is None:
            raise ValueError(f"provider kind {self.provider.kind} needs a `kubernetes` section")
        if self.kubernetes is not None and self.kubernetes.pre_position != "none":
            # Placeholder pods and buffers are named after their pool:
            # gpuscale-placeholder-<pool>-<i>, gpuscale-<pool>, gpuscale-buffer-<pool>.
            bad = [n for n in names if not _PLACEHOLDER_POOL.match(n)]
            if bad:
                raise ValueError(
                    f"pools {', '.join(bad)} cannot name placeholder pods or buffers (lower-case"
                    " letters, digits and '-', at most 40): set kubernetes.pre_position none"
                    " or rename"
                )
        _known_pools(self.pools, self.provider)
        _known_models(self.pools, self.demand)
        return self


def _known_pools(pools: Sequence[NodePool], provider: ProviderSection) -> None:
    """Every pool the provider section names is one of `pools`, and no initial size is
    above its pool's max_size (the cloud could not start there)."""
    by_name = {p.name: p for p in pools}
    named: dict[str, Sequence[str]] = {
        "provider.simulated.initial_sizes": list(provider.simulated.initial_sizes),
        "provider.simulated.capacity": list(provider.simulated.capacity),
    }
    if provider.aws is not None:
        named["provider.aws.bindings"] = [b.pool for b in provider.aws.bindings]
    if provider.karpenter is not None:
        named["provider.karpenter.node_pools"] = [b.pool for b in provider.karpenter.node_pools]
    for field, names in named.items():
        unknown = sorted(set(names) - set(by_name))
        if unknown:
            raise FieldError(field, f"names pools not in `pools`: {', '.join(unknown)}")
    for name, size in provider.simulated.initial_sizes.items():
        if size > by_name[name].max_size:
            raise FieldError(
                f"provider.simulated.initial_sizes.{name}",
                f"{size} is above the pool's max_size {by_name[name].max_size}",
            )


def _known_models(pools: Sequence[NodePool], demand: DemandSection) -> None:
    """Every GPU model a demand group may use is some pool's: a misspelt one would leave
    the group's demand with no pool to serve it."""
    models = {p.gpu_model for p in pools}
    for group, settings in demand.groups.items():
        unknown = sorted(set(settings.gpu_models) - models)
        if unknown:
            raise FieldError(
                f"demand.groups.{group}.gpu_models",
                f"no pool has GPU model {', '.join(unknown)}"
                f" (pools have {', '.join(sorted(models))})",
            )


def load_live_config(path: Path) -> LiveConfig:
    """Read and validate a config file; errors name the file, the line and the field."""
    return load_model(LiveConfig, path)
