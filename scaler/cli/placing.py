"""CLI commands: placing (`gpuscale bench placement`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from predictor.foundation.atomic_files import write_file, write_text
from scaler.cli.output import output_file

if TYPE_CHECKING:
    from rich.progress import Progress
    from rich.table import Table

    from scaler.evaluation.placement_bench import ExperimentResult
    from scaler.evaluation.placement_bound import BoundResult

Anchors = dict[tuple[str, str], tuple[float, float]]

BENCH_POLICIES = ("random", "dotprod", "gpuclustering", "gpupacking", "bestfit", "fgd", "gpuscale")
ANCHORS = Path("shared/anchors/fgd_openb_allocation.csv")


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's commands to the app and the bench group."""

    @bench.command("placement")
    def placement(
        nodes: Annotated[
            Path, typer.Option("--nodes", help="Node list CSV (openb_node_list_gpu_node.csv).")
        ],
        pods: Annotated[
            list[Path],
            typer.Option(
                "--pods",
                help="Pod list CSV; repeat for several workloads. The workload is named "
                "after the file: openb_pod_list_default.csv -> default.",
            ),
        ],
        seeds: Annotated[
            str, typer.Option("--seeds", help="Seeds: a range 42-51, a list 42,45 or both.")
        ] = "42-51",
        policies: Annotated[
            str,
            typer.Option("--policies", help="Comma-separated policies (gpuscale is ours)."),
        ] = ",".join(BENCH_POLICIES),
        json_out: Annotated[
            Path | None, typer.Option("--json", help="Write {suite, rows} JSON here.")
        ] = None,
        plot: Annotated[
            Path | None,
            typer.Option("--plot", help="Write allocation curves (PNG): mean over seeds."),
        ] = None,
        workers: Annotated[
            int, typer.Option("--workers", min=1, help="Experiments run in parallel processes.")
        ] = 1,
        anchors: Annotated[
            Path | None,
            typer.Option(
                "--anchors",
                help="Published results CSV to print next to ours "
                "(default: ../shared/anchors/fgd_openb_allocation.csv when present).",
            ),
        ] = None,
        scale_to: Annotated[
            int | None,
            typer.Option(
                "--scale-to",
                min=1,
                help="Repeat the node list (names suffixed) up to this many nodes: the "
                "decision time at scale (10000: the 2 ms median target).",
            ),
        ] = None,
        bound: Annotated[
            bool,
            typer.Option(
                "--bound",
                help="Add the ceiling's rows (policy bound): the most GPU share any "
                "placement of each seed's arrived pods could allocate, and any policy "
                "that follows the protocol (protocol_at_*), from MIPs (HiGHS).",
            ),
        ] = False,
        bound_seconds: Annotated[
            float,
            typer.Option("--bound-seconds", min=1.0, help="Time limit of one bound solve."),
        ] = 60.0,
    ) -> None:
        """The FGD paper's workload-inflation experiment (BENCHMARKS.md, placement).

        For each pod list, policy and seed: the pods in a seeded random order, then
        seeded copies until 130% of the cluster's GPUs are requested; pods are placed
        one by one and never deleted. Reports the share of GPUs allocated when the
        arrived requests reach 100% and 130% of the cluster, the failed pods and the
        wall time of each experiment, next to the published numbers. With --bound,
        also the ceilings at 100% and 130%: offline (any placement of the arrived pods)
        and the protocol's (any policy that places each pod, in order, when it fits;
        four solves per workload and seed, each single threaded and limited to
        --bound-seconds; --workers run several at once), with the solver's proven gaps,
        and how much of the distance from published FGD to each ceiling gpuscale closes.
        Each experiment's median and p99 time of one placement decision (ms/dec in the
        table) is in its row; --scale-to measures it on a larger cluster made of the node
        list repeated.
        """
        from rich.console import Console
        from rich.progress import Progress

        from predictor.data.loaders import load_openb_nodes, load_openb_pods
        from scaler.evaluation.placement_bench import (
            check_nodes,
            load_anchors,
            run_matrix,
            scaled_nodes,
            workload_name,
        )
        from scaler.placement import POLICIES

        output_file(json_out, "--json")
        output_file(plot, "--plot")
        seed_list = parse_seeds(seeds)
        policy_list = [p.strip() for p in policies.split(",") if p.strip()]
        unknown = [p for p in policy_list if p not in POLICIES]
        if unknown or not policy_list:
            raise typer.BadParameter(
                f"unknown policy {unknown[0] if unknown else '(none)'}; "
                f"known: {', '.join(POLICIES)}",
                param_hint="--policies",
            )
        names = [workload_name(p) for p in pods]
        if len(set(names)) != len(names):
            raise typer.BadParameter("two pod lists have the same workload name", "--pods")
        node_table = load_openb_nodes(nodes)
        check_nodes(node_table, nodes)
        if scale_to is not None:
            node_table = scaled_nodes(node_table, scale_to)
        workloads = {name: load_openb_pods(path) for name, path in zip(names, pods, strict=True)}
        anchor_path = anchors or _default_anchors()
        published = load_anchors(anchor_path) if anchor_path else {}

        console = Console(width=max(120, shutil.get_terminal_size().columns))
        total = len(names) * len(policy_list) * len(seed_list)
        with Progress(console=console, transient=True) as progress:
            each = _progress_step(progress, "placement experiments", total)
            results = run_matrix(
                node_table, workloads, policy_list, seed_list, workers=workers, on_result=each
            )
            bounds = []
            if bound:
                from scaler.evaluation.placement_bound import run_bounds

                each = _progress_step(progress, "bound solves", len(names) * len(seed_list))
                bounds = run_bounds(
                    node_table, workloads, seed_list, bound_seconds, workers=workers, on_result=each
                )
        console.print(summary_table(results, published, bounds))
        for line in target_lines(results, published) + bound_lines(results, published, bounds):
            console.print(line)
        if json_out is not None:
            rows = [r.row() for r in results] + [b.row() for b in bounds]
            write_text(json_out, json.dumps({"suite": "placement", "rows": rows}, indent=1))
            console.print(f"wrote {len(rows)} rows to {json_out}")
        if plot is not None:
            plot_curves(results, plot)
            console.print(f"wrote allocation curves to {plot}")


def parse_seeds(text: str) -> list[int]:
    """'42-51' -> 42..51; '42,45' -> [42, 45]; ranges and lists combine."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
                if high < low:
                    raise ValueError(part)
                seeds.extend(range(low, high + 1))
            elif part:
                seeds.append(int(part))
    except ValueError:
        raise typer.BadParameter(f"not a seed list: {text!r}", param_hint="--seeds") from None
    if not seeds:
        raise typer.BadParameter("no seeds given", param_hint="--seeds")
    return list(dict.fromkeys(seeds))


def _progress_step(progress: Progress, label: str, total: int) -> Callable[[object], None]:
    """A new bar of `total` steps named `label`, and the callback that moves it one step
    (for a runner's `on_result`)."""
    task = progress.add_task(label, total=total)
    return lambda _result: progress.advance(task)


def _default_anchors() -> Path | None:
    for base in (Path.cwd().parent, Path(__file__).resolve().parents[3]):
        if (base / ANCHORS).is_file():
            return base / ANCHORS
    return None


def summary_table(
    results: list[ExperimentResult],
    published: Anchors,
    bounds: Sequence[BoundResult] = (),
) -> Table:
    """Mean over seeds per workload and policy, next to the published means; the ceiling
    (bound) rows after each workload's policies, their largest proven gap in `failed`'s
    place."""
    import numpy as np
    from rich.table import Table

    table = Table(title="Placement: GPU allocation (%) at 100% and 130% arrival")
    for column in ("workload", "policy", "seeds", "ours@100", "pub@100", "ours@130", "pub@130"):
        table.add_column(column, justify="left" if column in ("workload", "policy") else "right")
    for column in ("Δ130", "sd130", "failed", "s/exp", "ms/dec"):
        table.add_column(column, justify="right")
    ceilings = _grouped_bounds(bounds)
    for (workload, policy), group in _grouped(results).items():
        at100 = np.array([r.alloc_at_100 for r in group])
        at130 = np.array([r.alloc_at_130 for r in group])
        pub = published.get((workload, policy))
        table.add_row(
            workload,
            policy,
            str(len(group)),
            f"{at100.mean():.2f}",
            f"{pub[0]:.2f}" if pub else "-",
            f"{at130.mean():.2f}",
            f"{pub[1]:.2f}" if pub else "-",
            f"{at130.mean() - pub[1]:+.2f}" if pub else "-",
            f"{at130.std():.2f}",
            f"{np.mean([r.failed_pods for r in group]):.0f}",
            f"{np.median([r.seconds for r in group]):.2f}",
            f"{np.median([r.decision_ms_p50 for r in group]):.3f}",
        )
        last = [p for w, p in _grouped(results) if w == workload][-1]
        if policy == last and workload in ceilings:
            _bound_row(table, workload, ceilings.pop(workload), published)
    for workload, group in ceilings.items():
        _bound_row(table, workload, group, published)
    return table


def _bound_row(table: Table, workload: str, group: list[BoundResult], published: Anchors) -> None:
    """The offline ceiling's row and, where solved, the protocol's beneath it."""
    import numpy as np

    pub = published.get((workload, "fgd"))
    gap = max(b.gap for b in group)
    protocol_gap = max(
        (c.gap for b in group for c in (b.protocol_100, b.protocol_130) if c is not None),
        default=None,
    )
    rows = [("bound", [(b.alloc_at_100, b.alloc_at_130) for b in group], gap)]
    if protocol_gap is not None:
        rows.append(
            ("protocol", [(b.protocol_at_100, b.protocol_at_130) for b in group], protocol_gap)
        )
    for name, points, worst in rows:
        at100 = np.array([p[0] for p in points])
        at130 = np.array([p[1] for p in points])
        table.add_row(
            workload,
            name,
            str(len(group)),
            f"{np.nanmean(at100):.2f}" if not np.isnan(at100).all() else "-",
            "-",
            f"{at130.mean():.2f}",
            "-",
            f"{at130.mean() - pub[1]:+.2f}" if pub else "-",
            f"{at130.std():.2f}",
            f"gap {100 * worst:.3f}%",
            f"{np.median([b.seconds for b in group]):.2f}",
            "-",
        )


def bound_lines(
    results: list[ExperimentResult], published: Anchors, bounds: Sequence[BoundResult]
) -> list[str]:
    """How much of the distance from FGD (published, and ours) to each ceiling gpuscale
    closes, per arrival point: mean over workloads of (gpuscale - FGD) / (ceiling - FGD)."""
    import numpy as np

    if not bounds:
        return []
    groups = _grouped(results)
    ceilings = _grouped_bounds(bounds)
    with_protocol = all(b.protocol_130 is not None for b in bounds)
    lines = []
    for name in ("offline", "protocol") if with_protocol else ("offline",):
        for point, index in (("100%", 0), ("130%", 1)):
            for source in ("published", "ours"):
                shares = []
                for workload, group in ceilings.items():
                    values = [_ceiling_at(b, name)[index] for b in group]
                    ceiling = np.nanmean(values)
                    mine = groups.get((workload, "gpuscale"))
                    if source == "published":
                        fgd = published.get((workload, "fgd"), (np.nan, np.nan))[index]
                    else:
                        ours = groups.get((workload, "fgd"))
                        at = [(r.alloc_at_100, r.alloc_at_130)[index] for r in ours] if ours else []
                        fgd = np.mean(at) if at else np.nan
                    if mine and np.isfinite(fgd) and np.isfinite(ceiling) and ceiling > fgd:
                        at = [(r.alloc_at_100, r.alloc_at_130)[index] for r in mine]
                        shares.append((np.mean(at) - fgd) / (ceiling - fgd))
                if shares:
                    target = "; target >= 50%" if (source, point) == ("published", "130%") else ""
                    lines.append(
                        f"gpuscale closes {100 * np.mean(shares):.1f}% of the distance from "
                        f"{source} FGD to the {name} ceiling at {point} (mean over "
                        f"{len(shares)} workloads{target})"
                    )
    gap = max(b.gap for b in bounds)
    lines.append(f"bound: largest proven gap {100 * gap:.3f}% of the bound")
    if with_protocol:
        solves = [c for b in bounds for c in (b.protocol_100, b.protocol_130) if c is not None]
        forced = np.mean([c.forced_pods / c.pods for c in solves])
        lines.append(
            f"protocol: largest proven gap {100 * max(c.gap for c in solves):.3f}% of the "
            f"bound; {100 * forced:.1f}% of the arrived pods forced on average"
        )
    return lines


def _ceiling_at(bound: BoundResult, name: str) -> tuple[float, float]:
    if name == "protocol":
        return bound.protocol_at_100, bound.protocol_at_130
    return bound.alloc_at_100, bound.alloc_at_130


def _grouped_bounds(bounds: Sequence[BoundResult]) -> dict[str, list[BoundResult]]:
    groups: dict[str, list[BoundResult]] = {}
    for b in bounds:
        groups.setdefault(b.workload, []).append(b)
    return groups


def target_lines(results: list[ExperimentResult], published: Anchors) -> list[str]:
    """The BENCHMARKS.md targets, checked against the published numbers."""
    import numpy as np

    lines = []
    groups = _grouped(results)
    for policy in ("bestfit", "fgd"):
        gaps = [
            max(
                abs(np.mean([r.alloc_at_100 for r in g]) - published[(w, p)][0]),
                abs(np.mean([r.alloc_at_130 for r in g]) - published[(w, p)][1]),
            )
            for (w, p), g in groups.items()
            if p == policy and (w, p) in published
        ]
        if gaps:
            lines.append(
                f"{policy}: largest gap to published over {len(gaps)} workloads "
                f"{max(gaps):.2f} points (target <= 1.0)"
            )
    gains = {
        w: np.mean([r.alloc_at_130 for r in g]) - published[(w, "fgd")][1]
        for (w, p), g in groups.items()
        if p == "gpuscale" and (w, "fgd") in published
    }
    if gains:
        worst = min(gains, key=gains.__getitem__)
        lines.append(
            f"gpuscale vs published FGD at 130%: mean {np.mean(list(gains.values())):+.2f} "
            f"points (target >= +1.0), worst {worst} {gains[worst]:+.2f} (target >= +0.3)"
        )
    seconds = [r.seconds for r in results]
    lines.append(f"median seconds per experiment: {np.median(seconds):.2f} (target <= 10)")
    for size in sorted({r.nodes for r in results}):
        at = [r for r in results if r.nodes == size]
        lines.append(
            f"one placement decision on {size} nodes: median "
            f"{np.median([r.decision_ms_p50 for r in at]):.3f} ms over the experiments' medians, "
            f"p99 {np.median([r.decision_ms_p99 for r in at]):.3f} ms"
            + (" (target <= 2 ms median at 10,000 nodes)" if size >= 10_000 else "")
        )
    return lines


def plot_curves(results: list[ExperimentResult], path: Path) -> None:
    """One panel per workload: allocated vs arrived share, mean over seeds per policy."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = _grouped(results)
    workloads = list(dict.fromkeys(w for w, _ in groups))
    cols = min(3, len(workloads))
    rows = math.ceil(len(workloads) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    x = np.arange(len(results[0].curve))
    for ax, workload in zip(axes.flat, workloads, strict=False):
        for (w, policy), group in groups.items():
            if w == workload:
                curve = np.nanmean([r.curve for r in group], axis=0)
                ax.plot(x, curve, label=policy, lw=2.2 if policy == "gpuscale" else 1.2)
        ax.plot(x, np.minimum(x, 100), color="grey", ls=":", lw=1)
        ax.set(title=workload, xlabel="arrived GPU share (%)", ylabel="allocated (%)")
        ax.set_xlim(60, x[-1])
        ax.set_ylim(60, 100)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(workloads) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    try:
        write_file(path, lambda temp: fig.savefig(temp, dpi=110, format="png"))
    finally:
        plt.close(fig)


def _grouped(results: list[ExperimentResult]) -> dict[tuple[str, str], list[ExperimentResult]]:
    groups: dict[tuple[str, str], list[ExperimentResult]] = {}
    for r in results:
        groups.setdefault((r.experiment.workload, r.experiment.policy), []).append(r)
    return groups
