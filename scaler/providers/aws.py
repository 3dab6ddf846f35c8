"""AWS node pools: EC2 Auto Scaling groups and EKS managed node groups, through boto3.

Each pool is bound to one Auto Scaling group, or to one EKS managed node group (whose
instances live in the Auto Scaling group EKS made for it). Growing sets the desired capacity
(the group's, or the node group's scalingConfig through EKS); removing a node terminates
that instance with `ShouldDecrementDesiredCapacity=True`, so the instance the planner chose
goes and no replacement comes, as Cluster Autoscaler does on AWS. A desired capacity
above the instances (launches refused for InsufficientInstanceCapacity, which the group
retries) can be lowered as far as the instances serving or booting, which terminates none.

Credentials come from boto3's standard chain (environment, shared files, instance or pod
role); `endpoint_url` points every client at one endpoint (moto in tests, a VPC endpoint in
production). Throttling (`Throttling`, `RequestLimitExceeded`, ...) and 5xx answers are
retried by botocore's standard retry mode (exponential backoff with full jitter); a group
busy with another scaling activity, or a node group with an update in progress, is retried
here with the same kind of backoff. Whatever still fails becomes `ProviderError`, with any
credential material scrubbed from the message.

State is read once per `refresh()` (a few describe calls for all pools), and again for one
group right before and after each change, so a change is computed from the cloud's current
numbers and the group reports what the change did.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, InvalidRegionError
from botocore.utils import is_valid_endpoint_url, validate_region_name
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scaler.cluster.pools import NodePool
from scaler.providers.base import Node, NodeStatus, ProviderError
from scaler.providers.pool_group import CloudStateGroup

T = TypeVar("T")

# Answers that mean "not now": another scaling activity or node-group update is running.
BUSY_ERROR_CODES = frozenset({"ScalingActivityInProgress", "ResourceInUseException"})
BOOTING_STATES = frozenset({"Pending", "Pending:Wait", "Pending:Proceed"})
SERVING_STATES = BOOTING_STATES | {"InService"}

_SECRETS = (
    re.compile(r"\b(?:AKIA|ASIA|AROA|AIDA)[A-Z0-9]{12,}\b"),
    re.compile(r"(Credential|Signature|X-Amz-Security-Token|X-Amz-Credential)=[^,&\s\"']+", re.I),
    re.compile(r"(aws_secret_access_key|aws_session_token)\s*[=:]\s*\S+", re.I),
)


def scrub(text: str) -> str:
    """The text with access key ids, signatures and session tokens blanked out."""
    text = _SECRETS[0].sub("<redacted>", text)
    for pattern in _SECRETS[1:]:
        text = pattern.sub(lambda m: f"{m.group(1)}=<redacted>", text)
    return text


def provider_id(zone: str, instance_id: str) -> str:
    """The Kubernetes `spec.providerID` of an EC2 instance, as the AWS cloud provider sets it."""
    return f"aws:///{zone}/{instance_id}"


class AwsPoolBinding(BaseModel):
    """Which AWS resource backs a pool: an Auto Scaling group, or an EKS managed node group."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pool: str = Field(min_length=1)
    auto_scaling_group: str | None = Field(default=None, min_length=1)
    eks_cluster: str | None = Field(default=None, min_length=1)
    eks_nodegroup: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_backing(self) -> AwsPoolBinding:
        eks = (self.eks_cluster, self.eks_nodegroup)
        if self.auto_scaling_group is not None:
            if any(part is not None for part in eks):
                raise ValueError("give auto_scaling_group or eks_cluster/eks_nodegroup, not both")
        elif None in eks:
            raise ValueError("give auto_scaling_group, or both eks_cluster and eks_nodegroup")
        return self


class AwsSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    region: str | None = Field(default=None, description="none: from the credential chain")
    endpoint_url: str | None = Field(default=None, description="one endpoint for all services")
    bindings: tuple[AwsPoolBinding, ...] = Field(min_length=1)
    max_attempts: int = Field(
        default=8, ge=1, description="tries per call on throttling and 5xx (botocore standard)"
    )
    busy_attempts: int = Field(default=6, ge=1, description="tries while a group is busy")
    busy_backoff_s: float = Field(default=1.0, ge=0, description="first busy backoff ceiling")
    busy_backoff_max_s: float = Field(default=20.0, ge=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(default=30.0, gt=0)

    # botocore's own checks, run when the config is read rather than when the clients are
    # made: there a bad value ends the start in a traceback.
    @field_validator("region")
    @classmethod
    def _region_named(cls, value: str | None) -> str | None:
        try:
            validate_region_name(value)
        except InvalidRegionError:
            raise ValueError(f"not a region name: {value!r}") from None
        return value

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_is_url(cls, value: str | None) -> str | None:
        if value is not None and not is_valid_endpoint_url(value):
            raise ValueError(f"not an endpoint URL (scheme and host): {value!r}")
        return value

    @model_validator(mode="after")
    def _unique_pools(self) -> AwsSettings:
        names = [b.pool for b in self.bindings]
        if len(set(names)) != len(names):
            raise ValueError("a pool is bound twice")
        return self


@dataclass(frozen=True, slots=True)
class _Instance:
    id: str
    zone: str
    lifecycle: str


@dataclass(frozen=True, slots=True)
class _GroupState:
    desired: int
    min_size: int  # the cloud's own bounds; the pool's are applied on top
    max_size: int
    instances: tuple[_Instance, ...]  # serving or booting only


class AwsCloud:
    """A `CloudProvider` over EC2 Auto Scaling and EKS."""

    def __init__(
        self,
        pools: Sequence[NodePool],
        settings: AwsSettings,
        session: boto3.session.Session | None = None,
        rng: random.Random | None = None,
    ) -> None:
        by_name = {p.name: p for p in pools}
        unknown = [b.pool for b in settings.bindings if b.pool not in by_name]
        if unknown:
            raise ProviderError(f"bound pools not in the pool list: {', '.join(unknown)}")
        self.settings = settings
        # Backoff jitter, not a secret.
        self._rng = rng or random.Random()  # nosec B311
        session = session or boto3.session.Session(region_name=settings.region)
        config = Config(
            retries={"mode": "standard", "total_max_attempts": settings.max_attempts},
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.read_timeout_s,
            user_agent_extra="gpuscale",
        )

        def client(service: str) -> Any:
            return session.client(service, endpoint_url=settings.endpoint_url, config=config)

        try:
            self._autoscaling = client("autoscaling")
            self._ec2 = client("ec2")
            uses_eks = any(b.eks_cluster for b in settings.bindings)
            self._eks = client("eks") if uses_eks else None
        except (BotoCoreError, ValueError) as exc:  # ValueError: botocore's invalid endpoint
            raise ProviderError(scrub(f"cannot create AWS clients: {exc}")) from None
        self._groups = {b.pool: AwsNodeGroup(self, by_name[b.pool], b) for b in settings.bindings}
        self._launched: dict[str, datetime] = {}  # instance id -> launch time (never changes)

    # CloudProvider ---------------------------------------------------------------
    def name(self) -> str:
        return "aws"

    def node_groups(self) -> list[AwsNodeGroup]:
        return list(self._groups.values())

    def node_group_for(self, node_name: str) -> AwsNodeGroup | None:
        for group in self._groups.values():
            if group._instance(node_name) is not None:
                return group
        return None

    def refresh(self) -> None:
        states = self._read(list(self._groups.values()))
        for group in self._groups.values():
            group._state = states[group.id()]

    def provider_id(self, instance_id: str) -> str:
        """The Kubernetes providerID of a node this cloud holds."""
        for group in self._groups.values():
            instance = group._instance(instance_id)
            if instance is not None:
                return provider_id(instance.zone, instance.id)
        raise ProviderError(f"no node group holds instance {instance_id}")

    # Calls -------------------------------------------------------------------------
    def _call(self, what: str, action: Callable[[], T]) -> T:
        """Run one AWS call; busy answers are retried with jittered exponential backoff
        (throttling and 5xx were already retried inside botocore)."""
        s = self.settings
        for attempt in range(s.busy_attempts):
            try:
                return action()
            except ClientError as exc:
                error = exc.response.get("Error", {})
                code = str(error.get("Code", "Unknown"))
                if code in BUSY_ERROR_CODES and attempt + 1 < s.busy_attempts:
                    ceiling = min(s.busy_backoff_max_s, s.busy_backoff_s * 2**attempt)
                    time.sleep(self._rng.uniform(0, ceiling))
                    continue
                message = error.get("Message") or str(exc)
                raise ProviderError(scrub(f"{what}: {code}: {message}")) from None
            except BotoCoreError as exc:
                raise ProviderError(scrub(f"{what}: {exc}")) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _read(self, groups: Sequence[AwsNodeGroup]) -> dict[str, _GroupState]:
        """Describe the groups: node groups first (for their bounds and ASG names), then all
        their Auto Scaling groups at once, then the launch times of instances not seen yet."""
        scaling: dict[str, tuple[int, int, int]] = {}  # pool -> (desired, min, max) of EKS
        asg_names: dict[str, tuple[str, ...]] = {}
        for group in groups:
            b = group.binding
            if b.auto_scaling_group is not None:
                asg_names[group.id()] = (b.auto_scaling_group,)
                continue
            nodegroup = self._describe_nodegroup(b)
            config = nodegroup.get("scalingConfig", {})
            scaling[group.id()] = (
                int(config.get("desiredSize", 0)),
                int(config.get("minSize", 0)),
                int(config.get("maxSize", 0)),
            )
            names = [a["name"] for a in nodegroup.get("resources", {}).get("autoScalingGroups", [])]
            asg_names[group.id()] = tuple(names)
        described = self._describe_asgs({n for names in asg_names.values() for n in names})
        self._learn_launch_times(
            i["InstanceId"]
            for asg in described.values()
            for i in asg.get("Instances", [])
            if i["LifecycleState"] in SERVING_STATES
        )
        states: dict[str, _GroupState] = {}
        for group in groups:
            names = asg_names[group.id()]
            instances = tuple(
                _Instance(i["InstanceId"], i["AvailabilityZone"], i["LifecycleState"])
                for name in names
                for i in described[name].get("Instances", [])
                if i["LifecycleState"] in SERVING_STATES
            )
            if group.id() in scaling:
                desired, low, high = scaling[group.id()]
            else:
                (asg,) = (described[n] for n in names)
                desired, low, high = asg["DesiredCapacity"], asg["MinSize"], asg["MaxSize"]
            states[group.id()] = _GroupState(desired, low, high, instances)
        return states

    def _describe_nodegroup(self, binding: AwsPoolBinding) -> dict[str, Any]:
        assert self._eks is not None
        eks = self._eks
        what = f"{binding.pool}: describe EKS node group {binding.eks_nodegroup}"
        answer = self._call(
            what,
            lambda: eks.describe_nodegroup(
                clusterName=binding.eks_cluster, nodegroupName=binding.eks_nodegroup
            ),
        )
        return answer["nodegroup"]

    def _describe_asgs(self, names: set[str]) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        ordered = sorted(names)
        for start in range(0, len(ordered), 50):
            chunk = ordered[start : start + 50]

            def page(chunk: list[str] = chunk) -> list[dict[str, Any]]:
                pages = self._autoscaling.get_paginator("describe_auto_scaling_groups")
                return [
                    asg
                    for answer in pages.paginate(AutoScalingGroupNames=chunk)
                    for asg in answer["AutoScalingGroups"]
                ]

            for asg in self._call("describe auto scaling groups", page):
                found[asg["AutoScalingGroupName"]] = asg
        missing = [n for n in ordered if n not in found]
        if missing:
            raise ProviderError(f"auto scaling groups not found: {', '.join(missing)}")
        return found

    def _learn_launch_times(self, instance_ids: Iterable[str]) -> None:
        new = sorted(set(instance_ids) - self._launched.keys())
        for start in range(0, len(new), 200):
            chunk = new[start : start + 200]

            def page(chunk: list[str] = chunk) -> list[dict[str, Any]]:
                pages = self._ec2.get_paginator("describe_instances")
                return [
                    instance
                    for answer in pages.paginate(InstanceIds=chunk)
                    for reservation in answer["Reservations"]
                    for instance in reservation["Instances"]
                ]

            for instance in self._call("describe instances", page):
                self._launched[instance["InstanceId"]] = instance["LaunchTime"]

    def _set_desired(self, group: AwsNodeGroup, desired: int) -> None:
        b = group.binding
        if b.auto_scaling_group is not None:
            self._call(
                f"{b.pool}: set desired capacity of {b.auto_scaling_group} to {desired}",
                lambda: self._autoscaling.set_desired_capacity(
                    AutoScalingGroupName=b.auto_scaling_group,
                    DesiredCapacity=desired,
                    HonorCooldown=False,
                ),
            )
            return
        assert self._eks is not None
        eks = self._eks
        self._call(
            f"{b.pool}: set desired size of EKS node group {b.eks_nodegroup} to {desired}",
            lambda: eks.update_nodegroup_config(
                clusterName=b.eks_cluster,
                nodegroupName=b.eks_nodegroup,
                scalingConfig={"desiredSize": desired},
            ),
        )

    def _terminate(self, pool: str, instance_id: str) -> None:
        self._call(
            f"{pool}: terminate {instance_id}",
            lambda: self._autoscaling.terminate_instance_in_auto_scaling_group(
                InstanceId=instance_id, ShouldDecrementDesiredCapacity=True
            ),
        )


class AwsNodeGroup(CloudStateGroup[_GroupState]):
    """One pool backed by an Auto Scaling group or an EKS managed node group (a `NodeGroup`).

    Its bounds are the tighter of the pool's and the cloud's own."""

    def __init__(self, cloud: AwsCloud, pool: NodePool, binding: AwsPoolBinding) -> None:
        super().__init__(pool)
        self._cloud = cloud
        self.binding = binding

    def min_size(self) -> int:
        return max(self._pool.min_size, self._current().min_size)

    def max_size(self) -> int:
        return min(self._pool.max_size, self._current().max_size)

    def target_size(self) -> int:
        return self._current().desired

    def _max_reason(self) -> str:
        if self._current().max_size >= self._pool.max_size:
            return super()._max_reason()
        b = self.binding
        if b.auto_scaling_group is not None:
            return f"the MaxSize of Auto Scaling group {b.auto_scaling_group}"
        return f"the maxSize of EKS node group {b.eks_nodegroup}"

    def delete_nodes(self, names: Sequence[str]) -> None:
        target = self._shrunk_target(names)
        try:
            self._remove_each(names, lambda n: self._cloud._terminate(self.id(), n), "terminated")
            if self.binding.eks_nodegroup is not None:
                # The Auto Scaling group already shrank; tell EKS the same number so its
                # record agrees at once (an absolute size: nothing more is launched or
                # terminated for it).
                self._cloud._set_desired(self, target)
        finally:
            self._reload()

    def nodes(self) -> list[Node]:
        state = self._current()
        return [
            Node(
                name=i.id,
                pool=self.id(),
                status=NodeStatus.BOOTING if i.lifecycle in BOOTING_STATES else NodeStatus.READY,
                launched_at=self._cloud._launched[i.id],
                ready_at=(
                    self._cloud._launched[i.id] + timedelta(seconds=self._pool.boot_seconds)
                    if i.lifecycle in BOOTING_STATES
                    else None
                ),
            )
            for i in state.instances
        ]

    # Internals used by the cloud ----------------------------------------------------------
    def _read(self) -> _GroupState:
        return self._cloud._read([self])[self.id()]

    def _set_target(self, target: int) -> None:
        self._cloud._set_desired(self, target)

    def _holds(self, name: str) -> bool:
        return self._instance(name) is not None

    def _instance(self, instance_id: str) -> _Instance | None:
        for instance in self._current().instances:
            if instance.id == instance_id:
                return instance
        return None
