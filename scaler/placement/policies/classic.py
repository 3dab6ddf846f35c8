"""The FGD paper's baseline policies, re-implemented from the paper and its artifact's
description, including their integer scores in [0, 100] and random tie-breaking (those
coarse scores are part of why the baselines behave as published).

- random: any node that fits; a random GPU that holds a sharing job.
- bestfit: least CPU and GPU left after placement, 0.5 weight each, normalised by the
  largest node (128 cores, 8 GPUs).
- dotprod (Tetris): smallest dot product of the node's free (CPU, GPU) and the job's
  request, both normalised by the largest node.
- gpupacking: prefer a partly used GPU, then idle GPUs on a used node, then an idle node.
- gpuclustering: prefer nodes already running jobs of the same GPU shape.

All but random place a sharing job on the fullest GPU that holds it.
"""

from __future__ import annotations

import numpy as np

from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.snapshot import ClusterState
from scaler.placement.policies.base import Choice, Policy, best_fit_gpus, idle_gpus

MAX_SPEC_CPU = 128_000
MAX_SPEC_GPU = 8 * WHOLE_GPU_MILLI
MAX_SCORE = 100


class RandomPolicy(Policy):
    name = "random"
    weighs_price = False

    def choose(self, state: ClusterState, job: Job, nodes: np.ndarray) -> Choice:
        node = int(nodes[self.draw(job, nodes.size)])
        if job.is_sharing:
            fits = np.flatnonzero(state.gpu_free[node, : state.gpu_count[node]] >= job.gpu_milli)
            return node, (int(fits[self.draw(job, fits.size, "gpu")]),)
        return node, idle_gpus(state, job, node)


class BestFit(Policy):
    name = "bestfit"

    def choose(self, state: ClusterState, job: Job, nodes: np.ndarray) -> Choice:
        cpu_left = (state.cpu_free[nodes] - job.cpu_milli) / MAX_SPEC_CPU * 0.5
        gpu_left = (state.gpu_free[nodes].sum(axis=1) - job.gpu_request_milli) / MAX_SPEC_GPU
        score = np.floor((1.0 - (cpu_left + gpu_left * 0.5)) * MAX_SCORE)
        node = self.pick_best(state, job, nodes, score)
        return node, best_fit_gpus(state, job, node)


class DotProduct(Policy):
    name = "dotprod"

    def choose(self, state: ClusterState, job: Job, nodes: np.ndarray) -> Choice:
        dot = (state.cpu_free[nodes] / MAX_SPEC_CPU) * (job.cpu_milli / MAX_SPEC_CPU) + (
            state.gpu_free[nodes].sum(axis=1) / MAX_SPEC_GPU
        ) * (job.gpu_request_milli / MAX_SPEC_GPU)
        score = np.floor(MAX_SCORE * (1.0 - dot / 2))
        node = self.pick_best(state, job, nodes, score)
        return node, best_fit_gpus(state, job, node)


class GpuPacking(Policy):
    name = "gpupacking"

    def choose(self, state: ClusterState, job: Job, nodes: np.ndarray) -> Choice:
        if job.num_gpu == 0:
            return self.pick_best(state, job, nodes, np.zeros(nodes.size)), ()
        idle = state.full_free[nodes]
        all_idle = idle == state.gpu_count[nodes]
        if job.is_sharing:
            free = state.gpu_free[nodes]
            fullest = np.where(free >= job.gpu_milli, free, WHOLE_GPU_MILLI + 1).min(axis=1)
            on_used = fullest < WHOLE_GPU_MILLI
            shared = np.maximum(MAX_SCORE - (fullest * 100 // WHOLE_GPU_MILLI) // 10, 50)
            score = np.where(on_used, shared, 49)
        else:
            score = np.full(nodes.size, max(50 - job.num_gpu, 33))
        score = np.where(all_idle, np.maximum(33 - idle, idle), score)
        node = self.pick_best(state, job, nodes, score)
        return node, best_fit_gpus(state, job, node)


class GpuClustering(Policy):
    name = "gpuclustering"

    def choose(self, state: ClusterState, job: Job, nodes: np.ndarray) -> Choice:
        if job.num_gpu == 0:
            return self.pick_best(state, job, nodes, np.zeros(nodes.size)), ()
        shapes = state.shape_counts[nodes]
        same = shapes[:, 0 if job.is_sharing else min(job.num_gpu, shapes.shape[1] - 1)] > 0
        kinds = (shapes > 0).sum(axis=1)
        left = state.gpu_free[nodes].sum(axis=1)
        tier = np.where(same, np.where(kinds == 1, 75, 50), np.where(kinds == 0, 25, 0))
        score = 25 * (MAX_SPEC_GPU - left) // MAX_SPEC_GPU + tier
        node = self.pick_best(state, job, nodes, score)
        return node, best_fit_gpus(state, job, node)
