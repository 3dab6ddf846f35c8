"""CLI commands for demand forecasting: `train`, `forecast` and `bench forecast`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from predictor.foundation.atomic_files import write_text
from scaler.cli.output import MODEL_KINDS, jsonable, output_file, table_console

TraceOption = Annotated[
    list[str] | None,
    typer.Option(
        "--trace", help="KIND:PATH with KIND philly, helios-vc or series; repeat for more files."
    ),
]
StateDirOption = Annotated[
    Path | None,
    typer.Option("--state-dir", help="Read history from this telemetry store instead."),
]
SplitOption = Annotated[
    str | None,
    typer.Option("--split", help="Test start YYYY-MM-DD[THH:MM] (default: per trace kind)."),
]
RegistryOption = Annotated[
    Path,
    typer.Option(
        "--registry",
        envvar="GPUSCALE_MODELS_DIR",
        help="Model registry directory (one folder per model name and version).",
    ),
]
BENCH_MODELS = ("gpuscale", "lightgbm", "empirical", "persistence", "seasonal-naive")
# A week of 10-minute steps: a trillion allocated its arrays first.
HORIZON_CAP = 1008


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's commands to the app and the bench group."""
    app.command("train")(train_command)
    app.command("forecast")(forecast_command)
    bench.command("forecast")(bench_forecast)


def train_command(
    traces: TraceOption = None,
    state_dir: StateDirOption = None,
    split: SplitOption = None,
    model: Annotated[
        str, typer.Option("--model", help=f"Model kind: {', '.join(MODEL_KINDS)}.")
    ] = "gpuscale",
    name: Annotated[
        str | None, typer.Option("--name", help="Registry name (default: the model kind).")
    ] = None,
    registry: RegistryOption = Path("models"),
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the stored version's metadata as JSON.")
    ] = False,
    dask_scheduler: Annotated[
        str | None,
        typer.Option(
            "--dask-scheduler",
            help="Fit on this Dask cluster (e.g. tcp://host:8786): one model per shard of"
            " series, the shards spread over its workers (needs dask.distributed).",
        ),
    ] = None,
    shards: Annotated[
        int, typer.Option("--shards", min=1, help="Shards of series with --dask-scheduler.")
    ] = 4,
) -> None:
    """Fit a forecasting model and store it as a new version in the registry.

    History comes from trace files (--trace, repeatable) or the telemetry store
    (--state-dir). The model is first fitted on each source's training window and
    backtested on its test window at 10, 30 and 180 minutes (the `forecast` benchmark;
    for the store, the last 25% of its history is the test window); it is then refitted on
    all the history and stored with its metadata: training window, series, features,
    quantiles, horizons, backtest scores and library versions. Nothing is written when
    any step fails. With --dask-scheduler every fit is spread over a Dask cluster, one
    model per shard of series.
    """
    from rich.console import Console
    from rich.progress import Progress

    from predictor.lifecycle.registry import ModelRegistry, check_name
    from predictor.lifecycle.training import load_sources, train_and_register
    from predictor.models import build

    target = check_name(name or model)
    build(model)  # an unknown model fails before any work (and before the progress bar)
    sources = load_sources(traces or [], state_dir, split)
    console = Console(stderr=True)
    # Off a terminal a transient bar draws nothing but a blank line before any error.
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(f"training {model}", total=None)
        record = train_and_register(
            ModelRegistry(registry),
            target,
            sources,
            model,
            on_step=lambda what: progress.update(task, description=f"{model}: {what}"),
            dask_scheduler=dask_scheduler,
            shards=shards,
        )
    if json_out:
        typer.echo(json.dumps(record.metadata, indent=2, default=str))
        return
    summary = record.metadata["backtest"]["summary"]
    console = table_console()
    console.print(f"stored {record.name} version {record.version} at {record.path}")
    for s in summary:
        console.print(
            f"  {s['horizon_min']:>4} min: pinball ratio p90 {s['ratio_p90']:.3f},"
            f" p99 {s['ratio_p99']:.3f}; coverage p90 {s['coverage_p90']:.3f},"
            f" p99 {s['coverage_p99']:.3f}; rmse / persistence {s['rmse_ratio']:.3f}"
        )


def forecast_command(
    model: Annotated[
        str, typer.Option("--model", help="Registry model NAME or NAME:VERSION (default latest).")
    ] = "gpuscale",
    traces: TraceOption = None,
    state_dir: StateDirOption = None,
    registry: RegistryOption = Path("models"),
    horizons: Annotated[
        list[int] | None,
        typer.Option(
            "--horizon",
            help="Steps (10 min) ahead, at most those the model was trained for; repeat"
            " (default 1, 3, 18).",
        ),
    ] = None,
    extend_horizon: Annotated[
        bool,
        typer.Option(
            "--extend-horizon",
            help=f"Allow horizons beyond the model's trained ones (up to {HORIZON_CAP}, a"
            " week), extrapolated from its longest, with a warning.",
        ),
    ] = False,
    quantiles: Annotated[
        list[float] | None,
        typer.Option("--quantile", help="Quantile levels; repeat (default 0.5, 0.9, 0.99)."),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the table as JSON.")] = False,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="PNG of recent forecasts against actual demand, with bands."),
    ] = None,
    plot_days: Annotated[
        float, typer.Option("--plot-days", min=0.1, help="Days of history the picture shows.")
    ] = 2.0,
) -> None:
    """Forecast demand quantiles from the end of the history with a registered model.

    Prints, for every series and horizon, the target time and the requested quantiles of
    demand, each made from the history up to its last step. A horizon beyond the longest
    the model was trained for is refused unless --extend-horizon asks for its
    extrapolation (then a warning says so). With --plot, also draws the
    last --plot-days of actual demand against the model's rolling forecasts at the first
    horizon (median and quantile bands), and the forecast beyond the last step.
    """
    import pandas as pd

    from predictor.foundation.errors import InputError
    from predictor.lifecycle.registry import ModelRegistry, parse_reference
    from predictor.lifecycle.training import load_sources, stepped_history
    from predictor.models.forecast import quantile_column, trained_horizon

    output_file(plot, "--plot")
    asked = sorted(set(horizons or [1, 3, 18]))
    levels = tuple(sorted(set(quantiles or [0.5, 0.9, 0.99])))
    if any(not 0.0 < q < 1.0 for q in levels):
        raise InputError(f"quantiles must lie strictly between 0 and 1, got {list(levels)}")
    name, version = parse_reference(model)
    forecaster, record = ModelRegistry(registry).load(name, version)
    label = f"{record.name} v{record.version}"
    steps, warning = forecast_steps(asked, trained_horizon(forecaster), extend_horizon, label)
    if warning is not None:
        typer.echo(f"warning: {warning}", err=True)
    history = stepped_history(load_sources(traces or [], state_dir))
    future = forecaster.forecast(history, steps, levels)
    rows = [
        {
            "series": r["unique_id"],
            "horizon": int(r["horizon"]),
            "ds": pd.Timestamp(r["ds"]).isoformat(),
            **{f"q{q:g}": float(r[quantile_column(q)]) for q in levels},
        }
        for _, r in future.frame.iterrows()
    ]
    if plot is not None:
        from predictor.evaluation.forecast_plot import plot_forecasts
        from predictor.models.forecast import DemandForecast

        with_median = tuple(sorted({0.5, *levels}))
        parts = []
        for _, one in history.groupby("unique_id", sort=True):  # each series' own last days
            start = one["ds"].max() - pd.Timedelta(days=plot_days)
            parts.append(forecaster.rolling(one, steps[0], start, with_median).frame)
        back = DemandForecast(pd.concat(parts, ignore_index=True), with_median)
        ahead = forecaster.forecast(history, steps, with_median)
        plot_forecasts(
            history, back, ahead, plot, title=f"{record.name} v{record.version}: demand forecast"
        )
    if json_out:
        document = {"model": record.name, "version": record.version, "forecasts": rows}
        typer.echo(json.dumps(document, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{record.name} v{record.version}: demand quantiles")
    for column in ("series", "horizon", "target time", *(f"p{q * 100:g}" for q in levels)):
        table.add_column(column, justify="left" if column in ("series", "target time") else "right")
    for r in rows:
        table.add_row(
            r["series"],
            f"{r['horizon'] * 10} min",
            r["ds"],
            *(f"{r[f'q{q:g}']:.2f}" for q in levels),
        )
    table_console().print(table)


def forecast_steps(
    asked: list[int], trained: int | None, extend: bool, label: str
) -> tuple[list[int], str | None]:
    """The horizons to forecast and the warning to print for them, or an InputError.

    Beyond the longest trained horizon a learned model extrapolates, which looks the same
    on the table as a forecast it was trained for: so that is refused unless `extend`,
    and said on stderr when it is asked for.
    """
    from predictor.foundation.errors import InputError

    stray = [h for h in asked if not 1 <= h <= HORIZON_CAP]
    if stray:
        raise InputError(
            f"--horizon must be 1 to {HORIZON_CAP} steps of 10 min (a week), got"
            f" {', '.join(map(str, stray))}"
        )
    beyond = [h for h in asked if trained is not None and h > trained]
    if not beyond:
        return asked, None
    listed = ", ".join(map(str, beyond))
    said = f"{label} was trained for horizons up to {trained} steps, not {listed}"
    if not extend:
        raise InputError(f"{said} (--extend-horizon extrapolates them, with a warning)")
    return asked, f"{said}: extrapolated from {trained} steps (--extend-horizon)"


def bench_forecast(
    traces: Annotated[
        list[str],
        typer.Option(
            "--trace",
            help="KIND:PATH with KIND philly, helios-vc or series; repeat for more files.",
        ),
    ],
    split: SplitOption = None,
    models: Annotated[
        list[str] | None,
        typer.Option(
            "--models",
            help=f"Models side by side; repeat (default: {', '.join(BENCH_MODELS)}).",
        ),
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write {suite, rows, summary} here.")
    ] = None,
) -> None:
    """Backtest forecasting models on demand traces (BENCHMARKS.md `forecast`).

    Every series is resampled to 10-minute steps (maximum of the minutes in a step). For
    each test step t and horizon h of 10, 30 and 180 minutes, every model forecasts y[t]
    from data up to t-h only; models are fitted on the training window (traces that share
    a test window share one global model). Rows give the RMSE of the median against
    persistence, the pinball loss at p90 and p99 against the baseline quantile (last value
    plus the training quantile of h-step changes) and the coverage of p90 and p99, for our
    model (`gpuscale`) and the baselines side by side; then, per horizon, our means over
    series against the targets.
    """
    from rich.console import Console
    from rich.progress import Progress

    from predictor.data.loaders import load_trace
    from predictor.evaluation.backtest import HORIZONS, backtest_group, group_by_window, summarize
    from predictor.models import build

    output_file(json_out, "--json")
    names = list(dict.fromkeys(models or BENCH_MODELS))
    for n in names:
        build(n)  # an unknown name fails before any trace is read
    loaded = [load_trace(spec, split=split) for spec in traces]
    groups = group_by_window(loaded)
    horizons = HORIZONS

    def make(n: str):
        # our model trains the horizons it is scored on (interpolation is for the others)
        trains = ("gpuscale", "lightgbm", "torch", "torch-conformal", "selected")
        return lambda: build(n, horizons=horizons) if n in trains else build(n)

    rows: list[dict[str, object]] = []
    console = Console(stderr=True)
    with Progress(console=console) as progress:
        task = progress.add_task("forecast bench", total=len(groups) * len(names) * len(horizons))
        for group in groups:
            rows += [
                r.to_dict()
                for r in backtest_group(
                    group,
                    {n: make(n) for n in names},
                    horizons=horizons,
                    on_step=lambda what: progress.advance(task),
                )
            ]
    summary = summarize(rows, "gpuscale")
    _print_rows(rows, summary)
    if json_out is not None:
        document = {"suite": "forecast", "rows": rows, "summary": summary}
        text = json.dumps(document, indent=2, default=jsonable)
        json_out.parent.mkdir(parents=True, exist_ok=True)
        write_text(json_out, text)


def _ratio(value: object, reference: object) -> str:
    value, reference = float(value), float(reference)  # type: ignore[arg-type]
    return f"{value / reference:.3f}" if reference > 0 else "n/a"


def _print_rows(rows: list[dict[str, object]], summary: list[dict[str, object]]) -> None:
    from rich.table import Table

    from predictor.evaluation.backtest import TARGETS

    table = Table(title="forecast: ratios to persistence (rmse) and to the baseline (pinball)")
    for column in (
        "series",
        "min",
        "model",
        "rmse/pers",
        "pb90/base",
        "pb99/base",
        "cov90",
        "cov99",
        "below90",
        "below99",
    ):
        table.add_column(column, justify="left" if column in ("series", "model") else "right")
    for r in rows:
        table.add_row(
            str(r["series"]),
            str(r["horizon_min"]),
            str(r["model"]),
            _ratio(r["rmse"], r["rmse_persistence"]),
            _ratio(r["pinball_p90"], r["pinball_p90_baseline"]),
            _ratio(r["pinball_p99"], r["pinball_p99_baseline"]),
            f"{r['coverage_p90']:.3f}",
            f"{r['coverage_p99']:.3f}",
            f"{r['below_p90']:.3f}",
            f"{r['below_p99']:.3f}",
        )
    console = table_console()
    console.print(table)
    if not summary:
        return
    means = Table(title="gpuscale per horizon, mean over series, against the targets")
    heads = ("min", "series", "ratio p90", "ratio p99", "worst", "cov p90", "below p90")
    heads += ("cov p99", "below p99")
    for column in (*heads, "rmse/persist", "met"):
        means.add_column(column, justify="right")
    for s in summary:
        means.add_row(
            str(s["horizon_min"]),
            str(s["series"]),
            f"{s['ratio_p90']:.3f}",
            f"{s['ratio_p99']:.3f}",
            f"{s['worst_ratio']:.3f}",
            f"{s['coverage_p90']:.3f}",
            f"{s['below_p90']:.3f}",
            f"{s['coverage_p99']:.3f}",
            f"{s['below_p99']:.3f}",
            f"{s['rmse_ratio']:.3f}",
            "yes" if s["met"] else "no",
        )
    console.print(means)
    console.print(
        f"targets: mean ratio <= {TARGETS['ratio_mean']} at p90 and p99, none above"
        f" {TARGETS['ratio_max']}; calibrated as integer demand allows (below <= level <="
        f" coverage): below p90 <= {TARGETS['below_p90']}, coverage p90 >="
        f" {TARGETS['coverage_p90']}, below p99 <= {TARGETS['below_p99']}, coverage p99 >="
        f" {TARGETS['coverage_p99']}; rmse never above persistence"
    )
