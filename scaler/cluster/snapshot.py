"""The cluster as the placement engine sees it: nodes, their free CPU, memory and GPU shares.

Everything per node lives in numpy arrays so a policy scores all nodes at once. GPUs are
addressed by index on their node; `gpu_free[n, g]` is the free share of GPU g of node n in
thousandths (1000 = idle), and slots past a node's GPU count stay at 0 so they never fit.
`version[n]` changes whenever node n changes: policies key their per-node caches on it,
so after a placement only the chosen node is recomputed.

Beside the arrays, and only where nodes have them: MIG instances (`mig`, `mig_used`; a MIG
job's `gpus` are indices into its node's `mig[n].instances`), the NVLink / NVSwitch
domains of the GPUs (`gpu_domain`), the rack of each node (`rack_id`, with the jobs
bound per rack) and the price of its GPUs (`gpu_price`). A cluster without them carries
None or empty tables and places as before.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from predictor.telemetry.kube_objects import mig_gpus
from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.limits import MAX_NODE_GPUS
from scaler.cluster.mig import MigLayout

if TYPE_CHECKING:
    import pandas as pd

# Columns of `ClusterState.shape_counts`: 0 counts GPU-sharing jobs, k counts k-GPU jobs.
MAX_SHAPE = 8


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A node's capacity and scheduling attributes; `taints` are `key=value:Effect` strings.

    `gpus` are whole GPUs; `mig` the MIG instances of its partitioned GPUs (the GPU
    operator's "mixed" strategy), numbered apart from them. `gpu_domains` groups the whole
    GPUs' indices into NVLink / NVSwitch domains (none: unknown); `rack` names its rack;
    `price_per_hour` is what its pool pays for it (None: unknown).
    """

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int = 0
    model: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    taints: frozenset[str] = frozenset()
    cordoned: bool = False  # unschedulable: nothing new may be placed here
    mig: MigLayout | None = None
    gpu_domains: tuple[tuple[int, ...], ...] = ()
    rack: str | None = None
    price_per_hour: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.gpus <= MAX_NODE_GPUS:
            raise ValueError(
                f"node {self.name}: {self.gpus} GPUs; a node holds 0 to {MAX_NODE_GPUS}"
            )

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


@dataclass(frozen=True, slots=True)
class Allocation:
    """A job bound to a node: which GPUs it holds and since when (seconds, caller's clock)."""

    job: Job
    node: int
    gpus: tuple[int, ...]
    since_s: float = 0.0

    def gpu_seconds(self, now_s: float) -> float:
        """GPU time the job has run so far: the work lost if it is evicted now."""
        if self.job.mig_profile is not None:
            held = mig_gpus(((self.job.mig_profile, len(self.gpus)),))
        else:
            held = len(self.gpus) * self.job.gpu_milli / WHOLE_GPU_MILLI
        return max(0.0, now_s - self.since_s) * held


@dataclass(eq=False)
class ClusterState:
    """Free and used resources of every node, plus the jobs bound to them.

    Build it with `ClusterState.from_nodes` (or `from_frame` for the openb node list);
    change it only through `bind`, `release`, `set_draining` and `set_cordoned`, which
    keep the derived arrays and `version` consistent.
    """

    names: list[str]
    models: list[str]
    model_id: np.ndarray
    cpu_cap: np.ndarray
    mem_cap: np.ndarray
    gpu_count: np.ndarray
    cpu_free: np.ndarray
    mem_free: np.ndarray
    gpu_free: np.ndarray
    full_free: np.ndarray
    max_free: np.ndarray
    shape_counts: np.ndarray
    draining: np.ndarray
    cordoned: np.ndarray
    labels: list[dict[str, str]]
    taints: list[frozenset[str]]
    version: np.ndarray
    jobs: dict[str, Allocation] = field(default_factory=dict)
    node_jobs: list[set[str]] = field(default_factory=list)
    service_nodes: dict[str, Counter[int]] = field(default_factory=dict)
    tainted: bool = False
    # Memoised per-node data of policies (e.g. fragmentation), keyed by the policy; each
    # entry checks `version` before use, so it is never stale.
    derived: dict[Any, Any] = field(default_factory=dict)
    # MIG nodes' layouts (replaced, never changed in place) and which instances are taken.
    mig: dict[int, MigLayout] = field(default_factory=dict)
    mig_used: dict[int, np.ndarray] = field(default_factory=dict)
    # gpu_domain[n, g]: GPU g's NVLink domain on node n (-1: none); None: no node has any.
    gpu_domain: np.ndarray | None = None
    # rack_id[n]: node n's rack in `racks` (-1: none); None: no node names a rack.
    racks: list[str] = field(default_factory=list)
    rack_id: np.ndarray | None = None
    rack_jobs: np.ndarray | None = None  # jobs bound per rack
    # gpu_price[n]: price of one of node n's GPUs for an hour (NaN: unknown, or no GPUs);
    # None: no node has a price. Never changes, so copies share it.
    gpu_price: np.ndarray | None = None

    @classmethod
    def from_nodes(cls, nodes: Sequence[NodeSpec]) -> ClusterState:
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        models = sorted({n.model for n in nodes if n.gpus > 0})
        index = {m: i for i, m in enumerate(models)}
        width = max(1, max(n.gpus for n in nodes))
        count = np.array([n.gpus for n in nodes], dtype=np.int64)
        gpu_free = np.where(np.arange(width)[None, :] < count[:, None], WHOLE_GPU_MILLI, 0)
        cpu = np.array([n.cpu_milli for n in nodes], dtype=np.int64)
        mem = np.array([n.memory_mib for n in nodes], dtype=np.int64)
        racks = sorted({n.rack for n in nodes if n.rack is not None})
        rack_index = {r: i for i, r in enumerate(racks)}
        state = cls(
            names=names,
            models=models,
            model_id=np.array([index.get(n.model, -1) if n.gpus else -1 for n in nodes]),
            cpu_cap=cpu,
            mem_cap=mem,
            gpu_count=count,
            cpu_free=cpu.copy(),
            mem_free=mem.copy(),
            gpu_free=gpu_free.astype(np.int64),
            full_free=count.copy(),
            max_free=np.where(count > 0, WHOLE_GPU_MILLI, 0).astype(np.int64),
            shape_counts=np.zeros((len(nodes), MAX_SHAPE + 1), dtype=np.int64),
            draining=np.zeros(len(nodes), dtype=bool),
            cordoned=np.array([n.cordoned for n in nodes], dtype=bool),
            labels=[dict(n.labels) for n in nodes],
            taints=[frozenset(n.taints) for n in nodes],
            version=np.zeros(len(nodes), dtype=np.int64),
            node_jobs=[set() for _ in nodes],
            tainted=any(n.taints for n in nodes),
            mig={i: n.mig for i, n in enumerate(nodes) if n.mig is not None and n.mig.instances},
            gpu_domain=_domains(nodes, width),
            racks=racks,
            rack_id=np.array([rack_index.get(n.rack, -1) for n in nodes]) if racks else None,
            rack_jobs=np.zeros(len(racks), dtype=np.int64) if racks else None,
            gpu_price=_gpu_prices(nodes),
        )
        state.mig_used = {i: np.zeros(len(m.instances), dtype=bool) for i, m in state.mig.items()}
        return state

    @classmethod
    def from_frame(cls, frame: pd.DataFrame) -> ClusterState:
        """From a node table with columns sn, cpu_milli, memory_mib, gpu, model."""
        return cls.from_nodes(
            [
                NodeSpec(str(sn), int(cpu), int(mem), int(gpu), str(model))
                for sn, cpu, mem, gpu, model in zip(
                    frame["sn"],
                    frame["cpu_milli"],
                    frame["memory_mib"],
                    frame["gpu"],
                    frame["model"],
                    strict=True,
                )
            ]
        )

    # ------------------------------------------------------------------ queries
    @property
    def size(self) -> int:
        return len(self.names)

    def model_mask(self, models: frozenset[str]) -> np.ndarray:
        """mask[n]: node n has GPUs of one of `models` (any model when empty)."""
        key = ("model-mask", models)
        mask = self.derived.get(key)
        if mask is None:
            allowed = [not models or m in models for m in self.models] + [False]
            mask = np.asarray(allowed)[self.model_id]
            self.derived[key] = mask
        return mask

    @property
    def total_gpu_milli(self) -> int:
        return int(self.gpu_count.sum()) * WHOLE_GPU_MILLI

    @property
    def allocated_gpu_milli(self) -> int:
        return self.total_gpu_milli - int(self.gpu_free.sum())

    def node_index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"no node named {name!r}") from None

    def jobs_on(self, node: int) -> list[Allocation]:
        return [self.jobs[j] for j in sorted(self.node_jobs[node])]

    def is_empty(self, node: int) -> bool:
        return not self.node_jobs[node]

    def mig_free(self, node: int, profile: str) -> list[int]:
        """Indices of node `node`'s free MIG instances of `profile`."""
        layout = self.mig.get(node)
        if layout is None:
            return []
        used = self.mig_used[node]
        return [
            k for k, inst in enumerate(layout.instances) if inst.profile == profile and not used[k]
        ]

    def copy(self) -> ClusterState:
        """An independent state (what-if planning for gangs, preemption, defragmentation)."""
        clone = copy.copy(self)
        for name in (
            "cpu_free",
            "mem_free",
            "gpu_free",
            "full_free",
            "max_free",
            "shape_counts",
            "draining",
            "cordoned",
            "version",
        ):
            setattr(clone, name, getattr(self, name).copy())
        clone.jobs = dict(self.jobs)
        clone.node_jobs = [set(s) for s in self.node_jobs]
        clone.service_nodes = {k: Counter(v) for k, v in self.service_nodes.items()}
        clone.derived = {k: v.copy() for k, v in self.derived.items()}
        if self.mig:
            clone.mig = dict(self.mig)
            clone.mig_used = {k: v.copy() for k, v in self.mig_used.items()}
        if self.rack_jobs is not None:
            clone.rack_jobs = self.rack_jobs.copy()
        return clone

    # ------------------------------------------------------------------ changes
    def bind(self, job: Job, node: int, gpus: Iterable[int], since_s: float = 0.0) -> Allocation:
        """Commit `job` to `node` and GPU indices `gpus` (a MIG job: MIG instance indices);
        raises ValueError if it does not fit."""
        gpus = tuple(int(g) for g in gpus)
        if job.id in self.jobs:
            raise ValueError(f"job {job.id!r} is already bound")
        if job.mig_profile is not None:
            self._check_instances(job, node, gpus)
        elif len(gpus) != job.num_gpu or len(set(gpus)) != len(gpus):
            raise ValueError(f"job {job.id!r} needs {job.num_gpu} distinct GPUs, got {gpus}")
        if self.cpu_free[node] < job.cpu_milli or self.mem_free[node] < job.memory_mib:
            raise ValueError(f"job {job.id!r} does not fit node {self.names[node]!r}")
        if job.mig_profile is None:
            for g in gpus:
                if g >= self.gpu_count[node] or self.gpu_free[node, g] < job.gpu_milli:
                    raise ValueError(f"GPU {g} of node {self.names[node]!r} cannot hold {job.id!r}")
        allocation = Allocation(job, node, gpus, since_s)
        self._apply(allocation, -1)
        self.jobs[job.id] = allocation
        self.node_jobs[node].add(job.id)
        if self.rack_jobs is not None and self.rack_id is not None and self.rack_id[node] >= 0:
            self.rack_jobs[self.rack_id[node]] += 1
        if job.service:
            self.service_nodes.setdefault(job.service, Counter())[node] += 1
        return allocation

    def release(self, job_id: str) -> Allocation:
        """Remove a bound job (finished, evicted or moved) and free what it held."""
        allocation = self.jobs.pop(job_id)
        self._apply(allocation, +1)
        self.node_jobs[allocation.node].discard(job_id)
        rack = -1 if self.rack_id is None else self.rack_id[allocation.node]
        if self.rack_jobs is not None and rack >= 0:
            self.rack_jobs[rack] -= 1
        service = allocation.job.service
        if service:
            replicas = self.service_nodes[service]
            replicas[allocation.node] -= 1
            if replicas[allocation.node] <= 0:
                del replicas[allocation.node]
        return allocation

    def set_draining(self, nodes: Iterable[int], draining: bool = True) -> None:
        """Mark nodes as leaving soon: placement avoids them while other nodes fit."""
        for n in nodes:
            self.draining[n] = draining
            self.version[n] += 1

    def set_cordoned(self, nodes: Iterable[int], cordoned: bool = True) -> None:
        """Mark nodes unschedulable: nothing new is placed there (what a removal does first,
        and what the scale-down check does to the node it simulates away)."""
        for n in nodes:
            self.cordoned[n] = cordoned
            self.version[n] += 1

    def set_prices(self, nodes: Sequence[NodeSpec]) -> None:
        """Price the nodes as `nodes` (this state's nodes, in its order) are priced."""
        if [n.name for n in nodes] != self.names:
            raise ValueError("set_prices takes this state's nodes, in its order")
        self.gpu_price = _gpu_prices(nodes)

    def set_mig_layout(self, node: int, layout: MigLayout) -> None:
        """Partition node `node`'s MIG GPUs anew (a repartition). Every instance a job holds
        must stay as it is (same GPU, profile and start); raises ValueError otherwise."""
        old = self.mig.get(node, MigLayout(layout.family, ()))
        where = {inst: k for k, inst in enumerate(layout.instances)}
        moved: dict[str, tuple[int, ...]] = {}
        for job_id in self.node_jobs[node]:
            allocation = self.jobs[job_id]
            if allocation.job.mig_profile is None:
                continue
            held = [old.instances[k] for k in allocation.gpus]
            if any(inst not in where for inst in held):
                raise ValueError(
                    f"node {self.names[node]!r}: job {job_id!r} holds an instance the new"
                    " layout drops (only idle GPUs may be repartitioned)"
                )
            moved[job_id] = tuple(where[inst] for inst in held)
        used = np.zeros(len(layout.instances), dtype=bool)
        for job_id, indices in moved.items():
            self.jobs[job_id] = replace(self.jobs[job_id], gpus=indices)
            used[list(indices)] = True
        # New tables rather than changes in place: a copy of the state shares them.
        self.mig = {**self.mig, node: layout}
        self.mig_used = {**self.mig_used, node: used}
        self.version[node] += 1

    def _check_instances(self, job: Job, node: int, indices: tuple[int, ...]) -> None:
        layout = self.mig.get(node)
        name = self.names[node]
        if len(indices) != job.mig_count or len(set(indices)) != len(indices):
            raise ValueError(f"job {job.id!r} needs {job.mig_count} distinct MIG instances")
        for k in indices:
            if layout is None or not 0 <= k < len(layout.instances):
                raise ValueError(f"node {name!r} has no MIG instance {k}")
            if layout.instances[k].profile != job.mig_profile or self.mig_used[node][k]:
                inst = layout.instances[k]
                raise ValueError(
                    f"MIG instance {k} of node {name!r} ({inst.profile} at slice {inst.start}"
                    f" of GPU {inst.gpu}) cannot hold {job.id!r} ({job.mig_profile})"
                )

    def _apply(self, allocation: Allocation, sign: int) -> None:
        job, n = allocation.job, allocation.node
        self.cpu_free[n] += sign * job.cpu_milli
        self.mem_free[n] += sign * job.memory_mib
        if job.mig_profile is not None:
            self.mig_used[n][list(allocation.gpus)] = sign < 0
        elif allocation.gpus:
            self.gpu_free[n, list(allocation.gpus)] += sign * job.gpu_milli
            row = self.gpu_free[n]
            self.full_free[n] = int((row == WHOLE_GPU_MILLI).sum())
            self.max_free[n] = int(row.max())
            shape = 0 if job.is_sharing else min(job.num_gpu, MAX_SHAPE)
            self.shape_counts[n, shape] -= sign
        self.version[n] += 1


def _gpu_prices(nodes: Sequence[NodeSpec]) -> np.ndarray | None:
    """Price per GPU-hour of every node (NaN where unknown); None when no node has one."""
    if all(n.price_per_hour is None or n.gpus == 0 for n in nodes):
        return None
    return np.array(
        [
            n.price_per_hour / n.gpus if n.price_per_hour is not None and n.gpus else np.nan
            for n in nodes
        ]
    )


def _domains(nodes: Sequence[NodeSpec], width: int) -> np.ndarray | None:
    """domain[n, g] from the nodes' GPU domains (-1: none); None when no node has any."""
    if not any(n.gpu_domains for n in nodes):
        return None
    domain = np.full((len(nodes), width), -1, dtype=np.int64)
    for i, node in enumerate(nodes):
        seen: set[int] = set()
        for d, group in enumerate(node.gpu_domains):
            for g in group:
                if not 0 <= g < node.gpus or g in seen:
                    raise ValueError(
                        f"node {node.name!r}: GPU domains {node.gpu_domains} name GPU {g}"
                        f" twice or beyond its {node.gpus} GPUs"
                    )
                seen.add(g)
                domain[i, g] = d
    return domain
