"""CLI command: `gpuscale demo`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's commands to the app and the bench group."""
    app.command("demo")(demo)


def demo(
    out: Annotated[Path, typer.Option("--out", help="Folder for the report and its state.")] = Path(
        "reports/demo"
    ),
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic workload.")] = 7,
    days: Annotated[float, typer.Option("--days", min=8, help="Days of workload.")] = 28.0,
    knobs: Annotated[
        list[float] | None,
        typer.Option(
            "--knob",
            min=0.001,
            max=1.0,
            help="Predictive points of the frontier picture (repeat): the job-level knob"
            " job_wait_share; the default, 0.1, always runs. Default 0.05 and 0.5.",
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Generate a synthetic GPU cluster, store its demand, train and register the default
    forecaster, replay its job stream under reactive scaling, 1-8 spare nodes per pool, the
    spares tuned per pool on the week before and predictive scaling at its knob settings,
    and write a report (report.md, report.html, frontier.png and more) into --out."""
    import json

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from scaler.cli.output import output_folder
    from scaler.evaluation.demo import DEMO_KNOBS, run_demo

    output_folder(out, "--out", ("report.md", "report.html", "figures.json"))
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True
    ) as progress:
        task = progress.add_task("starting", total=None)
        result = run_demo(
            out,
            seed=seed,
            days=days,
            knobs=tuple(knobs) if knobs else DEMO_KNOBS,
            on_step=lambda m: progress.update(task, description=m),
        )
    if json_out:
        typer.echo(json.dumps(result.figures, indent=2, default=str))
        return
    typer.echo(result.report.read_text(encoding="utf-8"))
    typer.echo(f"report: {result.report} (and {result.out / 'report.html'})")
