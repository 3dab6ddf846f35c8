"""CLI commands for data: `generate` (synthetic workload) and `store import | show`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from predictor.foundation.atomic_files import write_files
from scaler.cli.output import output_folder, table_console

GENERATED = ("demand.csv", "jobs.csv", "pools.yaml")  # what `generate` writes into --out
STATE_DIR_HELP = "State directory holding the telemetry store (created if missing)."


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's commands to the app and the bench group."""
    app.command("generate")(generate)
    store = typer.Typer(
        help="The embedded telemetry store: import traces, show what it holds.",
        no_args_is_help=True,
    )
    store.command("import")(store_import)
    store.command("show")(store_show)
    app.add_typer(store, name="store")


def generate(
    out: Annotated[Path, typer.Option("--out", help="Directory to write the files into.")],
    config: Annotated[
        Path | None,
        typer.Option("--config", help="Workload YAML (default: the shipped default)."),
    ] = None,
    seed: Annotated[
        int, typer.Option("--seed", min=0, help="Random seed; same seed, same data.")
    ] = 0,
    days: Annotated[
        float | None, typer.Option("--days", help="Days of history (default: the config's).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Generate a synthetic GPU cluster workload: node pools, jobs and per-pool demand.

    Writes `jobs.csv` (one row per job), `demand.csv` (GPUs demanded per pool and minute,
    `series_id,timestamp,value`, readable as `--trace series:OUT/demand.csv`) and
    `pools.yaml` (the node pools, in the format the scaler reads). Each file is replaced
    atomically, so a reader never sees a half-written one.
    """
    import yaml

    from scaler.evaluation.synthetic import checked_days, load_config, pools_document
    from scaler.evaluation.synthetic import generate as generate_workload

    if days is not None:
        checked_days(days, "--days")
    output_folder(out, "--out", GENERATED)
    workload = generate_workload(load_config(config), seed=seed, days=days)
    demand = workload.demand.rename(
        columns={"unique_id": "series_id", "ds": "timestamp", "y": "value"}
    )
    jobs = workload.jobs
    writers: dict[str, Callable[[Path], None]] = {
        "jobs.csv": lambda p: jobs.to_csv(p, index=False, date_format="%Y-%m-%dT%H:%M:%S.%f"),
        "demand.csv": lambda p: demand.to_csv(p, index=False, date_format="%Y-%m-%dT%H:%M:%S"),
        "pools.yaml": lambda p: p.write_text(
            yaml.safe_dump(pools_document(workload.pools), sort_keys=False), encoding="utf-8"
        ),
    }
    write_files(out, writers)
    by_pool = workload.demand.groupby("unique_id")["y"]
    summary = {
        "out": str(out),
        "seed": seed,
        "start": workload.start.isoformat(),
        "end": workload.end.isoformat(),
        "jobs": len(jobs),
        "files": sorted(writers),
        "pools": {
            pool.name: {
                "gpu_model": pool.gpu_model,
                "jobs": int((jobs["pool"] == pool.name).sum()),
                "mean_gpus": round(float(by_pool.mean()[pool.name]), 2),
                "max_gpus": round(float(by_pool.max()[pool.name]), 2),
            }
            for pool in workload.pools
        },
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{len(jobs)} jobs from {workload.start:%Y-%m-%d}, seed {seed}")
    for column in ("pool", "GPU", "jobs", "mean GPUs", "max GPUs"):
        table.add_column(column, justify="left" if column in ("pool", "GPU") else "right")
    for name, row in summary["pools"].items():
        table.add_row(
            name,
            row["gpu_model"],
            str(row["jobs"]),
            f"{row['mean_gpus']:.1f}",
            f"{row['max_gpus']:.1f}",
        )
    table_console().print(table)
    typer.echo(f"wrote {', '.join(summary['files'])} to {out} ({workload.start} to {workload.end})")


def store_import(
    state_dir: Annotated[
        Path, typer.Option("--state-dir", envvar="GPUSCALE_STATE_DIR", help=STATE_DIR_HELP)
    ],
    traces: Annotated[
        list[str],
        typer.Option(
            "--trace",
            help="KIND:PATH with KIND philly, helios-vc or series; repeat for more files.",
        ),
    ],
    step: Annotated[
        str,
        typer.Option(
            "--step",
            help="Resample to this step (max per step), e.g. 10min, 1h; 'native' keeps the"
            " file's own resolution.",
        ),
    ] = "10min",
    unit: Annotated[
        str,
        typer.Option("--unit", help="What `series` traces count: nodes or gpus."),
    ] = "nodes",
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Import demand traces into the telemetry store.

    Every file is read and validated before anything is written; then all of them go in
    as one transaction. Demand becomes the metric `gpu_demand`; capacity and the Helios
    running and pending GPUs become `capacity`, `running` and `pending`. Importing the same
    data twice changes nothing.
    """
    import pandas as pd
    from rich.progress import track

    from predictor.data.loaders import load_trace
    from predictor.telemetry.store import TelemetryStore

    resolution = None
    if step != "native":
        try:
            resolution = pd.Timedelta(step)
        except ValueError:
            raise typer.BadParameter(f"not a duration: {step!r}", param_hint="--step") from None
        if resolution <= pd.Timedelta(0):
            raise typer.BadParameter("must be positive", param_hint="--step")
    loaded = []
    for spec in track(traces, description="reading traces", transient=True, disable=as_json):
        trace = load_trace(spec, unit=unit if spec.startswith("series:") else None)
        loaded.append(trace if resolution is None else trace.resampled(resolution))
    store = TelemetryStore(state_dir)
    written = store.import_traces(loaded)
    summary = {
        "state_dir": str(state_dir),
        "points": written,
        "series": [
            {"trace": t.label, "series": uid, "unit": t.unit, "steps": int(n)}
            for t in loaded
            for uid, n in t.frame.groupby("unique_id").size().items()
        ],
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        # an import upserts: the same series, metric and time again replaces, never doubles
        typer.echo(
            f"wrote {written} points (all metrics) of {len(summary['series'])} series into"
            f" {store.path}; points already there for the same times were replaced"
        )


def store_show(
    state_dir: Annotated[
        Path, typer.Option("--state-dir", envvar="GPUSCALE_STATE_DIR", help=STATE_DIR_HELP)
    ],
    metric: Annotated[
        str | None, typer.Option("--metric", help="Only this metric (default: all).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Show the series in the telemetry store (span and points) and the recorded gaps."""
    from predictor.telemetry.store import TelemetryStore

    store = TelemetryStore.existing(state_dir)  # a wrong folder is named, not shown empty
    series, gaps = store.series(metric), store.gaps()
    if as_json:
        document = {
            "series": [
                {
                    "metric": row.metric,
                    "series": row.unique_id,
                    "source": row.source,
                    "labels": row.labels,
                    "first": row.first.isoformat(),
                    "last": row.last.isoformat(),
                    "points": int(row.count),
                }
                for row in series.itertuples()
            ],
            "gaps": [
                {
                    "source": row.source,
                    "start": row.start.isoformat(),
                    "end": row.end.isoformat(),
                    "reason": row.reason,
                }
                for row in gaps.itertuples()
            ],
        }
        typer.echo(json.dumps(document, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"telemetry store {store.path}")
    for column in ("metric", "series", "unit", "first", "last", "points"):
        table.add_column(column, justify="right" if column == "points" else "left")
    for row in series.itertuples():
        table.add_row(
            row.metric,
            row.unique_id,
            row.labels.get("unit", ""),
            f"{row.first:%Y-%m-%d %H:%M}",
            f"{row.last:%Y-%m-%d %H:%M}",
            str(row.count),
        )
    console = table_console()
    console.print(table)
    console.print(f"{len(gaps)} recorded gap(s)")
    for row in gaps.itertuples():
        console.print(f"  {row.source}: {row.start} to {row.end} ({row.reason})")
