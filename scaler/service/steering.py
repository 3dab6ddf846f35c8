"""Steering the pods defragmentation moved onto the nodes it planned for them.

`gpuscale defrag --apply` evicts a pod and notes the move on the target node
(`scaler.kube.moves`); the pod's controller creates a successor, which kube-scheduler
sends to the extender. A pod is steered when a live move matches it (same namespace, made
by the same controller, asking the same) and no other pod has claimed that move:

- filter: the planned node alone passes while it can take the pod. While it cannot yet
  (the evicted pod is still terminating there, or a move before it has not landed) and the
  move is younger than `defrag.hold_s`, no node passes, so the scheduler retries the pod
  rather than put it elsewhere; after that, or when the scheduler's own filters already
  ruled the node out, the pod is placed as any other.
- prioritize: the planned node scores 10, every other node at most 9.
- bind: on the planned node, the planned GPUs when they are free.

The first pod to match a move claims it until the move expires, so two successors of one
ReplicaSet take its two moves one each, and a pod the scheduler retries keeps its move.
Claims live in this process: a restarted service, or a second replica, may steer one more
pod of that controller by a move already used, onto a node planned to hold that shape.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from predictor.telemetry.kube_objects import PodRequest
from scaler.cluster.job import WHOLE_GPU_MILLI, Job
from scaler.cluster.predicates import feasible
from scaler.cluster.snapshot import ClusterState
from scaler.kube.moves import PlannedMove
from scaler.placement import Placement
from scaler.service.scheduling import MAX_EXTENDER_PRIORITY, FilterResult

Moves = Mapping[str, Iterable[PlannedMove]]  # target node -> the moves noted on it


@dataclass(frozen=True, slots=True)
class Steer:
    node: str
    move: PlannedMove


class Steering:
    """Which moved pod goes where; claims kept per move (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._claims: dict[str, tuple[str, float]] = {}  # move id -> (pod, expires)
        # pod -> the move it claimed: a bind finds it even where its nodes were sent by the
        # scheduler in filter and the listing has not caught up with the note yet.
        self._claimed: dict[str, Steer] = {}

    def now(self) -> float:
        return self._clock()

    def steer(self, pod: PodRequest, job: Job, moves: Moves, pod_key: str) -> Steer | None:
        """The move `pod` is steered by, claimed for it; None when it is not a moved pod."""
        if pod.controller_uid is None:
            return None
        now = self._clock()
        with self._lock:
            known = self._claimed.get(pod_key)
        if known is not None and known.move.live(now) and known.move.matches(pod, job):
            return known
        found = sorted(
            (
                (m.at, m.id, node, m)
                for node, node_moves in moves.items()
                for m in node_moves
                if m.live(now) and m.matches(pod, job)
            ),
            key=lambda entry: entry[:2],
        )
        if not found:
            return None
        with self._lock:
            self._claims = {k: v for k, v in self._claims.items() if v[1] > now}
            self._claimed = {k: v for k, v in self._claimed.items() if v.move.live(now)}
            mine = [e for e in found if self._claims.get(e[1], ("",))[0] == pod_key]
            free = [e for e in found if e[1] not in self._claims]
            chosen = (mine or free or [None])[0]
            if chosen is None:
                return None
            _, move_id, node, move = chosen
            self._claims[move_id] = (pod_key, move.expires)
            self._claimed[pod_key] = Steer(node, move)
        return Steer(node, move)


def steer_filter(found: FilterResult, steer: Steer, now: float, hold_s: float) -> FilterResult:
    """The filter's answer for a steered pod (see the module docstring)."""
    target = steer.node
    if target in found.passing:
        failed = dict(found.failed)
        for name in found.passing:
            if name != target:
                failed[name] = f"gpuscale defrag planned this pod for node {target}"
        return FilterResult([target], failed, found.unresolvable)
    if target in found.failed and now - steer.move.at < hold_s:
        failed = dict(found.failed)
        for name in found.passing:
            failed[name] = (
                f"gpuscale defrag planned this pod for node {target}, which cannot take it yet"
                f" ({found.failed[target]}); waiting up to {hold_s:g} s after the move"
            )
        return FilterResult([], failed, found.unresolvable)
    return found


def steer_scores(scores: list[tuple[str, int]], steer: Steer) -> list[tuple[str, int]]:
    """The planned node first (when it can take the pod now: ranked above 0), then the rest."""
    ranked = dict(scores)
    if ranked.get(steer.node, 0) <= 0:
        return scores
    top = MAX_EXTENDER_PRIORITY
    return [(name, top if name == steer.node else min(s, top - 1)) for name, s in scores]


def planned_placement(
    state: ClusterState, job: Job, steer: Steer, node: str, policy: str
) -> Placement | None:
    """The planned GPUs on `node`, when it is the planned node and they can hold the job."""
    if node != steer.node or node not in state.names:
        return None
    n = state.names.index(node)
    gpus = steer.move.gpus
    if not feasible(state, job)[n] or len(gpus) != job.num_gpu:
        return None
    if any(g < 0 or g >= int(state.gpu_count[n]) for g in gpus):
        return None
    free = state.gpu_free[n, list(gpus)] if gpus else np.zeros(0)
    need = WHOLE_GPU_MILLI if job.num_gpu > 1 else job.gpu_milli
    if bool((free < need).any()):
        return None
    return Placement(job.id, node, n, tuple(gpus), policy)
