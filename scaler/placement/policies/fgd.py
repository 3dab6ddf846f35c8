"""FGD: Fragmentation Gradient Descent (Weng et al., USENIX ATC '23).

Place the job where the cluster's expected fragmentation against the typical job mix grows
least; for a GPU-sharing job also pick the GPU on the node that way. As in the artifact,
the change in fragmentation is squashed to an integer score
`int(100 * sigmoid(-delta / 1000))`, the best GPU on a node is the lowest index among
equal scores, and ties between nodes go to the first node in the seeded order.
"""

from __future__ import annotations

import numpy as np

from scaler.cluster.job import Job
from scaler.cluster.snapshot import ClusterState
from scaler.placement.fragmentation import FragmentationModel
from scaler.placement.mix import WorkloadMix
from scaler.placement.policies.base import Choice, Policy, idle_gpus, run_starts

MAX_SCORE = 100


class FGD(Policy):
    name = "fgd"

    def __init__(self, mix: WorkloadMix, seed: int = 0) -> None:
        super().__init__(seed)
        self.model = FragmentationModel(mix)

    def choose(self, state: ClusterState, job: Job, nodes: np.ndarray) -> Choice:
        score, gpu = self.node_scores(state, job, nodes, self._score_nodes)
        node = self.pick_best(state, job, nodes, score)
        if job.is_sharing:
            return node, (int(gpu[np.flatnonzero(nodes == node)[0]]),)
        return node, idle_gpus(state, job, node)

    def _score_nodes(
        self, state: ClusterState, job: Job, nodes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        found = self.model.candidates(state, job, nodes)
        score = np.floor(MAX_SCORE / (1.0 + np.exp(found.delta / 1000.0))).astype(np.int64)
        if not job.is_sharing:
            return score, found.gpu
        # One node's candidates are contiguous and by GPU index: keep its best score and,
        # among equal scores, its lowest GPU.
        starts = run_starts(found.node).nonzero()[0]
        best = np.maximum.reduceat(score * 16 + (15 - found.gpu), starts)
        return best >> 4, 15 - (best & 15)
