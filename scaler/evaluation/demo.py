"""The newcomer's tour: one synthetic cluster through every stage of the product.

generate a workload -> store its demand -> train and register the default model ->
forecast with quantile bands -> replay the job stream under the reactive baseline, reactive
plus spare nodes (the buffer teams run instead) and the predictive scaler -> a short report
(Markdown + HTML + PNG) that says what happened.

Everything runs on the embedded defaults: no cluster, no cloud account, no shared traces.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from predictor.foundation.atomic_files import write_text
from predictor.lifecycle.registry import ModelRegistry
from predictor.lifecycle.training import stepped_history, train_and_register
from predictor.telemetry.store import TelemetryStore
from scaler.evaluation.synthetic import SyntheticWorkload, generate, load_config, with_boot

MODEL_NAME = "gpuscale"
SHOWN_HORIZONS = (1, 3, 18)  # steps of 10 minutes: 10 min, 30 min, 3 h


@dataclass(frozen=True)
class DemoResult:
    """What the demo produced, and the figures its report quotes."""

    out: Path
    report: Path
    pictures: dict[str, Path]
    figures: dict[str, object]


def run_demo(
    out: Path,
    *,
    seed: int = 7,
    days: float = 28.0,
    boot_minutes: float = 10.0,
    on_step: Callable[[str], None] | None = None,
) -> DemoResult:
    """Run the tour into `out` (its `state/` and `models/` are created there)."""
    from predictor.evaluation.forecast_plot import plot_forecasts
    from scaler.evaluation.job_frontier import HEADROOM_NODES, compare_on_workload
    from scaler.evaluation.scaling_plots import jobs_plot

    def step(message: str) -> None:
        if on_step is not None:
            on_step(message)

    out.mkdir(parents=True, exist_ok=True)
    step("generating a synthetic GPU cluster and its job stream")
    workload = generate(load_config(), seed=seed, days=days)
    trace = workload.trace()

    step("storing the demand history in the telemetry store")
    points = TelemetryStore(out / "state").import_traces([trace.resampled()], source="demo")

    step("training the default forecaster (backtest first, then a final fit)")
    # Only the horizons the report shows: the product's default trains six, which doubles
    # the demo's longest step for nothing a newcomer sees.
    record = train_and_register(
        ModelRegistry(out / "models"),
        MODEL_NAME,
        [trace],
        MODEL_NAME,
        params={"horizons": SHOWN_HORIZONS},
    )
    summary = record.metadata["backtest"]["summary"]

    step("forecasting demand with quantile bands")
    model, _ = ModelRegistry(out / "models").load(MODEL_NAME)
    history = stepped_history([trace])
    levels = (0.5, 0.9, 0.99)
    back = model.rolling(history, 1, history["ds"].max() - pd.Timedelta(days=2), levels)
    ahead = model.forecast(history, list(SHOWN_HORIZONS), levels)
    forecast_png = out / "forecast.png"
    plot_forecasts(
        history, back, ahead, forecast_png, title="Demand per pool: forecast against actual"
    )

    step(
        "replaying the jobs: reactive, reactive plus spare nodes and predictive scaling"
        f" ({boot_minutes:g}-min boot)"
    )
    pools = with_boot(workload.pools, boot_minutes)
    start = workload.start + (workload.end - workload.start) / 2
    comparison = compare_on_workload(
        workload.jobs,
        workload.demand,
        pools,
        _fresh_model(),
        start=start,
        end=workload.end,
        headroom=HEADROOM_NODES,
        workers=len(os.sched_getaffinity(0)),
    )
    jobs_png = jobs_plot(comparison, out / "scaling.png")
    reactive, predictive = comparison.reactive.row(), comparison.predictive.row()
    best = comparison.best_headroom()
    if best is None:
        raise RuntimeError("the comparison ran no headroom setting")
    headroom = best.row()

    figures: dict[str, object] = {
        "seed": seed,
        "days": days,
        "pools": [p.name for p in pools],
        "jobs": len(workload.jobs),
        "stored_points": points,
        "model": f"{record.name} v{record.version}",
        "forecast_summary": summary,
        "scaling": {"reactive": reactive, "headroom": headroom, "predictive": predictive},
        "gpu_hours_extra": predictive["gpu_hours"] / reactive["gpu_hours"] - 1,
    }
    pictures = {"forecast": forecast_png, "scaling": Path(jobs_png)}
    step("writing the report")
    report = _write_report(out, workload, figures, pictures)
    return DemoResult(out, report, pictures, figures)


def _spare(row: dict[str, object]) -> str:
    return f"{row['knob']} spare node{'' if row['knob'] == 1 else 's'}"


def _more(change: float) -> str:
    return f"{abs(change):.1%} {'more' if change > 0 else 'fewer'}"


def _waited(ours: dict[str, float], theirs: dict[str, float]) -> str:
    """Our GPU-minutes waited against theirs."""
    if not theirs["gpu_minutes_waited"]:
        return f"{ours['gpu_minutes_waited']:,.0f} GPU-minutes (against none)"
    change = ours["gpu_minutes_waited"] / theirs["gpu_minutes_waited"] - 1
    return f"{abs(change):.1%} {'more' if change > 0 else 'less'} (GPU-minutes)"


def _fresh_model():
    from predictor.models import build

    return build(MODEL_NAME)


def _write_report(
    out: Path,
    workload: SyntheticWorkload,
    figures: dict[str, object],
    pictures: dict[str, Path],
) -> Path:
    reactive = figures["scaling"]["reactive"]  # type: ignore[index]
    headroom = figures["scaling"]["headroom"]  # type: ignore[index]
    predictive = figures["scaling"]["predictive"]  # type: ignore[index]
    lines = [
        "# gpuscale demo report",
        "",
        f"A synthetic GPU cluster (seed {figures['seed']}, {figures['days']:g} days, pools "
        f"{', '.join(figures['pools'])}) ran {figures['jobs']:,} jobs. Their GPU demand per "
        f"pool went into the telemetry store ({figures['stored_points']:,} points at 10-minute "
        f"steps), the default forecaster was trained on it and registered as "
        f"`{figures['model']}`, and the job stream was replayed under a reactive autoscaler "
        "(Kubernetes Cluster Autoscaler's behaviour: add nodes only once jobs wait), the same "
        "plus k spare nodes per pool (what teams run instead of a forecast: overprovisioning "
        "placeholder pods or a CapacityBuffer), and gpuscale's predictive scaler.",
        "",
        "## 1. Forecasting demand",
        "",
        "Backtest on the last quarter of the history: how the model's upper quantiles compare "
        "with the naive baseline (last value plus the typical change). A pinball ratio below "
        "1 means better than the baseline; coverage is the share of steps whose demand "
        "stayed under the quantile (0.90 and 0.99 are the aims).",
        "",
        "| horizon | pinball ratio p90 | pinball ratio p99 | coverage p90 | coverage p99 |",
        "|---|---|---|---|---|",
    ]
    for row in figures["forecast_summary"]:  # type: ignore[union-attr]
        lines.append(
            f"| {row['horizon_min']} min | {row['ratio_p90']:.2f} | {row['ratio_p99']:.2f} "
            f"| {row['coverage_p90']:.3f} | {row['coverage_p99']:.3f} |"
        )
    lines += [
        "",
        f"![forecast]({pictures['forecast'].name})",
        "",
        "## 2. Scaling ahead of demand",
        "",
        "Nodes take 10 minutes to boot. The reactive scaler only asks for a node once a job "
        "is already waiting; spare nodes are bought whatever the demand; the predictive "
        "scaler sets each pool's spare nodes on top of what jobs use or wait for from the "
        "whole nodes jobs asked for (a gang all at once): replayed under every spare level "
        "and scaled by their rate at the hour ahead, they show which spare saves more "
        "waiting than it costs, at one price of waiting for every pool, set by its "
        "service-level knob. Of the 1-4 spare nodes per pool tried, the row "
        "shown is the cheapest that waits no more than predictive (in GPU-minutes), or the "
        "least waiting if none does.",
        "",
        "| scaler | GPU-hours paid | cost | mean wait (min) | p95 wait (min) "
        "| jobs that waited | GPU-minutes waited |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, row in (
        ("reactive", reactive),
        (f"reactive + {_spare(headroom)} per pool", headroom),
        ("predictive", predictive),
    ):
        lines.append(
            f"| {label} | {row['gpu_hours']:,.0f} | {row['cost']:,.0f} "
            f"| {row['wait_mean_min']:.2f} | {row['wait_p95_min']:.1f} "
            f"| {row['share_waiting']:.1%} | {row['gpu_minutes_waited']:,.0f} |"
        )
    lines += [
        "",
        f"Predictive scaling pays {_more(figures['gpu_hours_extra'])} GPU-hours than "
        f"reactive and waits {_waited(predictive, reactive)}, p95 wait for capacity "
        f"{predictive['wait_p95_min']:.1f} against {reactive['wait_p95_min']:.1f} minutes; "
        f"against {_spare(headroom)} per pool "
        f"it pays {_more(predictive['gpu_hours'] / headroom['gpu_hours'] - 1)} GPU-hours "
        f"and waits {_waited(predictive, headroom)}.",
        "",
        f"![scaling]({pictures['scaling'].name})",
        "",
        "## What to try next",
        "",
        "- `gpuscale bench forecast|scaling|placement` on the real traces (see README).",
        "- `gpuscale simulate` for the cost/shortage frontier of the service-level knob.",
        f"- `gpuscale forecast --registry {out / 'models'} --state-dir {out / 'state'}"
        " --plot forecast.png`: the registered model on the stored history.",
        "",
    ]
    markdown = "\n".join(lines)
    write_text(out / "report.md", markdown)
    write_text(out / "report.html", _as_html(markdown))
    write_text(out / "figures.json", json.dumps(figures, indent=2, default=str))
    return out / "report.md"


def _as_html(markdown: str) -> str:
    """A readable page without a Markdown dependency: tables, headings, pictures."""
    body = []
    in_table = False
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-"):
                continue
            tag = "th" if not in_table else "td"
            if not in_table:
                body.append("<table>")
                in_table = True
            body.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells))
            continue
        if in_table:
            body.append("</table>")
            in_table = False
        if line.startswith("!["):
            src = line[line.index("(") + 1 : -1]
            body.append(f'<p><img src="{html.escape(src)}" style="max-width:100%"></p>')
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>")
        elif line.startswith("- "):
            body.append(f"<li>{html.escape(line[2:])}</li>")
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    if in_table:
        body.append("</table>")
    style = "body{font-family:sans-serif;max-width:60em;margin:2em auto}td,th{padding:.3em .8em}"
    return f"<!doctype html><title>gpuscale demo</title><style>{style}</style>\n" + "\n".join(body)
