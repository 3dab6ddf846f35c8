"""A seeded synthetic GPU cluster workload: node pools, a job stream, and its demand.

The embedded default for the demo and the tests, so neither needs the shared traces. The
job stream follows what the Philly and Helios characterisations report: arrivals with
daily and weekly cycles, a slow trend and bursts; job sizes mostly 1 GPU with some 2/4/8
and a few multi-node 16-64 GPU jobs; log-normal (heavy-tailed) durations; GPU-sharing
inference jobs asking part of one GPU.

Demand is what the jobs would hold if each ran the moment it was submitted: per pool and
minute, the GPUs (GPU-sharing jobs count their share, `gpu_milli / 1000`) of every job
submitted and not yet finished. No queue is modelled here; waiting for capacity is what the
scaler's job-level simulation adds on top of these jobs.

Pool fields use the names of `scaler.cluster.pools.NodePool`, so the `pools.yaml` that
`gpuscale generate` writes loads there unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from predictor.data.loaders import DemandTrace
from predictor.foundation.config_files import FieldError, load_model
from predictor.foundation.errors import InputError
from predictor.telemetry.cron import CronSchedule, ScheduleError, parse_schedule
from scaler.cluster.pools import NodePool

DEFAULT_CONFIG_NAME = "synthetic_default.yaml"
MINUTES_PER_DAY = 24 * 60
WHOLE_GPU_MILLI = 1000
# Every job of the span is drawn and held in memory: 10,000 an hour over a year is 88 million
# rows, far past any cluster's scheduler (the default streams run 16-18 an hour).
MAX_JOBS_PER_HOUR = 10_000


class DurationConfig(BaseModel):
    """Log-normal run time in minutes, clipped to [min_minutes, max_minutes]."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    median_minutes: float = Field(gt=0)
    sigma: float = Field(ge=0, le=4)
    min_minutes: int = Field(default=1, ge=1)
    max_minutes: int = Field(gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> DurationConfig:
        if self.max_minutes < self.min_minutes:
            raise ValueError("max_minutes is below min_minutes")
        return self


class BurstConfig(BaseModel):
    """Episodes (a deadline, a sweep) when arrivals multiply by `factor`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    per_week: float = Field(default=0.0, ge=0, le=7 * 24)  # each burst is drawn in a loop
    mean_hours: float = Field(default=3.0, gt=0)
    factor: float = Field(default=3.0, ge=1, le=100)


class StreamConfig(BaseModel):
    """One kind of job. The arrival rate is `jobs_per_hour` at the daily mean on a weekday
    at the start, shaped by the daily cycle (peak at `peak_hour`), the weekend factor, the
    weekly trend and the bursts."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1)
    kind: Literal["training", "inference"]
    pools: dict[str, float] = Field(min_length=1, description="pool name -> choice weight")
    jobs_per_hour: float = Field(gt=0, le=MAX_JOBS_PER_HOUR)
    gpus: dict[int, float] = Field(min_length=1, description="GPUs per job -> weight")
    gpu_milli: dict[int, float] = Field(
        default={WHOLE_GPU_MILLI: 1.0}, description="share of a 1-GPU job's GPU -> weight"
    )
    host_share: float = Field(
        default=0.5, gt=0, le=1, description="share of a node's CPU and memory per GPU"
    )
    priority: int = 0
    duration: DurationConfig
    daily_amplitude: float = Field(default=0.3, ge=0, le=1)
    peak_hour: float = Field(default=14.0, ge=0, lt=24)
    weekend_factor: float = Field(default=0.7, gt=0, le=2)
    trend_per_week: float = Field(default=0.0, gt=-1, le=1)
    bursts: BurstConfig = BurstConfig()

    @model_validator(mode="after")
    def _weights(self) -> StreamConfig:
        for name in ("pools", "gpus", "gpu_milli"):
            weights = getattr(self, name)
            if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
                raise ValueError(f"{name}: weights must be non-negative with a positive sum")
        if any(g < 1 for g in self.gpus):
            raise ValueError("gpus: job sizes must be at least 1")
        if any(not 0 < m <= WHOLE_GPU_MILLI for m in self.gpu_milli):
            raise ValueError("gpu_milli: shares must be in 1..1000")
        return self


class ScheduledConfig(BaseModel):
    """Jobs a CronJob starts: one run of `gpus` GPUs (a gang of whole nodes where more than
    a node holds) in `pool` at every time the 5-field cron expression `cron` names (the
    workload's clock, UTC), each running `duration_minutes`. Their times are known ahead,
    as the loop reads a CronJob's schedule (Kubernetes' cron dialect, `telemetry.cron`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1)
    pool: str
    cron: str = Field(min_length=1)
    gpus: int = Field(ge=1)
    duration_minutes: int = Field(ge=1, le=7 * MINUTES_PER_DAY)
    host_share: float = Field(default=0.5, gt=0, le=1)
    priority: int = 0

    @model_validator(mode="after")
    def _cron(self) -> ScheduledConfig:
        self.schedule()  # read as the CronJob controller reads spec.schedule, or refused
        return self

    def schedule(self) -> CronSchedule:
        try:
            return parse_schedule(self.cron)
        except ScheduleError as exc:
            raise ValueError(f"cron: {exc.reason}") from None


class WorkloadConfig(BaseModel):
    """A cluster and its job streams (random arrivals, and scheduled runs)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    start: datetime
    # At least one minute: the demand is per minute, and a shorter span has none.
    days: float = Field(ge=1 / MINUTES_PER_DAY, le=365)
    warmup_days: float = Field(default=3.0, ge=0, le=30)
    pools: list[NodePool] = Field(min_length=1)
    streams: list[StreamConfig] = Field(min_length=1)
    scheduled: list[ScheduledConfig] = Field(default_factory=list)
    # Pools whose boot the workload pins, in minutes (a serving pool whose nodes pull a
    # multi-GB image and load a model): a run's one boot time (`--boot-minutes`) sets
    # the other pools' only.
    boot_minutes: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _references(self) -> WorkloadConfig:
        pools = {pool.name: pool for pool in self.pools}
        if len(pools) != len(self.pools):
            raise FieldError("pools", "pool names must be unique")
        for name, minutes in self.boot_minutes.items():
            if name not in pools:
                raise FieldError(f"boot_minutes.{name}", f"unknown pool {name!r}")
            if not 0 <= minutes <= 24 * 60:
                raise FieldError(f"boot_minutes.{name}", "must be 0 to 1440 minutes")
        for index, run in enumerate(self.scheduled):
            pool = pools.get(run.pool)
            if pool is None:
                raise FieldError(f"scheduled.{index}.pool", f"unknown pool {run.pool!r}")
            if run.gpus > pool.gpus_per_node and run.gpus % pool.gpus_per_node:
                raise FieldError(
                    f"scheduled.{index}.gpus",
                    f"a {run.gpus}-GPU run does not fill whole nodes of pool {run.pool!r}",
                )
            if run.gpus > pool.gpus_per_node * pool.max_size:
                raise FieldError(f"scheduled.{index}.gpus", f"the run exceeds pool {run.pool!r}")
        for index, stream in enumerate(self.streams):
            for name in stream.pools:
                pool = pools.get(name)
                if pool is None:
                    raise FieldError(f"streams.{index}.pools", f"unknown pool {name!r}")
                per_node = pool.gpus_per_node
                for size in stream.gpus:
                    if size > per_node and size % per_node:
                        raise FieldError(
                            f"streams.{index}.gpus",
                            f"a {size}-GPU job does not fill whole {per_node}-GPU nodes of"
                            f" pool {name!r}",
                        )
                    if size > per_node * pool.max_size:
                        raise FieldError(
                            f"streams.{index}.gpus", f"a {size}-GPU job exceeds pool {name!r}"
                        )
        return self


@dataclass(frozen=True, eq=False)
class SyntheticWorkload:
    """Jobs and demand over [start, end).

    `jobs`: one row per job, by submit time: `job_id`, `stream`, `kind` (training or
    inference), `pool`, `submit` (timestamp), `gpus`, `gpu_milli` (share of each GPU, < 1000
    for GPU-sharing jobs), `cpu_milli`, `memory_mib`, `duration_min`, `priority`. It holds
    the jobs submitted in the window and those from the warm-up still running at `start`
    (a cluster never starts empty), so some submit times precede `start`.

    `demand`: long table per pool at one-minute steps: `unique_id` (pool name), `ds`, `y`
    (GPUs held if every job ran at once).

    `intensity`: the same table of the random streams' true request intensity, the GPUs
    their jobs are expected to ask per minute (daily and weekly cycle, trend and the bursts
    drawn): what a perfect forecast of the request rate would know. Scheduled runs are
    not in it; `jobs["scheduled"]` marks them.
    """

    seed: int
    start: pd.Timestamp
    end: pd.Timestamp
    pools: list[NodePool]
    jobs: pd.DataFrame
    demand: pd.DataFrame
    intensity: pd.DataFrame
    scheduled: tuple[ScheduledConfig, ...] = ()
    pinned_boot: Mapping[str, float] = field(default_factory=dict)  # minutes, by pool

    def trace(self, split: str | pd.Timestamp | None = None) -> DemandTrace:
        """The demand as a trace (unit GPUs), with the generic test window."""
        return DemandTrace.from_frame(
            self.demand, kind="series", unit="gpus", path=f"synthetic:seed={self.seed}", split=split
        )


# A `days` given apart from the config (generate's and simulate's --days), held to its bounds.
DAYS = TypeAdapter(
    Annotated[float, WorkloadConfig.model_fields["days"]], config=ConfigDict(allow_inf_nan=False)
)


def checked_days(days: float, name: str = "days") -> float:
    """`days` if the config's `days` field takes it, else an InputError naming `name` (the
    field, or the option it came from)."""
    try:
        return DAYS.validate_python(days)
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].lower()
        raise InputError(f"{name} {days:g}: {reason}") from None


def default_config_path() -> Path:
    """The shipped default (package data of `scaler.evaluation`; `data/synthetic/default.yaml` in
    the repository is a link to it)."""
    return Path(str(resources.files("scaler.evaluation") / DEFAULT_CONFIG_NAME))


def load_config(path: str | Path | None = None) -> WorkloadConfig:
    """Read and validate a YAML workload config (the default when `path` is None); errors
    name the file and the field, e.g. `pools.0.max_size`."""
    return load_model(WorkloadConfig, default_config_path() if path is None else path)


def generate(config: WorkloadConfig, seed: int, days: float | None = None) -> SyntheticWorkload:
    """Jobs and per-pool demand for `days` (default: the config's), the same for a seed."""
    rng = np.random.default_rng(seed)
    span_days = config.days if days is None else checked_days(days)
    start = pd.Timestamp(config.start).floor("min")
    warmup = round(config.warmup_days * MINUTES_PER_DAY)
    minutes = round(span_days * MINUTES_PER_DAY)
    pools = {pool.name: pool for pool in config.pools}
    drawn = [_stream_jobs(s, pools, start, warmup, minutes, rng) for s in config.streams]
    parts = [jobs for jobs, _ in drawn]
    parts += [
        _scheduled_jobs(run, pools[run.pool], start, warmup, minutes) for run in config.scheduled
    ]
    intensity = _intensity(
        config.streams, [rate for _, rate in drawn], list(pools), start, warmup, minutes
    )
    jobs = pd.concat(parts, ignore_index=True)
    # Warm-up jobs matter only while they still run inside the window.
    jobs = jobs[jobs["minute"] + jobs["duration_min"] > 0]
    jobs = jobs.sort_values(["minute", "offset_s"], kind="stable").reset_index(drop=True)
    demand = _demand(jobs, list(pools), start, minutes)
    jobs.insert(0, "job_id", [f"job-{i:06d}" for i in range(len(jobs))])
    seconds = jobs["minute"].to_numpy() * 60 + jobs["offset_s"].to_numpy()
    jobs.insert(4, "submit", start + pd.to_timedelta(seconds, unit="s"))
    jobs = jobs.drop(columns=["minute", "offset_s"])
    return SyntheticWorkload(
        seed=seed,
        start=start,
        end=start + pd.Timedelta(minutes=minutes),
        pools=list(config.pools),
        jobs=jobs,
        demand=demand,
        intensity=intensity,
        scheduled=tuple(config.scheduled),
        pinned_boot=dict(config.boot_minutes),
    )


def with_boot(
    pools: list[NodePool], boot_minutes: float, pinned: Mapping[str, float] | None = None
) -> list[NodePool]:
    """The pools with another boot time (the job-level runs set it; the config has one),
    but those whose boot the workload pins (`pinned`, minutes by pool) at theirs."""
    pinned = pinned or {}
    return [
        p.model_copy(update={"boot_seconds": pinned.get(p.name, boot_minutes) * 60}) for p in pools
    ]


def pools_document(pools: list[NodePool]) -> dict[str, list[dict[str, object]]]:
    """The `{pools: [...]}` mapping that `scaler.cluster.pools.load_pools` reads."""
    return {"pools": [pool.model_dump() for pool in pools]}


def _stream_jobs(
    stream: StreamConfig,
    pools: dict[str, NodePool],
    start: pd.Timestamp,
    warmup: int,
    minutes: int,
    rng: np.random.Generator,
) -> tuple[pd.DataFrame, np.ndarray]:
    """The stream's jobs, and its expected arrivals in each minute from -warmup on."""
    offsets = np.arange(-warmup, minutes)
    rate = _arrival_rate(stream, start, offsets, rng)
    counts = rng.poisson(rate)
    minute = np.repeat(offsets, counts)
    n = len(minute)
    pool_names = list(stream.pools)
    pool = np.asarray(pool_names, dtype=object)[
        rng.choice(len(pool_names), size=n, p=_probabilities(stream.pools))
    ]
    sizes = np.fromiter(stream.gpus, dtype="int64")
    gpus = sizes[rng.choice(len(sizes), size=n, p=_probabilities(stream.gpus))]
    shares = np.fromiter(stream.gpu_milli, dtype="int64")
    milli = shares[rng.choice(len(shares), size=n, p=_probabilities(stream.gpu_milli))]
    milli = np.where(gpus == 1, milli, WHOLE_GPU_MILLI)
    spec = stream.duration
    raw = rng.lognormal(math.log(spec.median_minutes), spec.sigma, size=n)
    duration = np.clip(np.rint(raw), spec.min_minutes, spec.max_minutes).astype("int64")
    per_gpu_cpu = np.array([pools[p].cpu_milli_per_node / pools[p].gpus_per_node for p in pool])
    per_gpu_mem = np.array([pools[p].memory_mib_per_node / pools[p].gpus_per_node for p in pool])
    gpu_equiv = gpus * milli / WHOLE_GPU_MILLI
    frame = _job_frame(
        stream.name,
        stream.kind,
        pool,
        minute,
        rng.uniform(0, 60, size=n).round(3),
        gpus,
        milli,
        gpu_equiv,
        per_gpu_cpu,
        per_gpu_mem,
        stream.host_share,
        duration,
        stream.priority,
    )
    return frame, rate


def _job_frame(
    name: str,
    kind: str,
    pool: np.ndarray,
    minute: np.ndarray,
    offset_s: np.ndarray,
    gpus: np.ndarray,
    milli: np.ndarray,
    gpu_equiv: np.ndarray,
    per_gpu_cpu: np.ndarray,
    per_gpu_mem: np.ndarray,
    host_share: float,
    duration: np.ndarray,
    priority: int,
    scheduled: bool = False,
) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "stream": name,
            "kind": kind,
            "pool": pool,
            "minute": minute,
            "offset_s": offset_s,
            "gpus": gpus,
            "gpu_milli": milli,
            # Whole cores and GiB, at least one of each: what a real pod spec would ask.
            "cpu_milli": np.maximum(
                1000, np.floor(per_gpu_cpu * gpu_equiv * host_share / 1000) * 1000
            ).astype("int64"),
            "memory_mib": np.maximum(
                1024, np.floor(per_gpu_mem * gpu_equiv * host_share / 1024) * 1024
            ).astype("int64"),
            "duration_min": duration,
            "priority": priority,
            "scheduled": scheduled,
        }
    )


def _scheduled_jobs(
    run: ScheduledConfig, pool: NodePool, start: pd.Timestamp, warmup: int, minutes: int
) -> pd.DataFrame:
    """One job at every time the run's cron names in [start - warmup, start + minutes)."""
    first = (start - pd.Timedelta(minutes=warmup + 1)).to_pydatetime()
    last = (start + pd.Timedelta(minutes=minutes - 1)).to_pydatetime()
    times = [
        int((pd.Timestamp(at).tz_localize(None) - start) / pd.Timedelta(minutes=1))
        for at in run.schedule().fire_times(first, last, limit=10**7)
    ]
    n = len(times)
    per_gpu_cpu = np.full(n, pool.cpu_milli_per_node / pool.gpus_per_node)
    per_gpu_mem = np.full(n, pool.memory_mib_per_node / pool.gpus_per_node)
    gpus = np.full(n, run.gpus, dtype="int64")
    return _job_frame(
        run.name,
        "training",
        np.full(n, pool.name, dtype=object),
        np.asarray(times, dtype="int64"),
        np.zeros(n),
        gpus,
        np.full(n, WHOLE_GPU_MILLI, dtype="int64"),
        gpus.astype(float),
        per_gpu_cpu,
        per_gpu_mem,
        run.host_share,
        np.full(n, run.duration_minutes, dtype="int64"),
        run.priority,
        scheduled=True,
    )


def _intensity(
    streams: Sequence[StreamConfig],
    rates: Sequence[np.ndarray],
    pool_names: list[str],
    start: pd.Timestamp,
    warmup: int,
    minutes: int,
) -> pd.DataFrame:
    """Per pool and minute of [start, start + minutes): the GPUs the random streams'
    jobs are expected to ask (arrivals x pool share x mean GPUs of a job)."""
    per_pool = {name: np.zeros(minutes) for name in pool_names}
    for stream, rate in zip(streams, rates, strict=True):
        sizes = np.fromiter(stream.gpus, dtype=float)
        size_p = _probabilities(stream.gpus)
        shares = np.fromiter(stream.gpu_milli, dtype=float) / WHOLE_GPU_MILLI
        share = float((shares * _probabilities(stream.gpu_milli)).sum())
        # A share applies to 1-GPU jobs only.
        mean_gpus = float((sizes * size_p).sum()) - float(size_p[sizes == 1].sum()) * (1 - share)
        for name, p in zip(stream.pools, _probabilities(stream.pools), strict=True):
            per_pool[name] += rate[warmup:] * p * mean_gpus
    ds = pd.date_range(start, periods=minutes, freq="min")
    return pd.concat(
        [pd.DataFrame({"unique_id": n, "ds": ds, "y": per_pool[n]}) for n in sorted(pool_names)],
        ignore_index=True,
    )


def _arrival_rate(
    stream: StreamConfig, start: pd.Timestamp, offsets: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Expected arrivals in each minute."""
    moments = start + pd.to_timedelta(offsets, unit="min")
    hour = moments.hour.to_numpy() + moments.minute.to_numpy() / 60
    daily = 1 + stream.daily_amplitude * np.cos(2 * np.pi * (hour - stream.peak_hour) / 24)
    weekend = np.where(moments.dayofweek.to_numpy() >= 5, stream.weekend_factor, 1.0)
    trend = (1 + stream.trend_per_week) ** (offsets / (7 * MINUTES_PER_DAY))
    burst = np.ones(len(offsets))
    weeks = len(offsets) / (7 * MINUTES_PER_DAY)
    for _ in range(rng.poisson(stream.bursts.per_week * weeks)):
        first = rng.integers(0, len(offsets))
        length = max(1, round(rng.exponential(stream.bursts.mean_hours) * 60))
        burst[first : first + length] *= stream.bursts.factor
    return stream.jobs_per_hour / 60 * daily * weekend * trend * burst


def _demand(
    jobs: pd.DataFrame, pool_names: list[str], start: pd.Timestamp, minutes: int
) -> pd.DataFrame:
    """GPUs held per pool and minute: +gpus at the submit minute, -gpus at the end."""
    first = np.clip(jobs["minute"].to_numpy(), 0, minutes)
    last = np.clip(jobs["minute"].to_numpy() + jobs["duration_min"].to_numpy(), 0, minutes)
    held = jobs["gpus"].to_numpy() * jobs["gpu_milli"].to_numpy() / WHOLE_GPU_MILLI
    ds = pd.date_range(start, periods=minutes, freq="min")
    frames = []
    for name in sorted(pool_names):
        mine = (jobs["pool"] == name).to_numpy()
        change = np.zeros(minutes + 1)
        np.add.at(change, first[mine], held[mine])
        np.add.at(change, last[mine], -held[mine])
        level = np.cumsum(change[:minutes]).round(3)  # sums of thousandths: no float drift
        frames.append(pd.DataFrame({"unique_id": name, "ds": ds, "y": level}))
    return pd.concat(frames, ignore_index=True)


def _probabilities(weights: dict) -> np.ndarray:
    values = np.fromiter(weights.values(), dtype="float64")
    return values / values.sum()
