"""Admission order of pending jobs: which waiting job gets the next chance at a node.

Orders:
- `fifo`: by submission time.
- `priority`: higher priority first, then FIFO.
- `qssf`: Quasi-Shortest-Service-First, as in Helios (SC '21): the job with the smallest
  predicted GPU time (`predicted_gpu_s`, GPUs x duration) first, which cuts the average
  wait when job sizes are skewed. Protection against starvation: a job that has waited
  `starvation_s` or longer jumps ahead of all others, oldest first, so a long job cannot be
  overtaken forever. A job without a prediction counts as the median predicted job.

In every order placeholders (capacity held ahead of demand) come after real jobs, and
`admit` backfills: a job that does not fit now is skipped and the next one tried.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from scaler.cluster.job import Job
from scaler.cluster.snapshot import ClusterState
from scaler.placement.decision import Placement, Unschedulable
from scaler.placement.engine import place
from scaler.placement.policies.base import Policy

Order = Literal["fifo", "priority", "qssf"]
ORDERS: tuple[Order, ...] = ("fifo", "priority", "qssf")


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    order: Order = "qssf"
    starvation_s: float = 4 * 3600.0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"unknown queue order {self.order!r} (known: {', '.join(ORDERS)})")
        if self.starvation_s <= 0:
            raise ValueError("starvation_s must be positive")


@dataclass(frozen=True, slots=True)
class Admission:
    """Placements to commit in order, and the jobs that keep waiting (with the reason)."""

    placed: tuple[Placement, ...]
    waiting: tuple[Unschedulable, ...]


def admission_order(pending: Sequence[Job], now_s: float, policy: QueuePolicy) -> list[Job]:
    """`pending` in the order they should be offered a node."""
    known = [j.predicted_gpu_s for j in pending if j.predicted_gpu_s is not None]
    typical = statistics.median(known) if known else 0.0

    def key(job: Job) -> tuple[object, ...]:
        fifo = (job.submitted_s, job.id)
        if policy.order == "fifo":
            rest: tuple[object, ...] = fifo
        elif policy.order == "priority":
            rest = (-job.priority, *fifo)
        else:
            starved = now_s - job.submitted_s >= policy.starvation_s
            size = typical if job.predicted_gpu_s is None else job.predicted_gpu_s
            rest = (0, *fifo) if starved else (1, size, *fifo)
        return (job.placeholder, *rest)

    return sorted(pending, key=key)


def admit(
    state: ClusterState,
    pending: Sequence[Job],
    policy: Policy,
    queue: QueuePolicy,
    now_s: float,
) -> Admission:
    """Offer nodes to pending jobs in admission order, skipping those that do not fit.

    Works on a scratch copy: the state is not changed; commit `placed` in order.
    """
    scratch = state.copy()
    placed: list[Placement] = []
    waiting: list[Unschedulable] = []
    for job in admission_order(pending, now_s, queue):
        decision = place(scratch, job, policy)
        if isinstance(decision, Placement):
            scratch.bind(job, decision.node_index, decision.gpus, now_s)
            placed.append(decision)
        else:
            waiting.append(decision)
    return Admission(tuple(placed), tuple(waiting))
