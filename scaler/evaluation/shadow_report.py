"""The shadow report: over the passes `gpuscale scale --shadow` recorded, the GPU-hours and
the waiting of the fleet the cluster really had against gpuscale's plan replayed on the
same demand, per pool, with the frontier picture. The evidence before `--apply`.

Each pass stands for the time to the next one (the last for the median interval). Per pool:

- the actual fleet: its nodes (ready and booting) are paid, its ready nodes serve; the
  demand beyond their GPUs waits (GPU-hours short);
- gpuscale: the size it would have set at each pass, carried out under the cloud's rules
  (nodes asked for are ready a boot later, removals at once, booting nodes first), from the
  cluster's own fleet at the first pass; the same demand beyond its ready GPUs waits;
- the frontier: what teams run instead, Cluster Autoscaler with k spare nodes (k = 0..8,
  `ReactiveRule` on the demand plus k nodes, a node going once unneeded for 10 minutes),
  replayed the same way on the same demand, against which both points are drawn.

The waiting pods the cluster reported (where the loop sees them) are summed beside: how
many waited, for how long.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from predictor.foundation.atomic_files import write_file, write_text
from scaler.cluster.pools import whole_nodes_each
from scaler.controller.shadow import ShadowPass
from scaler.evaluation.replay import PlannedTargets, ReactiveRule, ReplayPolicy

SPARE_NODES = tuple(range(9))
# Cluster Autoscaler's scale-down-unneeded-time (its default, 10 minutes).
UNNEEDED_S = 600.0


@dataclass(frozen=True)
class FleetFigures:
    """A fleet over the window: GPU-hours paid, GPU-hours of demand it left waiting, the
    share of the window some demand waited, and its mean size in nodes."""

    gpu_hours: float
    short_gpu_hours: float
    short_share: float
    mean_nodes: float


@dataclass(frozen=True)
class FrontierPoint:
    spare_nodes: int
    figures: FleetFigures


@dataclass(frozen=True)
class PoolReport:
    pool: str
    gpus_per_node: int
    boot_seconds: float
    demand_gpu_hours: float
    actual: FleetFigures
    gpuscale: FleetFigures
    frontier: tuple[FrontierPoint, ...]
    # The cluster's waiting pods as the passes saw them (None: the loop did not see pods).
    pod_hours_waited: float | None
    longest_wait_s: float

    @property
    def saving(self) -> float:
        """gpuscale's GPU-hours below the actual fleet's, as a share of them."""
        a = self.actual.gpu_hours
        return 1 - self.gpuscale.gpu_hours / a if a else 0.0


@dataclass(frozen=True)
class ShadowReport:
    first: datetime
    last: datetime
    passes: int
    hours: float
    pools: tuple[PoolReport, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "first": self.first.isoformat(),
            "last": self.last.isoformat(),
            "passes": self.passes,
            "hours": self.hours,
            "pools": [asdict(p) | {"saving": p.saving} for p in self.pools],
        }


def intervals(at: Sequence[datetime]) -> np.ndarray:
    """Seconds each pass stands for: to the next pass, the last the median interval."""
    s = np.array([t.timestamp() for t in at], dtype=float)
    gaps = np.diff(s)
    last = float(np.median(gaps)) if gaps.size else 0.0
    return np.append(gaps, last)


def carry_out(
    policy: ReplayPolicy,
    at: Sequence[datetime],
    boot_seconds: float,
    ready: int,
    booting: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Nodes paid and nodes ready at each pass when `policy` sets the size there (the pass
    at i is its step i + 1: it has seen the demand up to that pass's): a node
    asked for at a pass is ready from the first pass a boot later; a removal takes booting
    nodes first (newest first), then ready ones. Starts from `ready` nodes ready and
    `booting` nodes launched at the first pass."""
    t0 = at[0].timestamp()
    launches = [t0 + boot_seconds] * booting  # when each booting node is ready
    paid, served = np.zeros(len(at)), np.zeros(len(at))
    for i, moment in enumerate(at):
        now = moment.timestamp()
        came = [r for r in launches if r <= now + 1e-6]
        ready += len(came)
        launches = sorted(r for r in launches if r > now + 1e-6)
        wanted = max(int(policy.target(i + 1, ready, len(launches))), 0)
        total = ready + len(launches)
        if wanted > total:
            launches += [now + boot_seconds] * (wanted - total)
        elif wanted < total:
            cut = total - wanted
            keep = max(len(launches) - cut, 0)
            cut -= len(launches) - keep
            launches = launches[:keep]  # sorted: the newest launches go first
            ready -= cut
        paid[i], served[i] = wanted, ready
    return paid, served


def figures(
    paid: np.ndarray, ready: np.ndarray, demand: np.ndarray, seconds: np.ndarray, gpus: int
) -> FleetFigures:
    short = np.maximum(demand - ready * gpus, 0.0)
    window = float(seconds.sum())
    return FleetFigures(
        gpu_hours=float((paid * gpus * seconds).sum() / 3600),
        short_gpu_hours=float((short * seconds).sum() / 3600),
        short_share=float(seconds[short > 1e-9].sum() / window) if window else 0.0,
        mean_nodes=float((paid * seconds).sum() / window) if window else 0.0,
    )


def shadow_report(passes: Sequence[ShadowPass]) -> ShadowReport:
    """The report over `passes` (in the order recorded)."""
    if not passes:
        raise ValueError("no shadow passes recorded")
    at = [p.at for p in passes]
    seconds = intervals(at)
    names = [p.pool for p in passes[0].pools]
    unneeded = max(round(UNNEEDED_S / float(np.median(seconds))), 1) if seconds.any() else 1
    pools = []
    for name in names:
        rows = [next(s for s in p.pools if s.pool == name) for p in passes]
        gpus, boot = rows[0].gpus_per_node, rows[0].boot_seconds
        demand = np.array([r.demand_gpus for r in rows])
        actual_paid = np.array([r.nodes for r in rows], dtype=float)
        actual_ready = np.array([r.ready for r in rows], dtype=float)
        would = PlannedTargets("gpuscale", np.array([0, *(r.would_set for r in rows)]))
        start = (rows[0].ready, rows[0].booting)
        paid, ready = carry_out(would, at, boot, *start)
        frontier = []
        for k in SPARE_NODES:
            # The rule reads the demand before its step: step i + 1 sees wanted[i].
            wanted = np.append(whole_nodes_each(demand / gpus) + k, 0.0)
            rule = ReactiveRule(f"reactive+{k}", wanted, unneeded, warmup=1)
            k_paid, k_ready = carry_out(rule, at, boot, *start)
            frontier.append(FrontierPoint(k, figures(k_paid, k_ready, demand, seconds, gpus)))
        waited = [w for r in rows for w in r.waited_s]
        pods = [r.pending_pods for r in rows]
        pools.append(
            PoolReport(
                pool=name,
                gpus_per_node=gpus,
                boot_seconds=boot,
                demand_gpu_hours=float((demand * seconds).sum() / 3600),
                actual=figures(actual_paid, actual_ready, demand, seconds, gpus),
                gpuscale=figures(paid, ready, demand, seconds, gpus),
                frontier=tuple(frontier),
                pod_hours_waited=None
                if any(c is None for c in pods)
                else float((np.array(pods, dtype=float) * seconds).sum() / 3600),
                longest_wait_s=max(waited, default=0.0),
            )
        )
    return ShadowReport(
        first=at[0],
        last=at[-1],
        passes=len(passes),
        hours=float(seconds.sum() / 3600),
        pools=tuple(pools),
    )


# --------------------------------------------------------------------------- output


def markdown(report: ShadowReport, picture: str | None = "shadow-frontier.png") -> str:
    lines = [
        "# Shadow report: the cluster's fleet against gpuscale's plan",
        "",
        f"{report.passes} passes from {report.first:%Y-%m-%d %H:%M} to"
        f" {report.last:%Y-%m-%d %H:%M} UTC ({report.hours:.1f} h). gpuscale's plan is the"
        " size it would have set at each pass, carried out under the cloud's boot times on"
        " the demand the cluster had; the GPU-hours waited are demand beyond the ready GPUs.",
        "",
        "| pool | fleet | GPU-hours | GPU-hours waited | time short | mean nodes |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for p in report.pools:
        for label, f in (("actual", p.actual), ("gpuscale", p.gpuscale)):
            lines.append(
                f"| {p.pool} | {label} | {f.gpu_hours:,.1f} | {f.short_gpu_hours:,.2f} |"
                f" {f.short_share:.1%} | {f.mean_nodes:.1f} |"
            )
    lines += ["", "| pool | demand GPU-hours | gpuscale saves | pods waited | longest wait |"]
    lines.append("|---|---:|---:|---:|---:|")
    for p in report.pools:
        pods = "not seen" if p.pod_hours_waited is None else f"{p.pod_hours_waited:,.2f} pod-h"
        lines.append(
            f"| {p.pool} | {p.demand_gpu_hours:,.1f} | {p.saving:.1%} GPU-hours | {pods} |"
            f" {p.longest_wait_s / 60:,.0f} min |"
        )
    lines += [
        "",
        "The frontier: Cluster Autoscaler with 0-8 spare nodes replayed on the same demand"
        " (GPU-hours against GPU-hours waited), the actual fleet and gpuscale's plan.",
        "",
        "| pool | spare nodes | GPU-hours | GPU-hours waited |",
        "|---|---:|---:|---:|",
    ]
    for p in report.pools:
        for point in p.frontier:
            f = point.figures
            lines.append(
                f"| {p.pool} | {point.spare_nodes} | {f.gpu_hours:,.1f} |"
                f" {f.short_gpu_hours:,.2f} |"
            )
    if picture is not None:
        lines += ["", f"![frontier]({picture})"]
    return "\n".join(lines) + "\n"


def html_page(report: ShadowReport, picture: str | None = "shadow-frontier.png") -> str:
    """The markdown's tables and picture as one HTML page (no Markdown dependency)."""
    body = []
    table: list[str] = []
    for line in markdown(report, picture).splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-:"):
                continue
            tag = "td" if table else "th"
            table.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells))
            continue
        if table:
            body.append("<table>" + "".join(table) + "</table>")
            table = []
        if line.startswith("!["):
            src = line[line.index("(") + 1 : -1]
            body.append(f'<p><img src="{html.escape(src)}" style="max-width:100%"></p>')
        elif line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    if table:
        body.append("<table>" + "".join(table) + "</table>")
    style = "body{font-family:sans-serif;max-width:60em}td,th{padding:2px 8px;text-align:right}"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>gpuscale shadow report"
        f"</title><style>{style}</style></head><body>{''.join(body)}</body></html>\n"
    )


def frontier_picture(report: ShadowReport, path: Path) -> Path:
    """Per pool: GPU-hours against GPU-hours waited for Cluster Autoscaler with 0-8 spare
    nodes (the line), the actual fleet and gpuscale's plan (the points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(report.pools)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.8), squeeze=False)
    for ax, p in zip(axes[0], report.pools, strict=True):
        xs = [f.figures.short_gpu_hours for f in p.frontier]
        ys = [f.figures.gpu_hours for f in p.frontier]
        ax.plot(xs, ys, "-o", color="#9467bd", ms=3, label="Cluster Autoscaler + k spare")
        for point, x, y in zip(p.frontier, xs, ys, strict=True):
            if point.spare_nodes in (0, 2, 4, 8):
                ax.annotate(f"+{point.spare_nodes}", (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")  # fmt: skip
        ax.plot(p.actual.short_gpu_hours, p.actual.gpu_hours, "s", color="#d62728",
                label="actual fleet")  # fmt: skip
        ax.plot(p.gpuscale.short_gpu_hours, p.gpuscale.gpu_hours, "*", ms=12,
                color="#1f77b4", label="gpuscale (replayed)")  # fmt: skip
        ax.set_title(f"{p.pool} ({p.gpus_per_node} GPUs/node)")
        ax.set_xlabel("GPU-hours waited")
        ax.set_ylabel("GPU-hours paid")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"shadow: {report.first:%Y-%m-%d %H:%M} to {report.last:%Y-%m-%d %H:%M}")
    fig.tight_layout()
    try:
        return write_file(path, lambda temp: fig.savefig(temp, dpi=110, format="png"))
    finally:
        plt.close(fig)


def write_report(report: ShadowReport, out: Path) -> list[Path]:
    """report.md, report.html and shadow-frontier.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    png = frontier_picture(report, out / "shadow-frontier.png")
    return [
        write_text(out / "report.md", markdown(report, png.name)),
        write_text(out / "report.html", html_page(report, png.name)),
        png,
    ]
