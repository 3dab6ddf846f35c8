"""Pictures of the scaler at work (PNG, matplotlib): fleet against demand with the shortage
under it, the service-level knob's cost/shortage points against the swept baselines' lower
envelope, and the job-level comparison. Each function writes one file and returns its path."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import pandas as pd

from predictor.foundation.atomic_files import write_file
from scaler.evaluation.job_frontier import WorkloadComparison
from scaler.evaluation.replay import ReplayOutcome
from scaler.evaluation.scaling_bench import NOT_BASELINES, lower_envelope

COLORS = {
    "demand": "#222222",
    "static": "#999999",
    "reactive": "#d62728",
    "ces": "#ff7f0e",
    "oracle": "#2ca02c",
    "predictive": "#1f77b4",
    "headroom": "#9467bd",
    "headroom-percent": "#8c564b",
    "rolling-max": "#e377c2",
}


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fleet_plot(outcomes: Sequence[ReplayOutcome], path: Path) -> Path:
    """Fleet of each policy against demand (top) and the shortage of each (bottom)."""
    plt = _pyplot()
    first = outcomes[0].series
    ds = pd.DatetimeIndex(first.ds[first.start : first.end])
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(12, 6), sharex=True, height_ratios=(3, 1), layout="constrained"
    )
    top.plot(
        ds, first.demand[first.start : first.end], color=COLORS["demand"], lw=1.2, label="demand"
    )
    for out in outcomes:
        if out.policy == "oracle":
            continue
        color = COLORS.get(out.policy)
        top.step(ds, out.paid, where="post", lw=0.9, color=color, label=f"{out.policy} fleet")
        if out.shortage.any():
            bottom.step(ds, out.shortage, where="post", lw=0.9, color=color, label=out.policy)
    top.set_ylabel("nodes")
    top.set_title(f"{first.trace} {first.series}: fleet against demand (L = {outcomes[0].lag})")
    top.legend(loc="upper left", ncol=3, fontsize=8)
    bottom.set_ylabel("nodes short")
    bottom.legend(loc="upper left", ncol=4, fontsize=8)
    return _save(plt, fig, path, 120)


def frontier_plot(
    knob: Mapping[float, ReplayOutcome], baselines: Sequence[ReplayOutcome], path: Path
) -> Path:
    """Provisioning ratio against shortage node-steps: every baseline row as a faint point
    by family, their lower envelope (the cheapest baseline with no more shortage, a step
    line), the oracle, and one point per setting of the service-level knob."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5), layout="constrained")
    rows = [o.row() for o in baselines]
    others = [r for r in rows if r["policy"] not in NOT_BASELINES]
    levels = sorted(knob)
    points = [knob[k].row() for k in levels]
    xs = [float(r["shortage_node_steps"]) for r in points]
    ys = [float(r["provisioning_ratio"]) for r in points]
    right = max([*xs, *(float(r["shortage_node_steps"]) for r in others), 1.0]) * 1.5
    for family in dict.fromkeys(r["policy"] for r in others):
        mine = [r for r in others if r["policy"] == family]
        ax.plot(
            [r["shortage_node_steps"] for r in mine],
            [r["provisioning_ratio"] for r in mine],
            "o" if len(mine) > 1 else "s",
            ms=4 if len(mine) > 1 else 6,
            alpha=0.45 if len(mine) > 1 else 0.9,
            color=COLORS.get(str(family)),
            label=str(family),
        )
    envelope = lower_envelope(others)
    if envelope:
        ax.step(
            [float(r["shortage_node_steps"]) for r in envelope] + [right],
            [float(r["provisioning_ratio"]) for r in envelope]
            + [float(envelope[-1]["provisioning_ratio"])],
            where="post",
            color="#222222",
            lw=1.2,
            label="cheapest baseline with no more shortage",
        )
    for r in rows:
        if r["policy"] == "oracle":
            ax.plot(r["shortage_node_steps"], r["provisioning_ratio"], "*", ms=11,
                    color=COLORS["oracle"], label="oracle")  # fmt: skip
    ax.plot(xs, ys, "D-", ms=6, color=COLORS["predictive"], label="predictive (target shortage)")
    for k, x, y in zip(levels, xs, ys, strict=True):
        ax.annotate(f"{k:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlim(left=0, right=right)
    # The widest settings (32 spare nodes on a small VC) would flatten what matters: show up
    # to the dearest point that is ours or on the envelope.
    top = max([*ys, *(float(r["provisioning_ratio"]) for r in envelope), 1.0])
    ax.set_ylim(bottom=min([*ys, 1.0]) - 0.02, top=1 + (top - 1) * 1.1 + 0.02)
    ax.set_xlabel("shortage (node-steps)")
    ax.set_ylabel("provisioning ratio (paid / demand)")
    first = baselines[0] if baselines else next(iter(knob.values()))
    ax.set_title(f"{first.series.series}: cost against shortage (L = {first.lag})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path, 120)


def jobs_plot(comparison: WorkloadComparison, path: Path) -> Path:
    """Per pool: nodes paid by reactive, the best headroom setting (if run) and the default
    predictive run against the GPUs demanded (running + waiting), and the distribution of
    job waits."""
    plt = _pyplot()
    shown = {"reactive": comparison.reactive}
    headroom = comparison.best_headroom()
    if headroom is not None:
        shown[f"headroom {headroom.knob:g}"] = headroom
    shown["predictive"] = comparison.predictive
    pools = sorted(comparison.reactive.fleet["pool"].unique())
    fig, axes = plt.subplots(
        len(pools) + 1, 1, figsize=(12, 3 * (len(pools) + 1)), layout="constrained"
    )
    start = comparison.start
    for ax, pool in zip(axes, pools, strict=False):
        for label, result in shown.items():
            frame = result.fleet
            mine = frame[(frame["pool"] == pool) & (frame["ds"] >= start)]
            ax.step(
                mine["ds"],
                mine["nodes"],
                where="post",
                lw=0.9,
                color=COLORS[result.mode],
                label=f"{label} nodes",
            )
        demand = comparison.reactive.fleet
        demand = demand[(demand["pool"] == pool) & (demand["ds"] >= start)]
        ax.plot(
            demand["ds"],
            demand["demand_gpus"] / _gpn(comparison, pool),
            color=COLORS["demand"],
            lw=0.7,
            alpha=0.7,
            label="demand (nodes' worth of GPUs, reactive run)",
        )
        ax.set_ylabel(f"{pool}: nodes")
        ax.legend(loc="upper left", fontsize=8, ncol=3)
    waits = axes[-1]
    for label, result in shown.items():
        values = np.sort(result.waits)
        if values.size:
            share = np.arange(1, values.size + 1) / values.size
            waits.step(values, share, where="post", color=COLORS[result.mode], label=label)
    waits.set_xscale("symlog", linthresh=1)
    waits.set_xlabel("wait for capacity (minutes)")
    waits.set_ylabel("share of jobs")
    waits.legend(fontsize=8)
    return _save(plt, fig, path, 110)


def job_frontier_plot(rows: Sequence[Mapping[str, object]], path: Path) -> Path:
    """GPU-hours paid against GPU-minutes waited, one point per run of a job-level
    comparison: reactive, reactive plus k spare nodes per pool (a line through k), the
    spares tuned per pool (a line through their settings) and predictive at each knob
    (a line, the default marked)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 6), layout="constrained")

    def line(mode: str, color: str, marker: str, label: str, tag: Callable[[Mapping], str]):
        mine = sorted(
            (r for r in rows if r["mode"] == mode),
            key=lambda r: (float(r["gpu_minutes_waited"]), float(r["gpu_hours"])),
        )
        if not mine:
            return
        xs = [float(r["gpu_minutes_waited"]) for r in mine]
        ys = [float(r["gpu_hours"]) for r in mine]
        ax.plot(xs, ys, marker=marker, ls="-", ms=6, lw=1.2, color=color, label=label)
        for r, x, y in zip(mine, xs, ys, strict=True):
            ax.annotate(tag(r), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7,
                        color=color)  # fmt: skip

    line("headroom", COLORS["headroom"], "o", "reactive + k spare nodes per pool (k)",
         lambda r: f"{int(r['knob'])}")  # fmt: skip
    tuned = [r for r in rows if r["mode"] == "headroom-tuned"]
    order = "/".join(sorted(tuned[0]["spares"])) if tuned else ""
    line("headroom-tuned", "#2ca02c", "s", f"spares tuned per pool on the week before ({order})",
         lambda r: "/".join(f"{k}" for _, k in sorted(r["spares"].items())))  # fmt: skip
    line("predictive", COLORS["predictive"], "D", "predictive (knob job_wait_share)",
         lambda r: f"{r['knob']:g}")  # fmt: skip
    for r in rows:
        if r["mode"] == "reactive":
            ax.plot(float(r["gpu_minutes_waited"]), float(r["gpu_hours"]), "X", ms=10,
                    color=COLORS["reactive"], label="reactive (Cluster Autoscaler)")  # fmt: skip
        if r["mode"] == "predictive" and r["default"]:
            ax.plot(float(r["gpu_minutes_waited"]), float(r["gpu_hours"]), "*", ms=18,
                    color=COLORS["predictive"], mec="black",
                    label="predictive, default")  # fmt: skip
    ax.set_xlim(left=0)
    ax.set_xlabel("GPU-minutes waited for capacity (GPUs x minutes)")
    ax.set_ylabel("GPU-hours paid (GPUs of the nodes paid x hours)")
    ax.set_title("Cost against waiting, one point per replay: lower left is better")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path, 120)


def _gpn(comparison: WorkloadComparison, pool: str) -> int:
    return comparison.gpus_per_node[pool]


def _save(plt: ModuleType, fig: object, path: Path, dpi: int) -> Path:
    try:
        return write_file(path, lambda temp: fig.savefig(temp, dpi=dpi, format="png"))
    finally:
        plt.close(fig)
