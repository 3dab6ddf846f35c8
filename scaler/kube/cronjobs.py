"""CronJobs in the live loop: the nodes scheduled jobs will ask for, so a run's nodes are
ready when it fires.

`read_scheduled` lists the CronJobs once per pass, page by page, as Kueue's queue is read
(`scaler.kube.kueue`), and reads the runs due ahead (`predictor.telemetry.cronjobs`:
suspended CronJobs fire nothing, serial ones count their next run only, and a run counts
only until it fires, after which its pods are pending pods, so nothing counts twice).
Where the API server refuses the list (403: the account's RBAC grants no `list` on
batch/cronjobs; 404: it serves no batch/v1 CronJobs) the answer is a `Refusal`: the loop
plans without scheduled jobs and says so once, rather than failing every pass of a
cluster that has not granted the read.

`scheduled_nodes` turns the runs into what the planner takes per pool
(`planning.job_spare.ScheduledNodes`): the runs due within the pool's boot time plus one
demand step, since a node asked for later than that is not ready when the run fires, each
with the whole nodes it needs there (`run_nodes`). A run goes to the pool its template
names, else to the one pool whose GPU model it allows and whose node can hold one of its
pods (`run_pool`); a run that several pools could take is no one pool's known demand and
is left to the forecast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes import client as k8s

from predictor.telemetry.cronjobs import ScheduledRun, ScheduledRuns, scheduled_runs
from predictor.telemetry.kube_objects import KubeNames
from predictor.telemetry.paging import paged
from scaler.cluster.pools import NODE_RESIDUE, NodePool, whole_nodes
from scaler.kube.errors import Refusal, kube_call
from scaler.planning.job_spare import ScheduledNodes

REFUSED = (403, 404)  # not allowed, or not served: scheduled jobs are left out


def read_scheduled(
    api: k8s.ApiClient,
    names: KubeNames,
    now: datetime,
    horizon: timedelta,
    watched: Sequence[Mapping[str, Any]] | None = None,
) -> ScheduledRuns | Refusal:
    """The runs of every CronJob due after `now` up to `now + horizon`, with why the
    CronJobs whose schedule cannot be read were left out; a Refusal where the API server
    will not list CronJobs (`REFUSED`). Raises KubeError when it cannot answer. `watched`:
    the CronJobs (JSON form) of the process's watched cache, read instead of a list."""
    if watched is not None:
        return scheduled_runs(watched, now, horizon, names)
    batch = k8s.BatchV1Api(api)
    listing: Any = kube_call(
        "read CronJobs", paged(batch.list_cron_job_for_all_namespaces), expect=REFUSED
    )
    if isinstance(listing, Refusal):
        return listing
    as_json = api.sanitize_for_serialization
    return scheduled_runs((as_json(c) for c in listing.items or []), now, horizon, names)


def run_pool(run: ScheduledRun, pools: Sequence[NodePool]) -> NodePool | None:
    """The pool `run` goes to: the one its template names (None where no pool configured
    here has that name), else the one pool whose GPU model it allows (any, where it names
    none) and whose node holds one of its pods; None where none or several do."""
    if run.pool is not None:
        return next((p for p in pools if p.name == run.pool), None)
    fits = [
        p
        for p in pools
        if (run.gpu_models is None or p.gpu_model in run.gpu_models)
        and run.gpus_per_pod <= p.gpus_per_node + NODE_RESIDUE
    ]
    return fits[0] if len(fits) == 1 else None


def run_nodes(run: ScheduledRun, gpus_per_node: int) -> int:
    """Whole nodes of `gpus_per_node` GPUs that `run` needs. Pods of a node's GPUs or more
    take whole nodes each (a pod never spans nodes: ceil(GPUs / GPUs per node) per pod);
    pods of fewer whole GPUs go as many to a node as fit whole, which is ceil(total GPUs /
    GPUs per node) where their GPUs divide a node's, and more where they do not (five
    6-GPU pods need five 8-GPU nodes, where their 30 GPUs would pack onto 4); pods of
    shared GPUs or MIG instances pack by their GPUs (ceil(total GPUs / GPUs per node))."""
    per_pod = run.gpus_per_pod
    if run.pods <= 0 or per_pod <= 0:
        return 0
    if per_pod >= gpus_per_node - NODE_RESIDUE:
        return run.pods * whole_nodes(per_pod / gpus_per_node)
    if abs(per_pod - round(per_pod)) < NODE_RESIDUE:
        return whole_nodes(run.pods / (gpus_per_node // round(per_pod)))
    return whole_nodes(run.gpus / gpus_per_node)


def scheduled_nodes(
    runs: Sequence[ScheduledRun],
    pools: Sequence[NodePool],
    now: datetime,
    step_seconds: float,
) -> dict[str, ScheduledNodes]:
    """Per pool, the whole nodes of each run due within the pool's boot time plus one
    demand step, and how many minutes ahead it fires, in time order; every pool has an
    entry (empty where no run is due: known to be none)."""
    now = now.replace(tzinfo=UTC) if now.tzinfo is None else now
    due: dict[str, list[tuple[float, int]]] = {p.name: [] for p in pools}
    for run in runs:
        pool = run_pool(run, pools)
        if pool is None:
            continue
        ahead = (run.at - now).total_seconds() / 60
        nodes = run_nodes(run, pool.gpus_per_node)
        if 0 < ahead <= (pool.boot_seconds + step_seconds) / 60 and nodes > 0:
            due[pool.name].append((ahead, nodes))
    return {
        name: ScheduledNodes(tuple(m for m, _ in sorted(found)), tuple(n for _, n in sorted(found)))
        for name, found in due.items()
    }
