"""CronJobs as known demand: the runs of batch/v1 CronJobs due in a window, and what each asks.

A CronJob says ahead of time when a job starts and what its pods are, so its GPU demand
is known before any pod exists: a run due at 02:00 of 4 pods x 8 GPUs needs 4 nodes ready
at 02:00, which a pool must start booting a boot time before. `runs_due` reads one
CronJob (JSON form) into the runs it fires in a window `(now, until]`:

- when: its `spec.schedule` in `spec.timeZone` (`cron.parse_schedule`, Kubernetes' cron
  dialect); a suspended CronJob (`spec.suspend`) fires nothing;
- how many pods: its job template's `parallelism` (1 by default), no more than its
  `completions` where set, since a Job never runs more pods at once than it has
  completions left; a parallelism of 0 makes no pod;
- what each pod asks: the template's pod read as a pending pod is (`kube_objects.read_pod`:
  whole GPUs, a GPU share, MIG instances in GPU equivalents, `PodRequest.gpu_demand`), and
  the pool it wants (its node selector or node affinity on the pool label), else None;
  the GPU models its template allows (the GPU model label in its node selector, or `In`
  its required node affinity names in every term), so a caller can place a run that
  names no pool on the one pool of its model;
- how many runs: every fire time in the window, but one only where `concurrencyPolicy` is
  Forbid or Replace: those runs never overlap, so the later ones in the window reuse the
  first one's nodes.

A run is counted only while it has not fired (its time after `now`): once it fires, its
Job makes pods, which are counted as pending pods from then on, so no run counts twice.
A run that asks no GPU is no GPU demand and is left out.

A schedule the reader cannot read raises `cron.ScheduleError` naming the CronJob
(namespace/name) and the field; `scheduled_runs` reads many and keeps such errors as
problems, for a caller to log and go on without that CronJob.

Not read: what is running now (a Forbid run is skipped if the previous one still runs,
which only the Jobs say), `startingDeadlineSeconds` (about runs missed, not runs ahead),
and Kueue: a CronJob whose template carries Kueue's queue label makes suspended Jobs whose
Workloads then wait in the queue; their runs are read here in the pool their template
selects, and once fired they are counted as queued Workloads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from predictor.telemetry.cron import ScheduleError, parse_schedule
from predictor.telemetry.kube_objects import KUBE_NAMES, KubeNames, read_pod, required_terms

# Fire times read per CronJob and window: an every-minute schedule fills a day with 1440.
MAX_RUNS = 1440
SERIAL_POLICIES = ("Forbid", "Replace")


@dataclass(frozen=True, slots=True)
class ScheduledRun:
    """One run of a CronJob that has not fired yet: `pods` pods of `gpus_per_pod` GPUs
    each (`PodRequest.gpu_demand`), at `at` (UTC), in `pool` (None: its template names
    none), on one of `gpu_models` (None: its template names none)."""

    cron_job: str  # namespace/name
    at: datetime
    pool: str | None
    pods: int
    gpus_per_pod: float
    gpu_models: frozenset[str] | None = None

    @property
    def gpus(self) -> float:
        return self.pods * self.gpus_per_pod


@dataclass(frozen=True, slots=True)
class ScheduledRuns:
    """The runs due in a window of many CronJobs, and why the CronJobs left out were (a
    schedule or time zone that could not be read)."""

    runs: tuple[ScheduledRun, ...] = ()
    problems: tuple[str, ...] = ()
    # The pools (None: named by none) of every CronJob read that asks GPUs, so a reading
    # can say that none of its runs is due rather than nothing.
    pools: frozenset[str | None] = frozenset()

    def gpus_by_pool(self) -> dict[str | None, float]:
        """GPUs of the runs, per pool they name (None: none); 0 for the pools of the
        CronJobs read that fire nothing in the window."""
        out: dict[str | None, float] = dict.fromkeys(self.pools, 0.0)
        for run in self.runs:
            out[run.pool] = out.get(run.pool, 0.0) + run.gpus
        return out


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _count(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def cron_job_id(cron_job: Mapping[str, Any]) -> str:
    meta = _map(cron_job.get("metadata"))
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"


def pods_per_run(job_spec: Mapping[str, Any]) -> int:
    """Pods a run's Job runs at once: its parallelism (1 by default), at most its
    completions where set."""
    pods = _count(job_spec.get("parallelism"), 1)
    completions = job_spec.get("completions")
    if isinstance(completions, int) and not isinstance(completions, bool):
        pods = min(pods, completions)
    return max(pods, 0)


def gpu_models(spec: Mapping[str, Any], names: KubeNames = KUBE_NAMES) -> frozenset[str] | None:
    """The GPU models a pod spec allows: the GPU model label's value in its node selector,
    else the values every required node-affinity term allows with `In` on that label
    (their union, since the terms are ORed); None where it names no model."""
    label = names.gpu_model_label
    selector = _map(spec.get("nodeSelector"))
    if selector.get(label):
        return frozenset({str(selector[label])})
    terms = required_terms(spec)
    if not terms:
        return None
    allowed: set[str] = set()
    for term in terms:
        values = [
            str(v)
            for e in term
            if e.get("key") == label and e.get("operator") == "In"
            for v in _list(e.get("values"))
        ]
        if not values:
            return None  # a term that names no model lets the pod go to any
        allowed.update(values)
    return frozenset(allowed)


def _template_pod(namespace: str, name: str, template: Mapping[str, Any]) -> dict[str, Any]:
    """The pod a job template's pod template makes (JSON form), pending."""
    meta = _map(template.get("metadata"))
    return {
        "metadata": {
            "namespace": namespace,
            "name": name,
            "labels": dict(_map(meta.get("labels"))),
            "annotations": dict(_map(meta.get("annotations"))),
        },
        "spec": dict(_map(template.get("spec"))),
        "status": {"phase": "Pending"},
    }


@dataclass(frozen=True, slots=True)
class CronJobDemand:
    """What each run of one CronJob asks, and when it fires (see the module docstring):
    `pods` pods of `gpus_per_pod` GPUs, in `pool` (None: its template names none), on one
    of `gpu_models` (None: any); `serial` where its runs never overlap (Forbid, Replace)."""

    cron_job: str  # namespace/name
    schedule: str
    time_zone: str | None
    pool: str | None
    pods: int
    gpus_per_pod: float
    gpu_models: frozenset[str] | None = None
    serial: bool = False

    def runs(self, now: datetime, until: datetime) -> tuple[ScheduledRun, ...]:
        """Its runs after `now` up to `until` (one, the first, where serial). Raises
        ScheduleError naming the CronJob and the field when its schedule or time zone
        cannot be read."""
        try:
            times = parse_schedule(self.schedule, self.time_zone).fire_times(now, until, MAX_RUNS)
        except ScheduleError as exc:
            raise exc.of(self.cron_job) from None
        if self.serial:
            times = times[:1]
        return tuple(
            ScheduledRun(
                self.cron_job, at, self.pool, self.pods, self.gpus_per_pod, self.gpu_models
            )
            for at in times
        )


def read_cron_job(
    cron_job: Mapping[str, Any], names: KubeNames = KUBE_NAMES
) -> CronJobDemand | None:
    """What each run of `cron_job` (JSON form) asks; None where it fires no GPU demand: it
    is suspended, its runs make no pod or ask no GPU. Raises ScheduleError naming the
    CronJob when it has no schedule."""
    spec = _map(cron_job.get("spec"))
    if spec.get("suspend") is True:
        return None
    where = cron_job_id(cron_job)
    job_spec = _map(_map(spec.get("jobTemplate")).get("spec"))
    template = _map(job_spec.get("template"))
    pods = pods_per_run(job_spec)
    namespace, _, name = where.partition("/")
    pod = read_pod(_template_pod(namespace, name, template), names)
    if pods == 0 or pod.gpu_demand <= 0 or pod.placeholder:
        return None
    schedule = spec.get("schedule")
    if not isinstance(schedule, str):
        raise ScheduleError("spec.schedule", "Required value", where)
    zone = spec.get("timeZone")
    return CronJobDemand(
        cron_job=where,
        schedule=schedule,
        time_zone=zone if isinstance(zone, str) else None,
        pool=pod.wanted_pool,
        pods=pods,
        gpus_per_pod=pod.gpu_demand,
        gpu_models=gpu_models(_map(template.get("spec")), names),
        serial=spec.get("concurrencyPolicy") in SERIAL_POLICIES,
    )


def runs_due(
    cron_job: Mapping[str, Any],
    now: datetime,
    until: datetime,
    names: KubeNames = KUBE_NAMES,
) -> tuple[ScheduledRun, ...]:
    """The runs `cron_job` (JSON form) fires after `now` up to `until` that ask GPUs (see
    the module docstring). Raises ScheduleError naming the CronJob and the field when
    its schedule or time zone cannot be read."""
    demand = read_cron_job(cron_job, names)
    return () if demand is None else demand.runs(now, until)


def scheduled_runs(
    cron_jobs: Iterable[Mapping[str, Any]],
    now: datetime,
    horizon: timedelta,
    names: KubeNames = KUBE_NAMES,
) -> ScheduledRuns:
    """The runs of `cron_jobs` (JSON form) due after `now` up to `now + horizon`, in time
    order; the pools of every CronJob read that asks GPUs, due in the window or not; and
    the CronJobs left out because their schedule could not be read (why, one line each)."""
    runs: list[ScheduledRun] = []
    pools: set[str | None] = set()
    problems: list[str] = []
    for cron_job in cron_jobs:
        try:
            demand = read_cron_job(cron_job, names)
            if demand is not None:
                runs.extend(demand.runs(now, now + horizon))
                pools.add(demand.pool)
        except ScheduleError as exc:
            problems.append(f"{exc}; its runs are not planned for")
    runs.sort(key=lambda r: (r.at, r.cron_job))
    return ScheduledRuns(tuple(runs), tuple(problems), frozenset(pools))
