"""The typical job mix of a workload: the job shapes a node should stay ready to host.

FGD measures a node's fragmentation against the jobs the cluster usually sees. Following
the paper's artifact, a shape is (CPU, GPU share, GPU count, allowed models) — memory is
left out — and the mix keeps the most popular shapes until they cover `coverage` of all
jobs (95%), then renormalises their popularity to sum to 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from scaler.cluster.job import Job


@dataclass(frozen=True, slots=True, order=True)
class JobShape:
    cpu_milli: int
    gpu_milli: int
    num_gpu: int
    gpu_models: tuple[str, ...] = ()

    @classmethod
    def of(cls, job: Job) -> JobShape:
        return cls(job.cpu_milli, job.gpu_milli, job.num_gpu, tuple(sorted(job.gpu_models)))


@dataclass(frozen=True, slots=True)
class WorkloadMix:
    """Job shapes with their popularity (summing to 1) and mean memory (MiB)."""

    shapes: tuple[JobShape, ...]
    popularity: tuple[float, ...]
    memory_mib: tuple[float, ...]

    @classmethod
    def from_jobs(cls, jobs: Iterable[Job], coverage: float = 0.95) -> WorkloadMix:
        counts: Counter[JobShape] = Counter()
        memory: Counter[JobShape] = Counter()
        for job in jobs:
            if job.problem() is None:
                shape = JobShape.of(job)
                counts[shape] += 1
                memory[shape] += job.memory_mib
        if not counts:
            raise ValueError("a workload mix needs at least one valid job")
        total = sum(counts.values())
        # Most popular first; equal counts in descending shape order, as the artifact does.
        ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
        kept: list[tuple[JobShape, int]] = []
        covered = 0
        for shape, count in ranked:
            if covered >= coverage * total:
                break
            kept.append((shape, count))
            covered += count
        return cls(
            shapes=tuple(s for s, _ in kept),
            popularity=tuple(c / covered for _, c in kept),
            memory_mib=tuple(memory[s] / c for s, c in kept),
        )

    @property
    def key(self) -> tuple[tuple[JobShape, ...], tuple[float, ...]]:
        return (self.shapes, self.popularity)
