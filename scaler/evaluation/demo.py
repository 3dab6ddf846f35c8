"""The newcomer's tour: one synthetic cluster through every stage of the product.

generate a workload -> store its demand -> train and register the default model ->
forecast with quantile bands -> replay the job stream under the reactive baseline, reactive
plus 1-8 spare nodes per pool, the spares a careful team tunes per pool on the week before,
and the predictive scaler at its knob settings -> a short report (Markdown + HTML + PNG)
that leads with the default against the tuned buffer, at the same waiting and at the same
cost.

Everything runs on the embedded defaults: no cluster, no cloud account, no shared traces.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from predictor.evaluation.backtest import TARGETS
from predictor.foundation.atomic_files import write_text
from predictor.lifecycle.registry import ModelRegistry
from predictor.lifecycle.training import stepped_history, train_and_register
from predictor.telemetry.store import TelemetryStore
from scaler.evaluation.synthetic import generate, load_config, with_boot

MODEL_NAME = "gpuscale"
SHOWN_HORIZONS = (1, 3, 18)  # steps of 10 minutes: 10 min, 30 min, 3 h
# The predictive points of the frontier picture (job_wait_share; the default, 0.1, is
# always run): from as much spare as 4-8 nodes per pool hold to less than one.
DEMO_KNOBS = (0.05, 0.5)


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
    knobs: Sequence[float] = DEMO_KNOBS,
    on_step: Callable[[str], None] | None = None,
) -> DemoResult:
    """Run the tour into `out` (its `state/` and `models/` are created there)."""
    from predictor.evaluation.forecast_plot import plot_forecasts
    from scaler.evaluation.job_frontier import HEADROOM_NODES, compare_on_workload
    from scaler.evaluation.scaling_plots import job_frontier_plot, jobs_plot

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
        "replaying the jobs: reactive, 1-8 spare nodes per pool, spares tuned per pool on the"
        f" week before, and predictive at {len(knobs)} knob settings ({boot_minutes:g}-min boot)"
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
        knobs=knobs,
        tuned_headroom=True,
        workers=len(os.sched_getaffinity(0)),
    )
    rows = comparison.rows()
    reactive, predictive = comparison.reactive.row(), comparison.predictive.row()
    figures: dict[str, object] = {
        "seed": seed,
        "days": days,
        "pools": [p.name for p in pools],
        "prices_per_node_hour": {p.name: p.price_per_hour for p in pools},
        "jobs": len(workload.jobs),
        "scored_from": str(start),
        "scored_days": (workload.end - start) / pd.Timedelta(days=1),
        "scored_jobs": reactive["jobs"],
        "stored_points": points,
        "model": f"{record.name} v{record.version}",
        "forecast_summary": summary,
        "forecast_aims": {
            "ratio_p90 and ratio_p99 at most": TARGETS["ratio_mean"],
            "worst_ratio at most": TARGETS["ratio_max"],
            **{
                f"{k} {'at least' if k.startswith('coverage') else 'at most'}": v
                for k, v in TARGETS.items()
                if k.startswith(("below", "coverage"))
            },
            "rmse_above_persistence": "none",
        },
        "forecast_met": all(bool(r["met"]) for r in summary),
        "scaling": {"reactive": reactive, "predictive": predictive, "rows": rows},
        "against_tuned": against_tuned(rows),
        "gpu_hours_extra": predictive["gpu_hours"] / reactive["gpu_hours"] - 1,
    }
    pictures = {
        "frontier": job_frontier_plot(rows, out / "frontier.png"),
        "forecast": forecast_png,
        "scaling": Path(jobs_plot(comparison, out / "scaling.png")),
    }
    step("writing the report")
    report = _write_report(out, figures, pictures)
    return DemoResult(out, report, pictures, figures)


def against_tuned(rows: Sequence[Mapping[str, object]]) -> dict[str, object]:
    """The default predictive row against the per-pool tuned buffer: the tuned settings'
    line read between them at our GPU-minutes waited and at our GPU-hours (the frontier's
    matched view, with only the tuned rows as the baselines), and the single tuned setting
    that is cheapest while waiting no more."""
    from scaler.evaluation.job_frontier import matched_view

    tuned = [r for r in rows if r["mode"] == "headroom-tuned"]
    ours = [r for r in rows if r["mode"] == "predictive"]
    view = next(m for m in matched_view([*tuned, *ours]) if m["default"])
    return {
        "tuned_settings": [r["spares"] for r in tuned],
        **{
            k: view[k]
            for k in (
                "knob",
                "gpu_hours",
                "gpu_minutes_waited",
                "envelope_gpu_hours",
                "envelope_saving",
                "envelope_gpu_minutes_waited",
                "envelope_wait_reduction",
                "cheapest_no_more_wait",
                "cheapest_gpu_hours",
                "gpu_hours_saving",
                "dominated_by",
            )
        },
    }


def headline(figures: Mapping[str, object]) -> str:
    """The report's first sentence: the default against the per-pool tuned buffer, at the
    same waiting and at the same cost, whichever way it comes out."""
    t = figures["against_tuned"]  # type: ignore[index]
    ours = f"gpuscale's predictive scaler (default knob, job_wait_share {t['knob']:g})"
    paid = f"{t['gpu_hours']:,.0f} GPU-hours for {t['gpu_minutes_waited']:,.0f} GPU-minutes waited"
    if t["envelope_saving"] is not None:
        at_wait = (
            f"the spare nodes tuned per pool on the week before, read between their settings at "
            f"the same waiting, pay {t['envelope_gpu_hours']:,.0f}: predictive pays "
            f"{_pct_more(-t['envelope_saving'])} GPU-hours"
        )
    else:
        at_wait = (
            "its waiting lies outside the range of the spare nodes tuned per pool on the week "
            "before, so no tuned buffer waits the same"
        )
    if t["envelope_wait_reduction"] is not None:
        at_cost = (
            f"at the same GPU-hours the tuned buffer waits "
            f"{t['envelope_gpu_minutes_waited']:,.0f} GPU-minutes, so predictive waits "
            f"{_pct_less(t['envelope_wait_reduction'])}"
        )
    else:
        at_cost = "no tuned setting pays the same GPU-hours"
    return f"On seed {figures['seed']}, {ours} pays {paid}; {at_wait}; {at_cost}."


def _pct_more(change: float) -> str:
    return f"{abs(change):.1%} {'more' if change > 0 else 'fewer'}"


def _pct_less(reduction: float) -> str:
    return f"{abs(reduction):.1%} {'less' if reduction > 0 else 'more'}"


def _label(row: Mapping[str, object]) -> str:
    mode = row["mode"]
    if mode == "reactive":
        return "reactive (Cluster Autoscaler)"
    if mode == "headroom":
        k = int(row["knob"])  # type: ignore[arg-type]
        return f"reactive + {k} spare node{'' if k == 1 else 's'} per pool"
    if mode == "headroom-tuned":
        spares = ", ".join(f"{p} {k}" for p, k in sorted(row["spares"].items()))  # type: ignore[union-attr]
        return f"spares tuned per pool ({spares})"
    default = ", default" if row["default"] else ""
    return f"predictive, knob {row['knob']:g}{default}"


def _missed(row: Mapping[str, object]) -> list[str]:
    """The aims a horizon's backtest missed, each with its value."""
    missed = []
    for key in ("ratio_p90", "ratio_p99"):
        if row[key] > TARGETS["ratio_mean"]:
            missed.append(f"{key.replace('_', ' ')} {row[key]:.2f} > {TARGETS['ratio_mean']}")
    if row["worst_ratio"] > TARGETS["ratio_max"]:
        missed.append(f"worst ratio {row['worst_ratio']:.2f} > {TARGETS['ratio_max']}")
    for key in ("below_p90", "below_p99"):
        if row[key] > TARGETS[key]:
            missed.append(f"{key.replace('_', ' ')} {row[key]:.3f} > {TARGETS[key]}")
    for key in ("coverage_p90", "coverage_p99"):
        if row[key] < TARGETS[key]:
            missed.append(f"{key.replace('_', ' ')} {row[key]:.3f} < {TARGETS[key]}")
    if row["rmse_above_persistence"]:
        missed.append(
            "median RMSE above persistence on " + ", ".join(row["rmse_above_persistence"])
        )
    return missed


def _fresh_model():
    from predictor.models import build

    return build(MODEL_NAME)


def _write_report(
    out: Path,
    figures: dict[str, object],
    pictures: dict[str, Path],
) -> Path:
    scaling = figures["scaling"]  # type: ignore[index]
    rows = scaling["rows"]
    summary = figures["forecast_summary"]
    prices = ", ".join(
        f"{p} ${v:,.2f}"
        for p, v in figures["prices_per_node_hour"].items()  # type: ignore[union-attr]
    )
    lines = [
        "# gpuscale demo report",
        "",
        headline(figures),
        "",
        f"A synthetic GPU cluster (seed {figures['seed']}, {figures['days']:g} days, pools "
        f"{', '.join(figures['pools'])}; list prices per node-hour {prices}) ran "
        f"{figures['jobs']:,} jobs over the {figures['days']:g} days. The first half trains "
        f"the forecaster; the scaling rows below score the "
        f"{figures['scored_days']:g} days from {figures['scored_from'][:10]}, "
        f"{figures['scored_jobs']:,} of those jobs. Nodes take 10 minutes to boot.",
        "",
        "## 1. Cost against waiting",
        "",
        "Each point is one replay of the same job stream, placed by the same engine. "
        "GPU-hours are the GPUs of the nodes paid for, times hours; GPU-minutes waited sum, "
        "over jobs, their GPUs times the minutes they waited for capacity. "
        "Reactive is Kubernetes Cluster Autoscaler's behaviour (a node is asked for once a "
        "job waits). Reactive + k spare nodes per pool is what teams run instead of a "
        "forecast (overprovisioning placeholder pods or a CapacityBuffer). The per-pool "
        "tuned spares are what a careful team would pick: each pool's spare count chosen "
        "on the week before the scored window, at a range of prices of waiting. Predictive "
        "sizes each pool's spare on the node requests it saw, scaled by their forecast "
        "rate an hour ahead; its knob `job_wait_share` is the share of the requested GPUs' "
        "boot time they may wait (lower: more spare, less waiting).",
        "",
        f"![cost against waiting]({pictures['frontier'].name})",
        "",
        "| scaler | GPU-hours | cost ($) | GPU-minutes waited | mean wait (min) "
        "| p95 wait (min) | jobs that waited |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {_label(row)} | {row['gpu_hours']:,.0f} | {row['cost']:,.0f} "
            f"| {row['gpu_minutes_waited']:,.0f} | {row['wait_mean_min']:.2f} "
            f"| {row['wait_p95_min']:.1f} | {row['share_waiting']:.1%} |"
        )
    t = figures["against_tuned"]  # type: ignore[index]
    single = (
        f"The cheapest single tuned setting that waits no more than the default is "
        f"{t['cheapest_no_more_wait']} ({t['cheapest_gpu_hours']:,.0f} GPU-hours: predictive "
        f"pays {_pct_more(-t['gpu_hours_saving'])})."
        if t["cheapest_no_more_wait"] is not None
        else "No tuned setting waits as little as the default."
    )
    beaten = (
        " Tuned settings that beat the default on both GPU-hours and waiting: "
        + ", ".join(t["dominated_by"])
        + "."
        if t["dominated_by"]
        else " No tuned setting beats the default on both GPU-hours and waiting."
    )
    reactive, predictive = scaling["reactive"], scaling["predictive"]
    lines += [
        "",
        single
        + beaten
        + f" Against reactive the default pays {_pct_more(figures['gpu_hours_extra'])} "
        f"GPU-hours and its jobs wait {_wait_change(predictive, reactive)}; its p95 wait for "
        f"capacity is {predictive['wait_p95_min']:.1f} minutes against "
        f"{reactive['wait_p95_min']:.1f}.",
        "",
        "## 2. Forecasting demand",
        "",
        f"The default forecaster was trained on the {figures['stored_points']:,} demand "
        f"points stored (10-minute steps, GPUs per pool) and registered as "
        f"`{figures['model']}`; below is its backtest on the last quarter of the history "
        "against the naive baseline (the last value plus the typical change). The aims: "
        f"pinball-loss ratio at most {TARGETS['ratio_mean']} at p90 and p99 (below 1 is "
        f"better than the baseline), no series above {TARGETS['ratio_max']}, coverage (the "
        "share of steps whose demand stayed at or under the quantile) of at least "
        f"{TARGETS['coverage_p90']} at p90 and {TARGETS['coverage_p99']} at p99, and a "
        "median no worse than persistence.",
        "",
        "| horizon | pinball ratio p90 | pinball ratio p99 | coverage p90 | coverage p99 "
        "| aims met |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary:  # type: ignore[union-attr]
        lines.append(
            f"| {row['horizon_min']} min | {row['ratio_p90']:.2f} | {row['ratio_p99']:.2f} "
            f"| {row['coverage_p90']:.3f} | {row['coverage_p99']:.3f} "
            f"| {'yes' if row['met'] else 'no'} |"
        )
    missed = [(r["horizon_min"], _missed(r)) for r in summary]  # type: ignore[union-attr]
    if figures["forecast_met"]:
        verdict = "The forecaster met its aims at every horizon shown."
    else:
        verdict = (
            "The forecaster did not meet its aims on this workload: "
            + "; ".join(f"at {h} min {', '.join(m)}" for h, m in missed if m)
            + ". The scaler does not depend on it: predictive sizes the spare on the node "
            "requests the jobs made, and the demand forecast only bounds it."
        )
    lines += [
        "",
        verdict,
        "",
        f"![forecast against actual, GPUs per pool]({pictures['forecast'].name})",
        "",
        "## 3. Nodes against demand",
        "",
        "Per pool, the nodes paid by reactive, the cheapest flat spare-node setting that waits "
        "no more than the default predictive run, and the default predictive run, against the "
        "GPUs demanded (in nodes' worth); below, the distribution of job waits (minutes).",
        "",
        f"![nodes against demand per pool]({pictures['scaling'].name})",
        "",
        "## What to try next",
        "",
        "- `gpuscale simulate --synthetic --frontier --out sim/`: the same comparison with"
        " the ablations that price each part of the planner.",
        f"- `gpuscale forecast --registry {out / 'models'} --state-dir {out / 'state'}"
        " --plot forecast.png`: the registered model on the stored history.",
        "- docs/benchmarks.md: the same questions on the public Philly, Helios and Alibaba traces.",
        "",
    ]
    markdown = "\n".join(lines)
    write_text(out / "report.md", markdown)
    write_text(out / "report.html", _as_html(markdown))
    write_text(out / "figures.json", json.dumps(figures, indent=2, default=str))
    return out / "report.md"


def _wait_change(ours: Mapping[str, float], theirs: Mapping[str, float]) -> str:
    """Our GPU-minutes waited against theirs."""
    if not theirs["gpu_minutes_waited"]:
        return f"{ours['gpu_minutes_waited']:,.0f} GPU-minutes (against none)"
    return (
        _pct_less(1 - ours["gpu_minutes_waited"] / theirs["gpu_minutes_waited"]) + " (GPU-minutes)"
    )


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
