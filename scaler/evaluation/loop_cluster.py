"""A large cluster in JSON form, as an API server would serve it, for `gpuscale bench loop`.

N nodes: a third CPU nodes (96 cores, pool `cpu`), the rest 8-GPU nodes of two pools
(`a100`, `h100`), each GPU node carrying the GPU model label and its pool label, and one
DaemonSet pod per node (the node's overhead). M pods in all, about thirty a node at the
issue's sizes, most of them ordinary non-GPU pods (a ReplicaSet's, bound, running); one in
twenty holds GPUs, about 70% of the cluster's GPUs in all: whole GPUs of mixed shapes (1,
2, 4, 8), GPU-sharing pods (the share annotation, one GPU), and gangs (several 8-GPU pods
of one Job); a few of each kind wait unbound for room. The same seed gives the same
cluster.

`ClusterChurn` makes the changes between two passes: pods created (bound and pending),
pods finishing (deleted from the unfinished pods' view), pods changed (a label), nodes
added.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from predictor.telemetry.kube_objects import KUBE_NAMES

Obj = dict[str, Any]
GPU_MODELS = {"a100": "NVIDIA-A100-SXM4-80GB", "h100": "NVIDIA-H100-80GB-HBM3"}


def node_object(name: str, pool: str, rng: random.Random, cloud_name: str | None = None) -> Obj:
    labels = {KUBE_NAMES.pool_label: pool, "kubernetes.io/hostname": name}
    allocatable = {"cpu": "96", "memory": "768Gi", "pods": "250"}
    if pool in GPU_MODELS:
        labels[KUBE_NAMES.gpu_model_label] = GPU_MODELS[pool]
        allocatable[KUBE_NAMES.gpu_resource] = "8"
    return {
        "metadata": {"name": name, "labels": labels, "annotations": {}},
        "spec": {"providerID": f"sim:///{pool}/{cloud_name or name}"},
        "status": {
            "allocatable": allocatable,
            "capacity": allocatable,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def pod_object(
    name: str,
    namespace: str,
    *,
    node: str | None,
    cpu: str,
    memory: str,
    gpus: int = 0,
    share: int | None = None,
    pool: str | None = None,
    owner: tuple[str, str] = ("ReplicaSet", "web"),
) -> Obj:
    requests: Obj = {"cpu": cpu, "memory": memory}
    if gpus:
        requests[KUBE_NAMES.gpu_resource] = str(gpus)
    annotations = {KUBE_NAMES.gpu_milli_annotation: str(share)} if share is not None else {}
    spec: Obj = {
        "containers": [{"name": "main", "image": "busybox", "resources": {"requests": requests}}],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}] if gpus else [],
    }
    if pool is not None:
        spec["nodeSelector"] = {KUBE_NAMES.pool_label: pool}
    if node is not None:
        spec["nodeName"] = node
    kind, owner_name = owner
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app": owner_name},
            "annotations": annotations,
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1" if kind == "Job" else "apps/v1",
                    "kind": kind,
                    "name": owner_name,
                    "uid": f"uid-{owner_name}",
                    "controller": True,
                }
            ],
        },
        "spec": spec,
        "status": {"phase": "Running" if node is not None else "Pending"},
    }


@dataclass
class GeneratedCluster:
    nodes: list[Obj]
    pods: list[Obj]

    @property
    def gpu_pods(self) -> int:
        return sum(
            1
            for p in self.pods
            if KUBE_NAMES.gpu_resource in p["spec"]["containers"][0]["resources"]["requests"]
        )


@dataclass
class _Room:
    """What is left on each node while the generator binds pods (CPU milli, free GPUs)."""

    cpu: dict[str, int] = field(default_factory=dict)
    gpus: dict[str, int] = field(default_factory=dict)


def pool_sizes(nodes: int) -> dict[str, int]:
    """How many of `nodes` each pool gets (`generate_cluster`'s split)."""
    pools = [_pool(i) for i in range(nodes)]
    return {pool: pools.count(pool) for pool in ("cpu", "a100", "h100")}


def _pool(i: int) -> str:
    return "cpu" if i % 3 == 0 else ("a100" if i % 3 == 1 else "h100")


def generate_cluster(
    nodes: int, pods: int, seed: int = 0, cloud_names: dict[str, list[str]] | None = None
) -> GeneratedCluster:
    """`nodes` nodes and `pods` pods in all (DaemonSet pods included), see the module
    docstring. `cloud_names`: the provider's names of each pool's nodes, in order (their
    providerIDs end in them, so the loop matches them to the provider's nodes)."""
    # A seeded synthetic cluster, not a secret.
    rng = random.Random(seed)  # nosec B311
    names = [f"node-{i:05d}" for i in range(nodes)]
    pools = [_pool(i) for i in range(nodes)]
    given = {pool: iter(found) for pool, found in (cloud_names or {}).items()}
    node_objs = [
        node_object(n, p, rng, next(given[p], None) if p in given else None)
        for n, p in zip(names, pools, strict=True)
    ]
    room = _Room(
        cpu={n: 95_000 for n in names},
        gpus={n: 8 for n, p in zip(names, pools, strict=True) if p != "cpu"},
    )
    out: list[Obj] = []
    for n in names:  # the node's overhead
        out.append(
            pod_object(
                f"agent-{n}",
                "monitoring",
                node=n,
                cpu="200m",
                memory="256Mi",
                owner=("DaemonSet", "agent"),
            )
        )
        room.cpu[n] -= 200
    gpu_nodes = sorted(room.gpus)
    left = pods - len(out)
    gpu_share = left // 20
    counter = 0

    def bind_gpu(want: int, cpu_milli: int) -> str | None:
        for _ in range(64):
            n = rng.choice(gpu_nodes)
            if room.gpus[n] >= want and room.cpu[n] >= cpu_milli:
                room.gpus[n] -= want
                room.cpu[n] -= cpu_milli
                return n
        return None

    # GPU pods: mixed whole shapes, sharing pods and gangs; those with no room wait.
    made = 0
    while made < gpu_share and gpu_nodes:
        counter += 1
        kind = rng.random()
        if kind < 0.02:  # a gang: 2-4 pods of 8 GPUs, of one Job
            size = rng.randint(2, 4)
            gang = f"gang-{counter}"
            pool = rng.choice(("a100", "h100"))
            for k in range(size):
                node = bind_gpu(8, 8000)
                out.append(
                    pod_object(
                        f"{gang}-{k}",
                        "training",
                        node=node,
                        cpu="8",
                        memory="64Gi",
                        gpus=8,
                        pool=pool,
                        owner=("Job", gang),
                    )
                )
            made += size
            continue
        if kind < 0.22:  # a sharing pod
            node = bind_gpu(1, 1000) if rng.random() < 0.98 else None
            out.append(
                pod_object(
                    f"share-{counter}",
                    "inference",
                    node=node,
                    cpu="1",
                    memory="8Gi",
                    gpus=1,
                    share=rng.choice((250, 500)),
                    owner=("ReplicaSet", "serve"),
                )
            )
        else:
            want = rng.choice((1, 1, 1, 1, 2, 2, 4, 8))
            node = bind_gpu(want, want * 1000) if rng.random() < 0.98 else None
            out.append(
                pod_object(
                    f"train-{counter}",
                    "training",
                    node=node,
                    cpu=str(want),
                    memory="16Gi",
                    gpus=want,
                    pool=rng.choice(("a100", "h100", None)),
                    owner=("Job", f"train-{counter}"),
                )
            )
        made += 1
    # The rest: ordinary pods, bound, a few waiting.
    while len(out) < pods:
        counter += 1
        cpu = rng.choice((100, 250, 500, 1000, 2000))
        node = None
        if rng.random() < 0.998:
            for _ in range(8):
                candidate = names[rng.randrange(nodes)]
                if room.cpu[candidate] >= cpu:
                    node = candidate
                    room.cpu[candidate] -= cpu
                    break
        out.append(
            pod_object(
                f"web-{counter}",
                f"team-{counter % 50}",
                node=node,
                cpu=f"{cpu}m",
                memory=f"{rng.choice((128, 256, 512, 1024))}Mi",
            )
        )
    return GeneratedCluster(node_objs, out)


@dataclass
class ClusterChurn:
    """The changes between passes, drawn from `seed`: per pass `created` pods (bound where
    there is room, else pending), `finished` pods, `changed` pods and `nodes_added`."""

    cluster: GeneratedCluster
    seed: int = 0
    created: int = 50
    finished: int = 50
    changed: int = 20
    nodes_added: int = 1

    def __post_init__(self) -> None:
        # Seeded churn, not a secret.
        self.rng = random.Random(self.seed)  # nosec B311
        self.serial = 0
        self.live = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in self.cluster.pods}
        self.node_names = [n["metadata"]["name"] for n in self.cluster.nodes]

    def step(self) -> tuple[list[Obj], list[tuple[str, str]], list[Obj], list[Obj]]:
        """(pods to create, (namespace, name) of pods to delete, pods to replace as
        changed, nodes to create)."""
        self.serial += 1
        rng = self.rng
        nodes = []
        for k in range(self.nodes_added):
            name = f"node-new-{self.serial:04d}-{k}"
            nodes.append(node_object(name, rng.choice(("a100", "h100")), rng))
            self.node_names.append(name)
        created = []
        for k in range(self.created):
            gpus = rng.choice((0, 0, 0, 1, 2))
            node = rng.choice(self.node_names) if gpus == 0 else None
            created.append(
                pod_object(
                    f"churn-{self.serial}-{k}",
                    "churn",
                    node=node,
                    cpu="500m",
                    memory="1Gi",
                    gpus=gpus,
                    pool="a100" if gpus else None,
                    owner=("ReplicaSet", "churn"),
                )
            )
        candidates = sorted(k for k in self.live if k[0] != "monitoring")
        gone = rng.sample(candidates, min(self.finished, len(candidates)))
        self.live.difference_update(gone)
        self.live.update((p["metadata"]["namespace"], p["metadata"]["name"]) for p in created)
        changed = [
            key
            for key in rng.sample(sorted(self.live - set(gone)), self.changed)
            if key[0] != "monitoring"
        ]
        return created, gone, [{"key": key, "label": f"v{self.serial}"} for key in changed], nodes
