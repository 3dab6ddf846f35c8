"""Job-level simulation: jobs arrive, wait for capacity, run; the scaler sizes the pools.

This is where pre-positioning shows its worth: the trace replay counts node-steps short,
while here a job that finds no room waits, and the wait is what users feel.

The cluster is the one cluster model (`ClusterState`) over the simulated cloud's ready
nodes, and every scheduling question goes to the placement engine, as in the live loop:

- placement: pending jobs are offered nodes in the queue order (`fifo` by default: the
  arrival order, which keeps the figures comparable with the earlier first-fit copy;
  `priority` and `qssf` as in `placement.queue`), each placed by the engine's default
  policy against the job stream's typical mix, backfilling (a job that does not fit lets
  later ones try). A multi-node job (more GPUs than a node has) is a gang of members that
  each take a whole node, all started at once or none. A job that fits nowhere preempts
  what it may (`placement.preemption`: placeholders first, then jobs of lower priority,
  which go back to the queue to run again in full); a gang evicts placeholders only.
- `reactive` (Cluster Autoscaler): every minute the planner in reactive mode scales each
  pool up to `planning.reactive.reactive_demand` (busy nodes plus the booting and new
  nodes the pending jobs pack onto) and removes idle nodes after they have been unneeded
  for 10 minutes, only nodes the scale-down check (`placement.scale_down`) passes.
- `headroom` (what teams run instead of a forecast: overprovisioning placeholder pods, or a
  `CapacityBuffer` with `replicas`): `reactive` with k spare nodes per pool on top of the
  nodes reactive keeps. Those k nodes' worth are held by placeholders, taken by real jobs
  first (they preempt them) and then provisioned again, as evicted placeholder pods pend
  and Cluster Autoscaler scales up for them.
- `predictive`: `headroom` with the spare nodes the planner sets per pool every 10-minute
  step, as the live loop sets its placeholders: its job-level input is the node requests
  the minute loop saw (each rise of a pool's reactive demand, a gang all at once), and it
  holds the spare that those requests, replayed under every spare level and scaled by
  their rate at the hour ahead, show to be worth its GPU-hours at one price of waiting for
  all pools (`planning.job_spare`; the knob is the share of the requested GPUs' boot time
  they may wait). As the live loop does with its default provider, a node beyond the
  nodes in use and that spare goes at once, not after Cluster Autoscaler's 10 minutes.

In `predictive` and `headroom` modes every ready node that runs no real job holds one
placeholder job (its GPUs, and the CPU and memory of the mix's common whole-GPU shape as
often as they fit) until a real job preempts it, so real jobs go to nodes in use first; a
node in use holds none, and placeholders never count as work.

Nodes are paid from request to removal. Jobs submitted before the evaluation start warm
the cluster and the planner up; only jobs submitted from `start` on are scored.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Literal, Protocol

import numpy as np
import pandas as pd

from predictor.foundation.errors import InputError
from predictor.models.requests import RequestRateForecast
from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.pools import NodePool
from scaler.cluster.predicates import feasible
from scaler.cluster.snapshot import ClusterState
from scaler.cluster.templates import template_node
from scaler.controller.removal_order import RemovalCandidate, removal_order
from scaler.placement.decision import Placement, Unschedulable
from scaler.placement.engine import place
from scaler.placement.estimator import ScaleUpEstimate
from scaler.placement.gang import GangPlacement, commit_gang, place_gang
from scaler.placement.mix import WorkloadMix
from scaler.placement.policies import DEFAULT_POLICY, Policy, make_policy
from scaler.placement.preemption import preempt
from scaler.placement.queue import Order, QueuePolicy, admission_order
from scaler.placement.scale_down import check_removals
from scaler.planning.job_spare import ScheduledNodes
from scaler.planning.planner import (
    DemandOutlook,
    FleetCapacity,
    PlannerMemory,
    PlannerPolicy,
    PoolCapacity,
    plan,
)
from scaler.planning.reactive import ReactiveDemand, reactive_demand
from scaler.planning.request_log import RequestLog
from scaler.providers.base import NodeStatus
from scaler.providers.simulated import (
    CloudEvent,
    SimulatedCloud,
    SimulatedCloudConfig,
    SimulatedNodeGroup,
)

STEP_MINUTES = 10
UNNEEDED_MINUTES = 10
WARMUP = pd.Timedelta(days=2)
# Arrival order: what the first-fit simulator did, so its figures stay comparable.
DEFAULT_QUEUE: Order = "fifo"
PLACEHOLDER_PRIORITY = -1

JobMode = Literal[
    "reactive",
    "headroom",
    "headroom-tuned",
    "predictive",
    "predictive-seasonal",
    "predictive-flat",
    "predictive-true-rate",
]
PREDICTIVE_MODES = frozenset(
    {"predictive", "predictive-seasonal", "predictive-flat", "predictive-true-rate"}
)
HEADROOM_MODES = frozenset({"headroom", "headroom-tuned"})


class RequestRates(Protocol):
    """Where a predictive run's request-rate forecast comes from (`request_rates`): it is
    told each minute's node requests and queue per pool, and asked for the GPUs per hour
    expected over the hour a boot ahead and the week's shape (None: the planner's seasonal
    table)."""

    def observe(self, pool: str, requested_gpus: float, pending_gpus: float) -> None: ...

    def rate(self, pool: str, minute: int, boot_minutes: float) -> RequestRateForecast | None: ...


@dataclass(frozen=True)
class ScheduledRun:
    """A scheduled job known ahead (a CronJob's run): it fires `minute` minutes after the
    simulation's begin and asks `nodes` whole nodes of `pool`."""

    minute: float
    pool: str
    nodes: int


Groups = dict[str, SimulatedNodeGroup]
DemandKey = tuple[tuple[int, ...], int, int]  # the queue's tasks, booting, target size
ShapeKey = tuple[tuple[tuple[object, ...], ...], int, int]  # the queue's task shapes, ...


@dataclass(slots=True)
class _Task:
    """One job of the stream: a single engine job, or a gang of whole-node members."""

    pool: str
    members: tuple[Job, ...]
    gpus: float  # GPUs asked in all (a share counts as its fraction)
    duration: int  # minutes
    submit: float  # minutes since the simulation start
    scheduled: bool = False  # a scheduled job's run (its time was known ahead)
    started: float = math.nan  # first start (a job evicted and requeued keeps it)
    generation: int = 0  # bumped on eviction, so a stale finish is ignored

    @property
    def head(self) -> Job:
        return self.members[0]

    @property
    def gang_or_id(self) -> str:
        """The job's id in the stream (a gang's members are named after it)."""
        return self.head.gang or self.head.id

    @property
    def shape(self) -> tuple[object, ...]:
        """What decides whether the task fits: its members' shape, count and priority."""
        job = self.head
        return (
            len(self.members),
            job.cpu_milli,
            job.memory_mib,
            job.num_gpu,
            job.gpu_milli,
            job.priority,
        )


@dataclass(frozen=True)
class JobSimResult:
    mode: JobMode
    waits: np.ndarray  # minutes each scored job waited (censored at the end if never ran)
    gpus: np.ndarray  # GPUs each scored job asked (a share counts as its fraction)
    unstarted: int
    gpu_hours: float  # GPU-hours of nodes paid (booting included)
    cost: float  # price of those node-hours
    fleet: pd.DataFrame  # per minute and pool: paid nodes, demand GPUs (running + pending)
    scale_actions: int
    placement: str = DEFAULT_POLICY  # the engine's policy that placed the jobs
    queue: Order = DEFAULT_QUEUE
    placeholders_preempted: int = 0
    job_ids: tuple[str, ...] = ()  # of the scored jobs, in the order of `waits`
    pools: tuple[str, ...] = ()  # of the scored jobs, in the order of `waits`
    scheduled: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    knob: float | None = None  # headroom: spare nodes per pool; predictive: job_wait_share
    spares: Mapping[str, int] | None = None  # headroom-tuned: the spare nodes of each pool
    default: bool = False  # the predictive run at the product's setting
    seconds: float = 0.0  # wall time of the run
    scored_from: pd.Timestamp | None = None  # the first scored minute

    def row(self) -> dict[str, object]:
        waits = self.waits
        return {
            "mode": self.mode,
            "knob": self.knob,
            "default": self.default,
            "jobs": int(waits.size),
            "unstarted": self.unstarted,
            "wait_p50_min": float(np.percentile(waits, 50)) if waits.size else 0.0,
            "wait_p95_min": float(np.percentile(waits, 95)) if waits.size else 0.0,
            "wait_p99_min": float(np.percentile(waits, 99)) if waits.size else 0.0,
            "wait_mean_min": float(waits.mean()) if waits.size else 0.0,
            "share_waiting": float((waits > 0).mean()) if waits.size else 0.0,
            "gpu_minutes_waited": float((waits * self.gpus).sum()),
            "scheduled_gpu_minutes_waited": float(
                (waits * self.gpus)[self.scheduled].sum() if self.scheduled.size else 0.0
            ),
            "gpu_hours": self.gpu_hours,
            "cost": self.cost,
            "scale_actions": self.scale_actions,
            "placeholders_preempted": self.placeholders_preempted,
            "seconds": self.seconds,
            **({"spares": dict(self.spares)} if self.spares is not None else {}),
        }

    def by_pool(self) -> dict[str, tuple[float, float]]:
        """Per pool: GPU-hours paid in the scored window and GPU-minutes its jobs waited."""
        scored = self.fleet[self.fleet["ds"] >= self.scored_from]
        out = {}
        for pool, rows in scored.groupby("pool"):
            mine = np.asarray([p == pool for p in self.pools], dtype=bool)
            waited = float((self.waits[mine] * self.gpus[mine]).sum()) if mine.size else 0.0
            out[str(pool)] = (float((rows["nodes"] * rows["gpus_per_node"]).sum() / 60), waited)
        return out


# --------------------------------------------------------------------------- the cluster


class _SimCluster:
    """The simulator's `ClusterState`: per pool `max_size` slots of its template node,
    cordoned while no ready cloud node occupies them, so the arrays never change shape and
    the policies' per-node caches survive nodes coming and going."""

    def __init__(self, pools: Sequence[NodePool]) -> None:
        specs = []
        self.slots: dict[str, range] = {}
        for pool in pools:
            first = len(specs)
            specs += [
                replace(template_node(pool, f"{pool.name}/slot-{i:03d}"), cordoned=True)
                for i in range(pool.max_size)
            ]
            self.slots[pool.name] = range(first, len(specs))
        if not specs:
            raise InputError("every pool has max_size 0: the simulation has no node to use")
        self.state = ClusterState.from_nodes(specs)
        self.pool_of = [p.name for p in pools for _ in range(p.max_size)]
        self.slot_of: dict[str, int] = {}  # ready cloud node -> its slot
        self.node_in: dict[int, str] = {}
        self.free = {name: list(r) for name, r in self.slots.items()}  # heaps
        self.real = np.zeros(self.state.size, dtype=np.int64)  # real jobs per slot
        self.held = np.zeros(self.state.size, dtype=np.int64)  # placeholders per slot
        self.idle_since: dict[int, int] = {}  # slot without real jobs -> since when
        self.priorities = {p.name: Counter[int]() for p in pools}  # of real jobs running
        self.placeholders = {p.name: 0 for p in pools}
        self.busy_nodes = {p.name: 0 for p in pools}
        self.task_of: dict[str, _Task] = {}  # bound real job -> its task
        self.maybe_unheld: set[int] = set()
        self._ids = itertools.count()

    # nodes -----------------------------------------------------------------------
    def join(self, pool: str, name: str, minute: int) -> int:
        slot = heapq.heappop(self.free[pool])
        self.slot_of[name] = slot
        self.node_in[slot] = name
        self.state.set_cordoned([slot], False)
        self.idle_since[slot] = minute
        self.maybe_unheld.add(slot)
        return slot

    def leave(self, name: str) -> list[_Task]:
        """Take a node away with what runs there; returns the real tasks it stopped."""
        slot = self.slot_of.pop(name)
        del self.node_in[slot]
        stopped = {id(self.task_of[j]): self.task_of[j] for j in self.real_jobs(slot)}
        for task in stopped.values():
            self.stop(task)
        for job_id in list(self.state.node_jobs[slot]):
            self.release(job_id)
        self.state.set_cordoned([slot])
        self.idle_since.pop(slot, None)
        heapq.heappush(self.free[self.pool_of[slot]], slot)
        return list(stopped.values())

    def ready(self, pool: str) -> int:
        return len(self.slots[pool]) - len(self.free[pool])

    def idle(self, pool: str) -> list[int]:
        """Ready slots without real work, idle longest first."""
        r = self.slots[pool]
        slots = r.start + np.flatnonzero(
            ~self.state.cordoned[r.start : r.stop] & (self.real[r.start : r.stop] == 0)
        )
        return sorted((int(s) for s in slots), key=lambda s: (self.idle_since[s], s))

    def unheld(self) -> list[int]:
        """Ready slots with neither real jobs nor placeholders (checked among those that
        joined or lost their last job since the previous call)."""
        maybe, self.maybe_unheld = self.maybe_unheld, set()
        return sorted(
            s for s in maybe if s in self.node_in and not self.real[s] and not self.held[s]
        )

    def busy(self, pool: str) -> int:
        """Ready slots that run real work."""
        return self.busy_nodes[pool]

    def real_jobs(self, slot: int) -> list[str]:
        jobs = self.state.jobs
        return sorted(j for j in self.state.node_jobs[slot] if not jobs[j].job.placeholder)

    # jobs --------------------------------------------------------------------------
    def bind(self, job: Job, node: int, gpus: Sequence[int], now_s: float) -> None:
        self.state.bind(job, node, gpus, now_s)
        self.bound(job, node)

    def bound(self, job: Job, node: int) -> None:
        """Book-keeping for a job just bound to `node` (by `bind` or `commit_gang`)."""
        pool = self.pool_of[node]
        if job.placeholder:
            self.held[node] += 1
            self.placeholders[pool] += 1
            return
        self.real[node] += 1
        if self.real[node] == 1:
            self.busy_nodes[pool] += 1
        self.priorities[pool][job.priority] += 1
        self.idle_since.pop(node, None)

    def release(self, job_id: str, minute: int = 0) -> None:
        allocation = self.state.release(job_id)
        node, job = allocation.node, allocation.job
        pool = self.pool_of[node]
        if job.placeholder:
            self.held[node] -= 1
            self.placeholders[pool] -= 1
            return
        self.task_of.pop(job_id, None)
        self.real[node] -= 1
        self.priorities[pool][job.priority] -= 1
        if not self.priorities[pool][job.priority]:
            del self.priorities[pool][job.priority]
        if not self.real[node]:
            self.busy_nodes[pool] -= 1
            self.idle_since[node] = minute
            self.maybe_unheld.add(node)

    def start(self, task: _Task) -> None:
        for member in task.members:
            self.task_of[member.id] = task

    def stop(self, task: _Task, minute: int = 0) -> None:
        """Release every member of a running task (it finished, or it is evicted)."""
        for member in task.members:
            if member.id in self.state.jobs:
                self.release(member.id, minute)

    def evictable(self, pool: str, job: Job) -> bool:
        """Could preemption make room for `job` in `pool` at all?"""
        running = self.priorities[pool]
        return self.placeholders[pool] > 0 or any(p < job.priority for p in running)

    def clear_placeholders(self, slot: int) -> None:
        for job_id in [j for j in self.state.node_jobs[slot] if self.state.jobs[j].job.placeholder]:
            self.release(job_id)

    def hold(self, slot: int, placeholder: Job) -> None:
        """Hold an idle slot's GPUs with a placeholder."""
        held = replace(placeholder, id=f"placeholder-{next(self._ids)}")
        self.bind(held, slot, range(placeholder.num_gpu), 0.0)


# --------------------------------------------------------------------------- jobs


def _tasks(
    jobs: pd.DataFrame, pools: Mapping[str, NodePool], begin: pd.Timestamp, end: pd.Timestamp
) -> list[_Task]:
    """Jobs still running or arriving in [begin, end), in arrival order; jobs submitted
    before `begin` arrive at once, with the time they have left."""
    submit = ((jobs["submit"] - begin) / pd.Timedelta(minutes=1)).to_numpy(dtype=float)
    duration = jobs["duration_min"].to_numpy(dtype=float)
    keep = (submit + duration > 0) & (submit < (end - begin) / pd.Timedelta(minutes=1))
    kept = jobs[keep]
    unknown = set(kept["pool"]) - set(pools)
    if unknown:
        raise InputError(f"jobs name pools that are not configured: {sorted(unknown)}")
    names = (
        kept["job_id"].astype(str).to_numpy()
        if "job_id" in kept
        else np.array([f"job-{i:06d}" for i in range(len(kept))])
    )
    if len(set(names)) != len(names):
        raise InputError("job ids must be unique")
    priority = kept["priority"].to_numpy() if "priority" in kept else np.zeros(len(kept), int)
    scheduled = (
        kept["scheduled"].to_numpy(dtype=bool)
        if "scheduled" in kept
        else np.zeros(len(kept), dtype=bool)
    )
    order = np.argsort(submit[keep], kind="stable")
    columns = [
        kept[c].to_numpy()[order] for c in ("pool", "gpus", "gpu_milli", "cpu_milli", "memory_mib")
    ]
    out = []
    for name, first, length, prio, known, pool, gpus, milli, cpu, mem in zip(
        names[order],
        submit[keep][order],
        duration[keep][order],
        priority[order],
        scheduled[order],
        *columns,
        strict=True,
    ):
        task = _task(
            pools[pool],
            str(name),
            int(gpus),
            int(milli),
            int(cpu),
            int(mem),
            duration=max(1, math.ceil(length + min(first, 0.0))),
            submit=max(float(first), 0.0),
            priority=int(prio),
            scheduled=bool(known),
        )
        out.append(task)
    return out


def _task(
    pool: NodePool,
    name: str,
    gpus: int,
    milli: int,
    cpu: int,
    mem: int,
    *,
    duration: int,
    submit: float,
    priority: int = 0,
    scheduled: bool = False,
) -> _Task:
    """A job of `pool` as engine jobs: it asks for the pool's GPU model (as a pod selecting
    it by label does); more GPUs than a node has make a gang of whole-node members, which
    split the CPU and memory. A gang is queued as one job, so every member carries the
    gang's predicted GPU time (GPUs x duration)."""
    per_node = pool.gpus_per_node
    asked = gpus * milli / WHOLE_GPU_MILLI
    common = {
        "gpu_models": frozenset({pool.gpu_model}),
        "priority": priority,
        "predicted_gpu_s": asked * duration * 60.0,
        "submitted_s": submit * 60.0,
    }
    if gpus <= per_node:
        members: tuple[Job, ...] = (Job(name, cpu, mem, gpus, milli, **common),)
    else:
        count = math.ceil(gpus / per_node)
        members = tuple(
            Job(f"{name}/{i}", cpu // count, mem // count, per_node, milli, gang=name, **common)
            for i in range(count)
        )
    problem = members[0].problem()
    if problem:
        raise InputError(f"job {name}: {problem}")
    return _Task(pool.name, members, asked, duration, submit, scheduled)


def _placeholder(pool: NodePool, mix: WorkloadMix) -> Job:
    """The placeholder that holds an idle node of `pool`: all its GPUs, and the CPU and
    memory of as many of the mix's most popular whole-GPU shape (for the pool's GPU
    model) as those GPUs hold, capped by the node. One job per node is enough: the first
    real job on the node evicts it whatever its size, and a node in use holds none."""
    whole = [
        (shape, mib)
        for shape, mib in zip(mix.shapes, mix.memory_mib, strict=True)
        if shape.gpu_milli == WHOLE_GPU_MILLI
        and 0 < shape.num_gpu <= pool.gpus_per_node
        and (not shape.gpu_models or pool.gpu_model in shape.gpu_models)
    ]
    cpu = mem = 0
    if whole:
        shape, mib = whole[0]
        count = pool.gpus_per_node // shape.num_gpu
        cpu, mem = count * shape.cpu_milli, int(count * mib)
    return Job(
        "placeholder",
        min(cpu, pool.cpu_milli_per_node),
        min(mem, pool.memory_mib_per_node),
        pool.gpus_per_node,
        WHOLE_GPU_MILLI,
        gpu_models=frozenset({pool.gpu_model}),
        priority=PLACEHOLDER_PRIORITY,
        placeholder=True,
    )


# --------------------------------------------------------------------------- placement


class _Scheduler:
    """Admission of pending tasks on the simulator's cluster (see the module docstring)."""

    def __init__(self, cluster: _SimCluster, policy: Policy, queue: QueuePolicy) -> None:
        self.cluster = cluster
        self.policy = policy
        self.queue = queue
        self.preempted = 0  # placeholders evicted by real jobs
        self.requeued: list[_Task] = []  # real tasks evicted by higher-priority ones

    def admit(
        self, tasks: list[_Task], failed: set[tuple[object, ...]], now_s: float
    ) -> list[_Task]:
        """Start what fits in queue order, backfilling; returns the tasks started. A task
        whose shape already failed since room last grew is not tried again: room only
        shrank since, so it would fail again."""
        by_id = {t.head.id: t for t in tasks}
        started = []
        for head in admission_order([t.head for t in tasks], now_s, self.queue):
            task = by_id[head.id]
            if task.shape in failed:
                continue
            if self.start(task, now_s):
                started.append(task)
            else:
                failed.add(task.shape)
        return started

    def start(self, task: _Task, now_s: float) -> bool:
        """Bind the task if it fits (preempting what it may); says whether it did."""
        cluster = self.cluster
        if len(task.members) == 1:
            job = task.head
            # preempt places the job as it is first, and evicts only if it fits nowhere.
            if cluster.evictable(task.pool, job):
                decided = preempt(cluster.state, job, self.policy, now_s)
            else:
                decided = place(cluster.state, job, self.policy)
            if isinstance(decided, Unschedulable):
                return False
            self._take(job, decided, now_s)
        else:
            members = task.members
            # Members take whole nodes: fewer feasible nodes than members cannot fit.
            whole = int(np.count_nonzero(feasible(cluster.state, task.head)))
            gang = (
                place_gang(cluster.state, members, self.policy) if whole >= len(members) else None
            )
            if not isinstance(gang, GangPlacement):
                gang = self._gang_over_placeholders(task)
                if gang is None:
                    return False
                for p in gang.placements:
                    self.preempted += int(cluster.held[p.node_index])
                    cluster.clear_placeholders(p.node_index)
            commit_gang(cluster.state, members, gang, now_s)
            for member, p in zip(members, gang.placements, strict=True):
                cluster.bound(member, p.node_index)
        cluster.start(task)
        return True

    def _gang_over_placeholders(self, task: _Task) -> GangPlacement | None:
        """Where a gang would go if its pool's placeholders made way (`preempt` places one
        job; a gang evicts placeholders only, never real jobs of lower priority)."""
        cluster = self.cluster
        held = [s for s in cluster.slots[task.pool] if cluster.held[s]]
        if not held:
            return None
        scratch = cluster.state.copy()
        for slot in held:
            for job_id in list(scratch.node_jobs[slot]):
                if scratch.jobs[job_id].job.placeholder:
                    scratch.release(job_id)
        if np.count_nonzero(feasible(scratch, task.head)) < len(task.members):
            return None
        gang = place_gang(scratch, task.members, self.policy)
        return gang if isinstance(gang, GangPlacement) else None

    def _take(self, job: Job, decided: Placement, now_s: float) -> None:
        """Evict the placement's victims (a real one with its whole task, requeued), bind
        the job, and drop the node's other placeholders: a node in use holds none."""
        cluster = self.cluster
        for victim in decided.evict:
            allocation = cluster.state.jobs.get(victim)
            if allocation is None:  # went with a gang evicted by an earlier member
                continue
            if allocation.job.placeholder:
                cluster.release(victim)
                self.preempted += 1
            else:
                task = cluster.task_of[victim]
                cluster.stop(task, int(now_s // 60))
                self.requeued.append(task)
        cluster.bind(job, decided.node_index, decided.gpus, now_s)
        if cluster.held[decided.node_index]:
            cluster.clear_placeholders(decided.node_index)


@dataclass(frozen=True)
class SimulatorSnapshot:
    """The simulator's view at one instant: its cluster, its queue, its placement policy."""

    state: ClusterState
    pending: tuple[Job, ...]
    policy: Policy


def simulator_snapshot(
    pools: Sequence[NodePool],
    ready: Mapping[str, int],
    running: pd.DataFrame,
    pending: pd.DataFrame,
    *,
    mix: WorkloadMix | None = None,
) -> SimulatorSnapshot:
    """What the simulator would hold with `ready[pool]` ready nodes, the `running` jobs
    bound there by its admission (engine placement, gangs whole, arrival order), and the
    `pending` jobs in its queue, as the engine jobs it feeds `reactive_demand` (gang
    members expanded). Both frames have the simulator's job columns (pool, gpus,
    gpu_milli, cpu_milli, memory_mib, duration_min, submit; job_id and priority
    optional). The policy is the engine's default on `mix`, by default the mix of the two
    frames' jobs. Raises InputError if a running job fits none of the ready nodes."""
    by_name = {p.name: p for p in pools}
    frames = [f for f in (running, pending) if len(f)]
    submits = pd.concat([f["submit"] for f in frames]) if frames else None
    if submits is None:
        ran: list[_Task] = []
        waiting: list[_Task] = []
    else:
        begin, end = submits.min(), submits.max() + pd.Timedelta(minutes=1)
        ran = _tasks(running, by_name, begin, end) if len(running) else []
        waiting = _tasks(pending, by_name, begin, end) if len(pending) else []
    members = [m for t in [*ran, *waiting] for m in t.members]
    policy = make_policy(DEFAULT_POLICY, mix=mix or WorkloadMix.from_jobs(members))
    cluster = _SimCluster(pools)
    for pool in pools:
        for i in range(ready.get(pool.name, 0)):
            cluster.join(pool.name, f"{pool.name}-{i:06d}", 0)
    scheduler = _Scheduler(cluster, policy, QueuePolicy(DEFAULT_QUEUE))
    for task in ran:
        if not scheduler.start(task, 0.0):
            raise InputError(f"running job {task.head.id} fits none of the ready nodes")
    return SimulatorSnapshot(cluster.state, tuple(m for t in waiting for m in t.members), policy)


# --------------------------------------------------------------------------- the loop


def simulate_jobs(
    jobs: pd.DataFrame,
    pools: Sequence[NodePool],
    mode: JobMode,
    begin: pd.Timestamp,
    start: pd.Timestamp,
    end: pd.Timestamp,
    policy: PlannerPolicy,
    outlooks: Mapping[str, np.ndarray] | None = None,
    levels: tuple[float, ...] = (),
    cloud: SimulatedCloudConfig | None = None,
    queue: Order = DEFAULT_QUEUE,
    spare: int | Mapping[str, int] = 0,
    rates: RequestRates | None = None,
    scheduled: Sequence[ScheduledRun] = (),
) -> JobSimResult:
    """Simulate [begin, end) minute by minute; score jobs submitted in [start, end).

    `outlooks[pool][s]` is the forecast outlook (rows = 10-minute steps ahead, columns =
    `levels`, GPUs) for the step starting `begin + s * 10 min`, made from demand before it.
    `queue` is the admission order of pending jobs (fifo, priority or qssf). `spare`: the
    spare nodes per pool of the headroom modes (one count for all, or one per pool).
    Predictive modes only: `rates`, the request-rate forecast the planner gets with each
    step's outlook; `scheduled`, the scheduled runs it is told of from a boot (and a step)
    before they fire. The policy says how the planner uses them (`request_rate`).
    """
    began = time.perf_counter()
    predictive = mode in PREDICTIVE_MODES
    if predictive and outlooks is None:
        raise ValueError("predictive mode needs forecast outlooks")
    spare_of = dict(spare) if isinstance(spare, Mapping) else {p.name: spare for p in pools}
    if any(k < 0 for k in spare_of.values()) or (
        any(spare_of.values()) != (mode in HEADROOM_MODES)
    ):
        raise ValueError("headroom modes, and only they, take spare nodes (at least 1)")
    models = [p.gpu_model for p in pools]
    if len(set(models)) != len(models):
        raise InputError("the job simulation needs one pool per GPU model (jobs name pools)")
    by_name = {p.name: p for p in pools}
    tasks = _tasks(jobs, by_name, begin, end)
    everything = [m for t in tasks for m in t.members]
    if not everything:
        raise InputError(f"no job runs or arrives in [{begin}, {end})")
    mix = WorkloadMix.from_jobs(everything)
    engine = make_policy(DEFAULT_POLICY, mix=mix)
    cluster = _SimCluster(pools)
    scheduler = _Scheduler(cluster, engine, QueuePolicy(order=queue))
    holders = {p.name: _placeholder(p, mix) for p in pools}
    sim_cloud = SimulatedCloud(pools, cloud, start=begin.to_pydatetime())
    groups = {g.id(): g for g in sim_cloud.node_groups()}
    minutes = int((end - begin) / pd.Timedelta(minutes=1))
    pending: dict[str, list[_Task]] = {p.name: [] for p in pools}
    failed: dict[str, set[tuple[object, ...]]] = {p.name: set() for p in pools}
    grown = {p.name: True for p in pools}  # room grew since the last pass: retry all
    fresh = {p.name: False for p in pools}  # tasks joined the queue since the last pass
    demand_memo: dict[str, tuple[DemandKey, int]] = {}
    demand_seen: Mapping[str, int] | None = None  # the nodes the outlooks below were made of
    reactive: tuple[DemandOutlook, ...] = ()
    spares = {p.name: spare_of.get(p.name, 0) for p in pools}  # wanted on top of reactive
    spares_seen: Mapping[str, int] | None = None
    requests = RequestLog()
    observed: dict[str, float] = {}
    shape_memo: dict[tuple[str, ShapeKey], int] = {}  # see observe
    estimate = ScaleUpEstimate(pools={})
    running: list[tuple[int, int, int, _Task]] = []
    order = itertools.count()
    done: list[_Task] = []
    minute_policy = policy.model_copy(
        update={
            "mode": "reactive",
            "step_seconds": 60.0,
            # Cluster Autoscaler, which executes the baselines, takes a node out once it
            # has been unneeded for 10 minutes (samples are instants: 11 of them, a minute
            # apart, span them). gpuscale's default deploy sizes the groups itself and
            # takes a node its plan does not want out at the next pass: the spare is the
            # one the price chose, a freed node beyond it is none (validation seeds 10
            # and 11: 0.1-2.2 % fewer GPU-hours against the buffers than with the hold).
            "unneeded_steps": 1 if predictive else UNNEEDED_MINUTES + 1,
        }
    )
    step_policy = policy.model_copy(update={"step_seconds": STEP_MINUTES * 60.0})
    minute_memory: PlannerMemory | None = None
    step_memory: PlannerMemory | None = None
    step_peak = {p.name: 0.0 for p in pools}
    held = {p.name: 0.0 for p in pools}  # GPUs held by running jobs
    paid_rows: list[tuple[int, str, int, float, float, int]] = []
    actions = 0

    def enqueue(task: _Task) -> None:
        pending[task.pool].append(task)
        fresh[task.pool] = True

    def stopped(task: _Task) -> None:
        """A running task lost its nodes: back to the queue, to run again in full (its
        pending finish is void)."""
        task.generation += 1
        held[task.pool] -= task.gpus
        grown[task.pool] = True
        enqueue(task)

    def observe() -> ReactiveDemand:
        """Reactive demand per pool, in nodes: `reactive_demand`'s busy nodes plus the
        booting and new nodes the queue packs onto. Admission has just offered every
        pending job each ready node (and what preemption frees), so none fits there: the
        estimate is made without the ready nodes (no copy of the cluster, no attempts
        bound to fail) and depends on the queue and the booting and target sizes only, so
        it is reused while those stay. Pools estimated again share one call.

        A GPU job asks its pool's GPU model, so while every job to estimate asks GPUs, a
        pool's new nodes depend on the shapes in its own queue (and its booting and target
        sizes) alone: an estimate made so before for the same shapes is reused too."""
        nonlocal estimate
        nodes: dict[str, int] = {}
        stale: list[tuple[NodePool, DemandKey]] = []
        for pool in pools:
            name = pool.name
            if not pending[name]:
                nodes[name] = cluster.busy(name)
                continue
            target = groups[name].target_size()
            queue_now = tuple(id(t) for t in pending[name])
            key = (queue_now, target - cluster.ready(name), target)
            memo = demand_memo.get(name)
            if memo is not None and memo[0] == key:
                nodes[name] = cluster.busy(name) + memo[1]
            else:
                stale.append((pool, key))
        alone = all(t.head.num_gpu for pool, _ in stale for t in pending[pool.name])
        shapes: dict[str, ShapeKey] = {}
        if alone:
            for pool, key in stale:
                shapes[pool.name] = (tuple(t.shape for t in pending[pool.name]), key[1], key[2])
                known = shape_memo.get((pool.name, shapes[pool.name]))
                if known is not None:
                    demand_memo[pool.name] = (key, known)
                    nodes[pool.name] = cluster.busy(pool.name) + known
            stale = [(pool, key) for pool, key in stale if pool.name not in nodes]
        if stale:
            demand = reactive_demand(
                None,
                [m for pool, _ in stale for t in pending[pool.name] for m in t.members],
                [pool for pool, _ in stale],
                engine,
                booting={pool.name: key[1] for pool, key in stale},
                current={pool.name: key[2] for pool, key in stale},
            )
            estimate = demand.estimate
            for pool, key in stale:
                demand_memo[pool.name] = (key, demand.nodes[pool.name])
                nodes[pool.name] = cluster.busy(pool.name) + demand.nodes[pool.name]
                if alone:
                    shape_memo[(pool.name, shapes[pool.name])] = demand.nodes[pool.name]
        return ReactiveDemand(nodes, estimate)

    # The cluster starts sized for the demand of its first minute, nodes ready.
    initial = {p.name: 0.0 for p in pools}
    for task in tasks:
        if task.submit <= 0:
            initial[task.pool] += task.gpus
    for pool in pools:
        size = min(
            max(math.ceil(initial[pool.name] / pool.gpus_per_node), pool.min_size), pool.max_size
        )
        if size:
            groups[pool.name].increase_size(size)
    events = sim_cloud.advance(max(p.boot_seconds for p in pools) + 1)
    arrivals = deque(tasks)
    due = deque(sorted(scheduled, key=lambda r: r.minute))
    first_minute = begin.to_pydatetime()

    for minute in range(minutes):
        now_s = minute * 60.0
        if minute:
            events = sim_cloud.advance(60)
        for task in _sync(cluster, events, minute, grown):
            stopped(task)
        while running and running[0][0] <= minute:
            _, _, generation, task = heapq.heappop(running)
            if generation != task.generation:
                continue  # evicted since: its new run has its own entry
            cluster.stop(task, minute)
            held[task.pool] -= task.gpus
            grown[task.pool] = True
        while arrivals and arrivals[0].submit <= minute:
            enqueue(arrivals.popleft())
        for name, waiting in pending.items():
            if not (grown[name] or fresh[name]) or not waiting:
                continue
            if grown[name]:
                failed[name].clear()
            grown[name] = fresh[name] = False
            evicted = scheduler.preempted
            started = scheduler.admit(waiting, failed[name], now_s)
            if started:
                ids = {id(t) for t in started}
                pending[name] = [t for t in waiting if id(t) not in ids]
            for task in started:
                if math.isnan(task.started):
                    task.started = float(minute)
                    done.append(task)
                held[name] += task.gpus
                heapq.heappush(
                    running, (minute + task.duration, next(order), task.generation, task)
                )
            if scheduler.preempted > evicted or scheduler.requeued:
                grown[name] = True  # evictions freed room some skipped shape may use
            for task in scheduler.requeued:
                stopped(task)
            scheduler.requeued.clear()

        demand = observe()
        if demand.nodes != demand_seen:
            observed = {o.group: o.observed for o in demand.outlooks(pools)}
        for name, value in observed.items():
            step_peak[name] = max(step_peak[name], value)
        at = first_minute + timedelta(minutes=minute)
        rises = demand.rises(requests.seen)
        requests = requests.observe(demand, at)

        if predictive and minute % STEP_MINUTES == 0 and minute:
            step = minute // STEP_MINUTES
            while due and due[0].minute <= minute:
                due.popleft()
            outlook = [
                DemandOutlook(
                    group=p.name,
                    observed=step_peak[p.name],
                    levels=levels,
                    values=outlooks[p.name][step],
                    gpu_models=frozenset({p.gpu_model}),
                    requests=requests.requests(p.name, at),
                    request_rate=None
                    if rates is None
                    else rates.rate(p.name, minute, p.boot_seconds / 60),
                    scheduled=_scheduled_nodes(due, p, minute),
                )
                for p in pools
            ]
            requests = requests.taken()
            decided = plan(outlook, _fleet(groups, cluster, at), pools, step_policy, step_memory)
            step_memory = decided.memory
            spares = {n.group: n.spare_nodes or 0 for n in decided.needs}
        if minute % STEP_MINUTES == 0:  # a new step: its peak starts from this minute
            step_peak = dict(observed)

        if demand.nodes != demand_seen or spares != spares_seen:
            # else the outlooks of the minute before hold; the spare nodes are wanted on
            # top, as pending placeholder pods or a CapacityBuffer's replicas are
            reactive = demand.with_spare(spares).outlooks(pools)
            demand_seen, spares_seen = demand.nodes, spares

        decided = plan(reactive, _fleet(groups, cluster, at), pools, minute_policy, minute_memory)
        minute_memory = decided.memory
        actions += _apply(decided.desired, groups, cluster, engine)

        if mode != "reactive":  # what the plan provides beyond real work is held
            for slot in cluster.unheld():
                cluster.hold(slot, holders[cluster.pool_of[slot]])

        for pool in pools:
            waiting = sum(t.gpus for t in pending[pool.name])
            asked = rises.get(pool.name, 0) * pool.gpus_per_node
            paid_rows.append(
                (
                    minute,
                    pool.name,
                    groups[pool.name].target_size(),
                    held[pool.name] + waiting,
                    waiting,
                    asked,
                )
            )
            if rates is not None:
                rates.observe(pool.name, asked, waiting)

    start_minute = (start - begin) / pd.Timedelta(minutes=1)
    # A job's wait for capacity runs from the first scheduling pass after it arrives.
    scored = [t for t in done if t.submit >= start_minute]
    unstarted = [t for waiting in pending.values() for t in waiting if t.submit >= start_minute]
    unstarted = [t for t in unstarted if math.isnan(t.started)]
    waits = [t.started - math.ceil(t.submit) for t in scored]
    waits += [minutes - math.ceil(t.submit) for t in unstarted]
    fleet = pd.DataFrame(
        paid_rows,
        columns=["minute", "pool", "nodes", "demand_gpus", "pending_gpus", "requested_gpus"],
    )
    fleet["ds"] = begin + pd.to_timedelta(fleet["minute"], unit="min")
    fleet["gpus_per_node"] = fleet["pool"].map({p.name: p.gpus_per_node for p in pools})
    scored_fleet = fleet[fleet["minute"] >= start_minute]
    gpn = scored_fleet["gpus_per_node"]
    price = scored_fleet["pool"].map({p.name: p.price_per_hour for p in pools})
    return JobSimResult(
        mode=mode,
        waits=np.asarray(waits, dtype=float),
        gpus=np.asarray([t.gpus for t in [*scored, *unstarted]], dtype=float),
        unstarted=len(unstarted),
        gpu_hours=float((scored_fleet["nodes"] * gpn).sum() / 60),
        cost=float((scored_fleet["nodes"] * price).sum() / 60),
        fleet=fleet.drop(columns="minute"),
        scale_actions=actions,
        placement=engine.name,
        queue=queue,
        placeholders_preempted=scheduler.preempted,
        job_ids=tuple(t.gang_or_id for t in [*scored, *unstarted]),
        pools=tuple(t.pool for t in [*scored, *unstarted]),
        scheduled=np.asarray([t.scheduled for t in [*scored, *unstarted]], dtype=bool),
        knob=policy.job_wait_share
        if predictive
        else (spare if mode == "headroom" and not isinstance(spare, Mapping) else None),
        spares=dict(spare_of) if mode == "headroom-tuned" else None,
        seconds=time.perf_counter() - began,
        scored_from=start,
    )


def _scheduled_nodes(due: deque[ScheduledRun], pool: NodePool, minute: int) -> ScheduledNodes:
    """The runs of `pool` that fire within its boot and a step after `minute`: those the
    planner holds nodes for now (a CronJob's next run times are read ahead)."""
    window = pool.boot_seconds / 60 + STEP_MINUTES
    soon = itertools.takewhile(lambda r: r.minute <= minute + window, due)
    mine = [r for r in soon if r.pool == pool.name]
    return ScheduledNodes(tuple(r.minute - minute for r in mine), tuple(r.nodes for r in mine))


def _sync(
    cluster: _SimCluster, events: Sequence[CloudEvent], minute: int, grown: dict[str, bool]
) -> list[_Task]:
    """Follow the cloud: nodes that became ready join the cluster, nodes the cloud took
    (spot interruptions) leave it; returns the real tasks those took down."""
    stopped: list[_Task] = []
    for event in events:
        if event.kind == "ready":
            cluster.join(event.pool, event.node, minute)
            grown[event.pool] = True
        elif event.kind == "interrupted" and event.node in cluster.slot_of:
            stopped += cluster.leave(event.node)
    return stopped


def _fleet(groups: Groups, cluster: _SimCluster, at: datetime) -> FleetCapacity:
    """Ready nodes are those in the cluster; the rest of a group's target is booting.
    Nodes that hold only placeholders are idle: their room is not work."""
    pools = []
    for name, group in groups.items():
        ready = cluster.ready(name)
        idle = ready - cluster.busy(name)
        pools.append(PoolCapacity(name, ready, group.target_size() - ready, removable=idle))
    return FleetCapacity(at=at, pools=tuple(pools))


def _apply(desired: Mapping[str, int], groups: Groups, cluster: _SimCluster, engine: Policy) -> int:
    """Carry a plan out: grow a group, or take nodes out in the loop's removal order
    (`removal_order`: booting ones newest first, then idle ones idle longest), a ready
    node only if the scale-down check lets it go. Returns the groups changed."""
    changed = 0
    for name, size in desired.items():
        group = groups[name]
        delta = size - group.target_size()
        if delta > 0:
            group.increase_size(delta)
            changed += 1
        elif delta < 0:
            idle = {cluster.node_in[s]: s for s in cluster.idle(name)}
            order = removal_order(
                RemovalCandidate(
                    n.name,
                    n.launched_at,
                    booting=n.status == NodeStatus.BOOTING,
                    # A booting node has not joined the cluster: nothing runs there.
                    removable=n.status == NodeStatus.BOOTING or n.name in idle,
                    idle_since=cluster.idle_since.get(idle[n.name]) if n.name in idle else None,
                )
                for n in group.nodes()
            )
            victims = [str(c.key) for c in order if c.booting][:-delta]
            ready = [idle[str(c.key)] for c in order if not c.booting]
            if ready and len(victims) < -delta:
                checks = check_removals(cluster.state, ready[: -delta - len(victims)], engine)
                victims += [
                    cluster.node_in[cluster.state.node_index(c.node)] for c in checks if c.removable
                ]
            if victims:
                group.delete_nodes(victims)
                for v in victims:
                    if v in cluster.slot_of:
                        cluster.leave(v)
                changed += 1
    return changed
