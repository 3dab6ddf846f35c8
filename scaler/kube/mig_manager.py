"""The GPU operator's MIG manager, as defragmentation asks it to repartition a node.

NVIDIA's GPU operator runs a MIG manager on every MIG-capable node it manages and marks
those nodes with the label `nvidia.com/mig.config` (the operator sets it to its default,
`all-disabled`, where none is given). Setting that label to the name of a config of the
cluster's mig-parted file makes the MIG manager apply it: it reports
`nvidia.com/mig.config.state` `pending`, pauses the operator's GPU pods on the node (device
plugin, feature discovery, DCGM and its exporter), runs `nvidia-mig-parted apply`, brings
them back and reports `success`, or `failed`; a change of MIG mode may reboot the node
(`rebooting`). It evicts no workload: mig-parted leaves every GPU whose instance counts
already match alone and clears every other one, so pods on the GPUs it changes would lose
their instances. gpuscale therefore asks only for changes whose GPUs are idle
(`scaler.cluster.mig_parted`, `scaler.placement.repartition`) and, just before asking,
lists the node's pods again (`node_pods`, `gpus_in_use`).

`request_config` sets the config label and, in the same patch, the state to `pending`: the
`success` it then waits for is this change's, not the one the label kept from the last
change (the MIG manager sets the state itself from there on). While the device plugin is
paused nothing new starts on the node's GPUs; pods on the GPUs the change keeps run on.

After `success` the node's instance counts are the config's; where the node carries
gpuscale's layout annotation, `layout_annotation` rewrites the changed GPUs in it (their
instances without starts: where NVML put them is not known from here).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from pydantic import BaseModel, ConfigDict, Field

from predictor.telemetry.kube_objects import KUBE_NAMES, KubeNames, PodRequest, read_pod
from scaler.cluster.mig import MigLayout
from scaler.cluster.mig_parted import MigConfigEntry
from scaler.kube.errors import kube_call
from scaler.kube.observed import UNFINISHED

CONFIG_LABEL = "nvidia.com/mig.config"
STATE_LABEL = "nvidia.com/mig.config.state"
UNDER_WAY = frozenset({"pending", "rebooting"})
SUCCESS = "success"
FAILED = "failed"


class MigManagerSettings(BaseModel):
    """`defrag.mig`: the cluster's mig-parted configs, and how long a pass waits for the
    MIG manager to apply one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    configs: dict[str, tuple[MigConfigEntry, ...]] = Field(
        default_factory=dict,
        description="the `mig-configs` of the mig-parted file the GPU operator's MIG manager"
        " applies (its ConfigMap's config.yaml), by name; none: no repartitioning",
    )
    wait_s: float = Field(
        default=600.0,
        ge=0,
        description="how long a pass waits for the MIG manager to report success or failed;"
        " a change still under way then is settled by a later pass",
    )
    poll_s: float = Field(default=5.0, gt=0, description="how often the state is read meanwhile")


@dataclass(frozen=True, slots=True)
class MigManagedNode:
    """A node the MIG manager manages, as its labels say."""

    name: str
    config: str  # the config its label names
    state: str  # as the MIG manager last reported it ("" before it has)
    layout_annotation: str | None  # gpuscale's MIG layout annotation, if the node has one

    @property
    def under_way(self) -> bool:
        return self.state in UNDER_WAY


def _managed(node: Mapping[str, Any], names: KubeNames) -> MigManagedNode:
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    return MigManagedNode(
        name=str(meta.get("name", "")),
        config=str(labels.get(CONFIG_LABEL, "")),
        state=str(labels.get(STATE_LABEL, "")),
        layout_annotation=annotations.get(names.mig_layout_annotation) or None,
    )


def managed_nodes(api: k8s.ApiClient, names: KubeNames = KUBE_NAMES) -> dict[str, MigManagedNode]:
    """The nodes that carry the config label, by name. Raises KubeError."""
    core = k8s.CoreV1Api(api)
    found = kube_call(
        "read the MIG manager's nodes", lambda: core.list_node(label_selector=CONFIG_LABEL)
    )
    as_json = api.sanitize_for_serialization
    return {m.name: m for m in (_managed(as_json(n), names) for n in found.items or [])}


def read_managed(api: k8s.ApiClient, node: str, names: KubeNames = KUBE_NAMES) -> MigManagedNode:
    """One node's config, state and layout annotation now. Raises KubeError."""
    core = k8s.CoreV1Api(api)
    found = kube_call(f"read node {node}", lambda: core.read_node(node))
    return _managed(api.sanitize_for_serialization(found), names)


def request_config(api: k8s.ApiClient, node: str, config: str) -> None:
    """Ask the MIG manager to apply `config` on `node` (see the module docstring).
    Raises KubeError."""
    core = k8s.CoreV1Api(api)
    patch = {"metadata": {"labels": {CONFIG_LABEL: config, STATE_LABEL: "pending"}}}
    kube_call(f"set {CONFIG_LABEL}={config} on node {node}", lambda: core.patch_node(node, patch))


def write_layout(api: k8s.ApiClient, node: str, text: str, names: KubeNames = KUBE_NAMES) -> None:
    """Set the node's MIG layout annotation. Raises KubeError."""
    core = k8s.CoreV1Api(api)
    patch = {"metadata": {"annotations": {names.mig_layout_annotation: text}}}
    kube_call(f"note the MIG layout of node {node}", lambda: core.patch_node(node, patch))


def node_pods(api: k8s.ApiClient, node: str, names: KubeNames = KUBE_NAMES) -> list[PodRequest]:
    """The pods bound to `node` that have not finished, listed now. Raises KubeError."""
    core = k8s.CoreV1Api(api)
    selector = f"spec.nodeName={node},{UNFINISHED}"
    found = kube_call(
        f"read the pods of node {node}",
        lambda: core.list_pod_for_all_namespaces(field_selector=selector),
    )
    as_json = api.sanitize_for_serialization
    return [read_pod(as_json(p), names) for p in found.items or []]


def gpus_in_use(layout: MigLayout, pods: Iterable[PodRequest]) -> dict[int, str]:
    """The node's MIG GPUs that `pods` (those bound to it) may hold instances of, each with
    the first pod found there. A pod whose instances our bind recorded holds those; one
    bound without the extender says only its profile, so every GPU with an instance of that
    profile (every MIG GPU, where none has) may be the one."""
    used: dict[int, str] = {}
    for pod in pods:
        if pod.finished or not pod.mig:
            continue
        for gpu, why in _held(layout, pod):
            used.setdefault(gpu, why)
    return used


def _held(layout: MigLayout, pod: PodRequest) -> list[tuple[int, str]]:
    instances = layout.instances
    if len(pod.mig) == 1 and pod.gpu_indices is not None:
        profile, count = pod.mig[0]
        indices = pod.gpu_indices
        if len(indices) == count and all(
            0 <= k < len(instances) and instances[k].profile == profile for k in indices
        ):
            return [
                (
                    instances[k].gpu,
                    f"{pod.id} runs on {instances[k].text} of GPU {instances[k].gpu}",
                )
                for k in indices
            ]
    out = []
    for profile, _ in pod.mig:
        gpus = sorted({i.gpu for i in instances if i.profile == profile}) or list(layout.gpus)
        why = f"{pod.id} runs on a {profile} instance of the node, not recorded which"
        out += [(gpu, why) for gpu in gpus]
    return out


def layout_annotation(text: str, changed: str) -> str:
    """The layout annotation `text` with the GPUs that `changed` writes (a repartition's
    layout after, in the same notation) written anew, their starts left out; a GPU with no
    instance left is dropped."""
    parts = _by_gpu(text)
    for gpu, made in _by_gpu(changed).items():
        parts[gpu] = ",".join(item.partition("@")[0] for item in made.split(",") if item)
    return ";".join(f"{gpu}={rest}" for gpu, rest in sorted(parts.items()) if rest)


def _by_gpu(text: str) -> dict[int, str]:
    """A layout's parts (`GPU=instances;...`) by GPU. ValueError where a GPU is no number."""
    parts: dict[int, str] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        gpu, _, rest = part.partition("=")
        parts[int(gpu)] = rest
    return parts
