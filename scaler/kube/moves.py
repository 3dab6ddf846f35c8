"""Moves that defragmentation planned, carried on their target nodes for the extender.

Defragmentation moves a pod by evicting it: its controller (ReplicaSet, StatefulSet, Job)
creates a new pod, and the scheduler extender steers that pod onto the planned node. The
new pod has a new name and uid, so a move names what it shares with the evicted one: the
namespace, the controller's uid and the shape of the request (CPU, memory, GPUs and the
share of each). The moves ride on the target node as one annotation
(`KubeNames.moves_annotation`, a JSON list): the extender reads nodes anyway (from the
listing, or the nodes kube-scheduler sends it), so steering needs no other object and no
other permission, and `kubectl describe node` shows what is on its way there. A move
expires; expired moves steer nothing and the next defragmentation run drops them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KUBE_NAMES, KubeNames, PodRequest
from scaler.cluster.job import Job
from scaler.kube.errors import kube_call

Shape = tuple[int, int, int, int]  # cpu_milli, memory_mib, num_gpu, gpu_milli


def shape_of(job: Job) -> Shape:
    return (job.cpu_milli, job.memory_mib, job.num_gpu, job.gpu_milli)


@dataclass(frozen=True, slots=True)
class PlannedMove:
    id: str  # the evicted pod (namespace/name) and when it was planned: one per move
    namespace: str
    controller_uid: str
    controller: str  # kind/name, for people
    shape: Shape
    gpus: tuple[int, ...]  # the GPU indices planned on the target
    at: float  # Unix time it was planned
    expires: float  # Unix time after which it steers nothing

    def live(self, now: float) -> bool:
        return self.at <= now + 60 and now < self.expires  # a minute of clock skew allowed

    def matches(self, pod: PodRequest, job: Job) -> bool:
        """Whether `pod` (read as `job`) is a pod this move is for: one its controller
        made, asking the same."""
        return (
            pod.namespace == self.namespace
            and pod.controller_uid == self.controller_uid
            and shape_of(job) == self.shape
        )

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> PlannedMove:
        """Raises KeyError, TypeError or ValueError on an entry that is not a move."""
        shape = tuple(int(x) for x in value["shape"])
        if len(shape) != 4:
            raise ValueError(f"a move's shape has 4 numbers, got {len(shape)}")
        return cls(
            id=str(value["id"]),
            namespace=str(value["namespace"]),
            controller_uid=str(value["controller_uid"]),
            controller=str(value.get("controller", "")),
            shape=(shape[0], shape[1], shape[2], shape[3]),
            gpus=tuple(int(g) for g in value["gpus"]),
            at=float(value["at"]),
            expires=float(value["expires"]),
        )


def read_moves(annotations: Mapping[str, str], names: KubeNames = KUBE_NAMES) -> list[PlannedMove]:
    """The moves a node's annotations carry. Entries that are not moves are skipped: a
    hand-edited annotation must not break the listing it is read in."""
    text = annotations.get(names.moves_annotation)
    if not text:
        return []
    try:
        entries = json.loads(text)
    except ValueError:
        return []
    moves = []
    for entry in entries if isinstance(entries, list) else []:
        try:
            moves.append(PlannedMove.from_json(entry))
        except (KeyError, TypeError, ValueError):
            continue
    return moves


def moves_patch(moves: Iterable[PlannedMove], names: KubeNames = KUBE_NAMES) -> dict[str, Any]:
    """A merge patch setting a node's moves (removing the annotation when there are none)."""
    entries = [asdict(m) for m in moves]  # the fields are the JSON: `from_json` reads them
    value = json.dumps(entries, sort_keys=True, separators=(",", ":")) if entries else None
    return {"metadata": {"annotations": {names.moves_annotation: value}}}


def set_moves(
    api: k8s.ApiClient, node: str, moves: Iterable[PlannedMove], names: KubeNames = KUBE_NAMES
) -> None:
    """Write `moves` as the node's planned moves (all of them: read, merge, then write).
    Raises KubeError."""
    core = k8s.CoreV1Api(api)
    patch = moves_patch(moves, names)
    kube_call(f"note planned moves on node {node}", lambda: core.patch_node(node, patch))
