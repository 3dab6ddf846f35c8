"""Small hand-made clusters for the placement tests."""

from __future__ import annotations

from scaler.placement import ClusterState, Job, NodeSpec, Placement, commit


def cluster(*nodes: tuple[str, int, int, int, str]) -> ClusterState:
    """Nodes as (name, cores, memory GiB, GPUs, model)."""
    return ClusterState.from_nodes(
        [
            NodeSpec(name, cores * 1000, mem * 1024, gpus, model)
            for name, cores, mem, gpus, model in nodes
        ]
    )


def job(job_id: str, cores: float = 1, gpus: int = 0, share: int = 0, **extra: object) -> Job:
    """A job asking `cores`, 1 GiB, and `gpus` GPUs of `share` thousandths (1000 if omitted)."""
    milli = share or (1000 if gpus else 0)
    return Job(job_id, int(cores * 1000), 1024, gpus, milli, **extra)  # type: ignore[arg-type]


def run(
    state: ClusterState, new: Job, decision: Placement | object, now_s: float = 0.0
) -> Placement:
    assert isinstance(decision, Placement), decision
    commit(state, new, decision, now_s)
    return decision
