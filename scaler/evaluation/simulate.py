"""`gpuscale simulate`'s runs: a trace replayed through every policy with its frontier, or
the synthetic job stream through the job simulator, each with its pictures and summary.
The command line parses and prints; what is run and measured is here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import track

from predictor.data.loaders import load_trace
from predictor.foundation.errors import InputError
from predictor.models.forecast import Forecaster
from scaler.evaluation.job_frontier import (
    ABLATION_KNOBS,
    ABLATIONS,
    FRONTIER_KNOBS,
    HEADROOM_NODES,
    ablation_view,
    compare_on_workload,
    matched_view,
)
from scaler.evaluation.job_simulator import WARMUP
from scaler.evaluation.scaling_bench import (
    BenchSettings,
    baseline_runs,
    planner_run,
    prepare_trace,
    summarize,
    sweep_runs,
)
from scaler.evaluation.scaling_plots import fleet_plot, frontier_plot, jobs_plot
from scaler.evaluation.synthetic import generate, load_config, with_boot
from scaler.planning.planner import PlannerPolicy


def simulate_trace(
    out: Path,
    spec: str,
    policy: PlannerPolicy,
    make_forecaster: Callable[[], Forecaster],
    lag: int,
    split: str | None,
    gpus_per_node: int | None,
    knobs: list[float] | None,
) -> dict[str, object]:

    trace = load_trace(
        spec, split=split, unit="gpus" if gpus_per_node and spec.startswith("series:") else None
    )
    settings = BenchSettings(lags=(lag,), gpus_per_node=gpus_per_node, policy=policy)
    prepared = prepare_trace(trace, make_forecaster, settings)
    if not prepared.series:
        raise InputError("the trace has no series with both training and test data", path=spec)
    item = prepared.series[0]
    baselines = baseline_runs(item, lag)
    sweeps = sweep_runs(item, lag)
    ours = planner_run(item, lag, policy)
    frontier = {}
    out.mkdir(parents=True, exist_ok=True)  # once the inputs are read: none left on bad ones
    knob_values = sorted(set(knobs or [0.001, 0.003, 0.01, 0.03, 0.1]))
    # on stderr: stdout carries the table or the --json document
    for knob in track(knob_values, description="knob", console=Console(stderr=True)):
        frontier[knob] = planner_run(item, lag, policy.with_knob(target_shortage=knob))
    pictures = [
        fleet_plot([*baselines, ours], out / "fleet.png"),
        frontier_plot(frontier, [*baselines, *sweeps], out / "frontier.png"),
    ]
    swept = [o.row() for o in sweeps]
    points = [v.row() for v in frontier.values()]
    return {
        "title": f"{item.series.trace} {item.series.series}, L = {lag}",
        "rows": [o.row() for o in (*baselines, ours)],
        "sweeps": swept,
        "frontier": [{"target_shortage": k, **v} for k, v in zip(frontier, points, strict=True)],
        "matched": summarize([*(o.row() for o in baselines), *swept, *points]),
        "pictures": [str(p) for p in pictures],
    }


def simulate_jobs(
    out: Path,
    policy: PlannerPolicy,
    make_forecaster: Callable[[], Forecaster],
    workload: Path | None,
    seed: int,
    days: float,
    boot_minutes: float,
    queue: str = "fifo",
    *,
    frontier: bool = False,
    knobs: list[float] | None = None,
    workers: int = 1,
) -> dict[str, object]:
    """reactive, headroom at 1-8 spare nodes per pool, headroom tuned per pool on the
    week before the scored window, predictive at the policy's knob (with `frontier`, also
    at each of `knobs`, by default `FRONTIER_KNOBS`) and the ablations that price its
    request forecast (at the default knob; with `frontier` also at `ABLATION_KNOBS`), on
    `workers` processes; rows, the matched view, the ablation view and jobs.png."""

    generated = generate(load_config(workload), seed=seed, days=days)
    pools = with_boot(generated.pools, boot_minutes, generated.pinned_boot)
    # The first half fits the model (less the warm-up), the second half is scored.
    half = (generated.end - generated.start) / 2
    start = generated.start + half
    comparison = compare_on_workload(
        generated.jobs,
        generated.demand,
        pools,
        make_forecaster(),
        start=start,
        end=generated.end,
        warmup=min(WARMUP, half / 2),
        policy=policy,
        queue=queue,
        headroom=HEADROOM_NODES,
        knobs=(knobs or FRONTIER_KNOBS) if frontier else (),
        ablations=ABLATIONS,
        ablation_knobs=(knobs or ABLATION_KNOBS) if frontier else (),
        tuned_headroom=True,
        intensity=generated.intensity,
        workers=workers,
    )
    rows = comparison.rows()
    reactive, predictive = comparison.reactive.row(), comparison.predictive.row()
    out.mkdir(parents=True, exist_ok=True)  # once the inputs are read: none left on bad ones
    placement = comparison.reactive.placement
    return {
        "title": f"job-level, synthetic seed {seed}, boot {boot_minutes:g} min"
        + "".join(f", {n} {m:g} min" for n, m in sorted(generated.pinned_boot.items()))
        + f", from {start};"
        f" placement {placement}, queue {queue}",
        "placement": {"policy": placement, "queue": queue},
        "rows": rows,
        "matched": matched_view(rows),
        "ablations": ablation_view(rows),
        "request_forecast": None
        if comparison.requests is None or comparison.requests.backtest is None
        else comparison.requests.backtest.to_dict(),
        "gpu_hours_extra": predictive["gpu_hours"] / reactive["gpu_hours"] - 1,
        "p95_wait_cut_min": reactive["wait_p95_min"] - predictive["wait_p95_min"],
        "pictures": [str(jobs_plot(comparison, out / "jobs.png"))],
    }
