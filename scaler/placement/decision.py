"""What the engine answers: a placement (with any evictions it needs) or the reason it has none."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    """Run job `job_id` on node `node` (index `node_index`) using GPU indices `gpus`.

    `evict` lists the jobs that must be removed first (preemption), cheapest set found;
    `explanation` says in words why this node (the engine's `place` writes it).
    """

    job_id: str
    node: str
    node_index: int
    gpus: tuple[int, ...]
    policy: str
    evict: tuple[str, ...] = ()
    explanation: str = ""


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """No node can take the job now; `reason` says which constraint ruled the nodes out."""

    job_id: str
    reason: str
