"""gpuscale: ours (work in progress)."""

from __future__ import annotations

import numpy as np

from scaler.placement.cluster import ClusterState
from scaler.placement.fragmentation import FragmentationModel
from scaler.placement.job import Job
from scaler.placement.mix import WorkloadMix
from scaler.placement.policies.base import Choice, Policy, idle_gpus


class GpuScale(Policy):
    name = "gpuscale"

    def __init__(self, mix: WorkloadMix, seed: int = 0) -> None:
        super().__init__(seed)
        self.model = FragmentationModel(mix)

    def choose(self, state: ClusterState, job: Job, nodes: np.ndarray) -> Choice:
        found = self.model.candidates(state, job, nodes)
        pick = int(np.argmin(found.delta))
        node = int(found.node[pick])
        if job.is_sharing:
            return node, (int(found.gpu[pick]),)
        return node, idle_gpus(state, job, node)
