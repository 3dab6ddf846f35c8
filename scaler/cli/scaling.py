"""CLI commands for the elastic scaler: `bench scaling`, `plan` and `simulate`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from predictor.foundation.atomic_files import write_text
from scaler.cli.output import jsonable, output_file, output_folder, table_console

if TYPE_CHECKING:
    import pandas as pd
    from rich.console import Console

    from predictor.models.forecast import Forecaster
    from scaler.cluster.pools import NodePool
    from scaler.evaluation.walk_ceiling import WalkCeiling
    from scaler.planning.planner import DemandOutlook, PlannerPolicy

DEFAULT_MODEL = "gpuscale"
# What `simulate` may write into --out (a replay's pictures or the job-level one).
SIMULATE_FILES = ("summary.json", "fleet.png", "frontier.png", "jobs.png")


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's commands to the app and the bench group."""
    bench.command("scaling")(bench_scaling)
    app.command("plan")(plan_command)
    app.command("simulate")(simulate)


def bench_scaling(
    traces: Annotated[
        list[str],
        typer.Option(
            "--trace",
            help="KIND:PATH with KIND philly, helios-vc or series; repeat for more files.",
        ),
    ],
    lags: Annotated[
        list[int] | None,
        typer.Option(
            "--lag",
            help="Boot lag L in steps (0, 1, 2 and 3 in the protocol); repeat. Default: 0 and 1.",
        ),
    ] = None,
    split: Annotated[
        str | None,
        typer.Option("--split", help="Test start YYYY-MM-DD[THH:MM] (default: per trace kind)."),
    ] = None,
    gpus_per_node: Annotated[
        int | None,
        typer.Option("--gpus-per-node", min=1, help="`series` values are GPUs on N-GPU nodes."),
    ] = None,
    model: Annotated[
        str, typer.Option("--model", help="Forecasting model feeding `ces` and `predictive`.")
    ] = DEFAULT_MODEL,
    mode: Annotated[
        str, typer.Option("--mode", help="Planner mode of the `predictive` row.")
    ] = "predictive",
    target_shortage: Annotated[
        float | None,
        typer.Option(
            "--target-shortage",
            help="Service-level knob: share of steps allowed short (default: the planner's,"
            " 0.001); lower costs more and waits less.",
        ),
    ] = None,
    knobs: Annotated[
        list[float] | None,
        typer.Option(
            "--knob",
            help="One `predictive` row per target-shortage setting K (repeat); instead of"
            " the single row at --target-shortage.",
        ),
    ] = None,
    calibration_days: Annotated[
        float,
        typer.Option(
            "--calibration-days",
            min=0,
            help="Last days of training held out to warm the policies (the planner's margin).",
        ),
    ] = 7.0,
    step_minutes: Annotated[
        int,
        typer.Option(
            "--step-minutes",
            min=1,
            help="Replay step in minutes: 10 is the protocol's; a divisor of 10 (e.g. 1) replays"
            " the minutes themselves, the model still forecasting 10-minute steps (a decision"
            " uses the forecasts made at the start of its 10-minute step). Lags are in these"
            " steps.",
        ),
    ] = 10,
    walks: Annotated[
        int,
        typer.Option(
            "--walks",
            min=0,
            help="Also replay N memoryless random walks per series (changes drawn from its"
            " own before the test window) under the best causal policy for them, matched"
            " against the same buffers at lag 0: how much of the bar any forecast can reach.",
        ),
    ] = 0,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write {suite, rows, summary} here.")
    ] = None,
) -> None:
    """Replay demand traces through the scaling policies (BENCHMARKS.md `scaling`).

    Every series runs under `static`, `reactive` (Cluster Autoscaler), `ces` (the Helios
    rule on our median forecast), `oracle`, `predictive` (our planner, one row per --knob)
    and `predictive-no-forecast` (the same planner with no forecast-driven rule, at each
    --knob) at each lag, side by side, and under the baselines teams run instead, each swept
    over its setting (row field `knob`): `headroom` (reactive plus k spare nodes),
    `headroom-percent` (plus ceil(p x demand)), `rolling-max` (peak of the last W steps plus
    b) and `ces` at 0.5-4 times its buffer. A policy sees demand up to the previous step;
    nodes requested at step t serve from t+L and are paid from t. Rows give the
    provisioning ratio (paid node-steps over demand), shortage events and node-steps, scale
    actions per day and the replay time (model fitting and forecasting are timed apart, in
    `fit_seconds` and `forecast_seconds`). The summary sets each predictive point against
    its matched baseline, the cheapest baseline row with no more shortage node-steps
    (saving = 1 - ours / matched), with the realised share of short steps, and next to
    the no-forecast row at the same knob (`forecast_gain`: ours less its saving; the
    `by_lag_knob` list sums these per lag and knob over every series). With --walks,
    `walk_ceiling` gives the same match for the best causal policy on random walks drawn
    from each series' own changes (scaler/evaluation/walk_ceiling.py).
    """
    from rich.console import Console
    from rich.progress import track

    from predictor.data.loaders import load_trace
    from scaler.evaluation.scaling_bench import (
        BenchSettings,
        bench_trace,
        by_lag_and_knob,
        overview,
        summarize,
        unneeded_steps,
    )
    from scaler.evaluation.walk_ceiling import walk_ceiling
    from scaler.planning.planner import PlannerPolicy

    output_file(json_out, "--json")
    if mode not in ("predictive", "hybrid"):
        raise typer.BadParameter("must be predictive or hybrid", param_hint="--mode")
    if knobs and target_shortage is not None:
        raise typer.BadParameter("give --knob or --target-shortage, not both", param_hint="--knob")
    _shares(knobs, "--knob", "target_shortage")
    _shares([target_shortage], "--target-shortage", "target_shortage")
    lag_list = tuple(sorted(set(lags or [0, 1])))
    if any(lag < 0 for lag in lag_list):
        raise typer.BadParameter("lags are >= 0", param_hint="--lag")
    overrides: dict[str, object] = {"mode": mode}
    if target_shortage is not None:
        overrides["target_shortage"] = target_shortage
    settings = BenchSettings(
        lags=lag_list,
        gpus_per_node=gpus_per_node,
        calibration_days=calibration_days,
        policy=PlannerPolicy(**overrides),
        step_minutes=step_minutes,
        knobs=tuple(sorted(set(knobs or ()))),
    )
    make_forecaster = _model_factory(model)
    loaded = [
        load_trace(
            spec,
            split=split,
            unit="gpus" if gpus_per_node and spec.startswith("series:") else None,
        )
        for spec in traces
    ]
    rows: list[dict[str, object]] = []
    replayed = []
    console = Console(stderr=True)
    for trace in track(loaded, description="replaying traces", console=console):
        prepared, outcomes = bench_trace(trace, make_forecaster, settings)
        replayed += [(p.series, unneeded_steps(p.step)) for p in prepared.series]
        for outcome in outcomes:
            row = outcome.row()
            if row["policy"] in ("predictive", "predictive-no-forecast", "ces"):
                row["model"] = model
                row["forecast_seconds"] = round(prepared.forecast_seconds, 3)
                row["fit_seconds"] = round(prepared.fit_seconds, 3)
            rows.append(row)
    summary = summarize(rows)
    overall = overview(summary)
    per_lag_knob = by_lag_and_knob(summary)
    _print_rows(rows, summary, overall)
    _print_by_lag_and_knob(per_lag_knob)
    document = {
        "suite": "scaling",
        "rows": rows,
        "summary": summary,
        "overview": overall,
        "by_lag_knob": per_lag_knob,
    }
    if walks:
        knob_list = settings.knobs or (settings.policy.target_shortage,)
        ceiling = walk_ceiling(replayed, knob_list, walks)
        _print_walk_ceiling(ceiling)
        document["walk_ceiling"] = ceiling.document()
    if json_out is not None:
        text = json.dumps(document, indent=2, default=jsonable)
        json_out.parent.mkdir(parents=True, exist_ok=True)
        write_text(json_out, text)


def _model_factory(name: str) -> Callable[[], Forecaster]:
    from predictor.foundation.errors import InputError

    try:
        from predictor.models import build
    except ImportError:
        raise InputError(f"model {name!r}: no forecasting models are installed") from None

    def make() -> Forecaster:
        return build(name)

    make()  # fail fast on an unknown name, before any trace is replayed
    return make


def _print_rows(
    rows: list[dict[str, object]],
    summary: list[dict[str, object]],
    overall: list[dict[str, object]],
) -> None:
    from rich.table import Table

    # The swept baselines are many; they reach the screen through the matched table.
    ours = ("predictive", "predictive-no-forecast")
    shown = [r for r in rows if r["knob"] is None or r["policy"] in ours]
    table = Table(
        title=f"scaling: provisioning and shortage per policy ({len(rows) - len(shown)} swept"
        " baseline rows in --json)"
    )
    columns = ("trace", "series", "L", "policy", "knob", "ratio", "events", "short", "act/day")
    for column in (*columns, "s"):
        table.add_column(
            column,
            justify="left" if column in ("trace", "series", "policy") else "right",
            no_wrap=True,
        )
    for r in shown:
        table.add_row(
            str(r["trace"]),
            str(r["series"]),
            str(r["lag_steps"]),
            str(r["policy"]),
            "" if r["knob"] is None else f"{r['knob']:g}",
            f"{r['provisioning_ratio']:.4f}",
            str(r["shortage_events"]),
            f"{r['shortage_node_steps']:g}",
            f"{r['scale_actions_per_day']:.1f}",
            f"{r['replay_seconds']:.2f}",
        )
    console = table_console()
    console.print(table)
    if summary:
        matched = Table(title="cost at matched shortage: predictive against the cheapest baseline")
        columns = ("series", "L", "knob", "ratio", "events", "short", "short share")
        columns += ("matched", "m ratio", "m events", "m short", "saving")
        for column in columns:
            matched.add_column(
                column, justify="left" if column in ("series", "matched") else "right"
            )
        for s in summary:
            saving = s["saving"]
            matched.add_row(
                str(s["series"]),
                str(s["lag_steps"]),
                f"{s['knob']:g}",
                f"{s['predictive_ratio']:.4f}",
                str(s["predictive_events"]),
                f"{s['predictive_node_steps']:g}",
                f"{s['short_share']:.4f}",
                str(s["matched"] or "none"),
                "" if saving is None else f"{s['matched_ratio']:.4f}",
                "" if saving is None else str(s["matched_events"]),
                "" if saving is None else f"{s['matched_node_steps']:g}",
                "n/a" if saving is None else f"{saving:+.1%}",
            )
        console.print(matched)
    if overall:
        totals = Table(title="per trace, lag and knob, over its series")
        columns = ("trace", "L", "knob", "series", "matched", "mean saving", "worst")
        bands = ("short share in knob/2..2 knob", "if calibrated")
        tuned_columns = ("tuned the week before: saving", "in band")
        forecast_columns = ("no forecast: saving", "forecast adds", "differ")
        for column in (*columns, *bands, *tuned_columns, *forecast_columns):
            totals.add_column(column, justify="left" if column == "trace" else "right")
        for o in overall:
            mean, worst, tuned = o["mean_saving"], o["worst_saving"], o["tuned_mean_saving"]
            totals.add_row(
                str(o["trace"]),
                str(o["lag_steps"]),
                f"{o['knob']:g}",
                str(o["series"]),
                str(o["matched"]),
                "n/a" if mean is None else f"{mean:+.1%}",
                "n/a" if worst is None else f"{worst:+.1%}",
                f"{o['share_in_band']:.0%}",
                f"{o['calibrated_in_band']:.0%}",
                "n/a" if tuned is None else f"{tuned:+.1%}",
                f"{o['tuned_in_band']:.0%}",
                _percent(o["no_forecast_mean_saving"]),
                _percent(o["forecast_mean_gain"]),
                f"{o['forecast_points_differ']}/{o['series']}",
            )
        console.print(totals)
        console.print(_against_the_tuned_buffer(summary))


def _percent(value: object) -> str:
    return "n/a" if value is None else f"{float(value):+.1%}"  # type: ignore[arg-type]


def _print_by_lag_and_knob(per_lag_knob: Sequence[dict[str, object]]) -> None:
    """The figures the targets are read from, per lag and knob over every series: ours
    against the envelope, against the buffer tuned the week before, and what the forecast
    adds (ours against the same planner without it, at matched shortage)."""
    from rich.table import Table

    if not per_lag_knob:
        return
    table = Table(title="per lag and knob, over every series: what the forecast adds")
    columns = ("L", "knob", "points", "saving", "tuned: saving", "ours - tuned")
    columns += ("no forecast: saving", "forecast adds", "differ")
    for column in columns:
        table.add_column(column, justify="right")
    for o in per_lag_knob:
        table.add_row(
            str(o["lag_steps"]),
            f"{o['knob']:g}",
            str(o["points"]),
            _percent(o["mean_saving"]),
            _percent(o["tuned_mean_saving"]),
            _percent(o["mean_over_tuned"]),
            _percent(o["no_forecast_mean_saving"]),
            _percent(o["forecast_mean_gain"]),
            f"{o['forecast_points_differ']}/{o['points']}",
        )
    table_console().print(table)


def _print_walk_ceiling(ceiling: WalkCeiling) -> None:
    from rich.table import Table

    from scaler.evaluation.walk_ceiling import BAR_MEAN_SAVING

    table = Table(
        title=f"on memoryless demand ({ceiling.walks} random walks per series, L = 0): the best"
        " causal policy against the cheapest buffer short no more"
    )
    columns = ("knob", "points", "matched", "mean saving", "worst", "dearer", "in band")
    for column in columns:
        table.add_column(column, justify="right")
    for k in ceiling.by_knob:
        mean, worst, dearer = k["mean_saving"], k["worst_saving"], k["share_dearer"]
        table.add_row(
            f"{k['knob']:g}",
            str(k["points"]),
            str(k["matched"]),
            "n/a" if mean is None else f"{mean:+.1%}",
            "n/a" if worst is None else f"{worst:+.1%}",
            "n/a" if dearer is None else f"{dearer:.0%}",
            "n/a" if k["share_in_band"] is None else f"{k['share_in_band']:.0%}",
        )
    console = table_console()
    console.print(table)
    console.print(
        f"the bar (no point dearer, {BAR_MEAN_SAVING:.0%} less on average) held on "
        f"{ceiling.runs_meeting_bar} of {ceiling.walks} sets of walks (one walk of every"
        " series at every knob)"
    )


def _against_the_tuned_buffer(summary: Sequence[dict[str, object]]) -> str:
    """One line over every point: ours and the buffer tuned the week before, each against
    the test window's cheapest baseline with no more shortage, and how often each kept the
    knob's band."""
    from scaler.evaluation.scaling_bench import in_band, mean_of

    def side(saving: str, share: str) -> str:
        dearer = sum(float(s[saving]) < -1e-9 for s in summary if s.get(saving) is not None)
        kept = sum(in_band(float(s["knob"]), s.get(share)) for s in summary)
        mean = mean_of(summary, saving)
        text = "n/a" if mean is None else f"{mean:+.1%}"
        return f"{text} on average, dearer on {dearer}, in band on {kept}"

    return (
        f"over {len(summary)} points, against the cheapest baseline short no more: predictive "
        f"{side('saving', 'short_share')}; the buffer tuned the week before "
        f"{side('tuned_matched_saving', 'tuned_short_share')}"
    )


def plan_command(
    pools_file: Annotated[
        Path, typer.Option("--pools", help="Node pools YAML ({pools: [...]}, NodePool fields).")
    ],
    forecast_file: Annotated[
        Path | None,
        typer.Option(
            "--forecast",
            help="Forecast CSV: unique_id (demand group), horizon (1, 2, ...), q<level> columns.",
        ),
    ] = None,
    trace: Annotated[
        str | None,
        typer.Option("--trace", help="KIND:PATH history to forecast from instead (its last step)."),
    ] = None,
    model: Annotated[
        str, typer.Option("--model", help="Model that forecasts the --trace history.")
    ] = DEFAULT_MODEL,
    observed: Annotated[
        list[str] | None,
        typer.Option("--observed", help="GROUP=GPUS demand of the last step (repeat per group)."),
    ] = None,
    fleet_spec: Annotated[
        list[str] | None,
        typer.Option("--fleet", help="POOL=READY[+BOOTING] nodes now (repeat; default 0)."),
    ] = None,
    group_models: Annotated[
        list[str] | None,
        typer.Option(
            "--group-models",
            help="GROUP=MODEL[|MODEL...] GPU models a group may use (default: a group named"
            " like a pool uses that pool's model, any other group any pool).",
        ),
    ] = None,
    policy_file: Annotated[
        Path | None, typer.Option("--policy", help="Planner policy YAML (PlannerPolicy fields).")
    ] = None,
    mode: Annotated[
        str | None, typer.Option("--mode", help="static, reactive, predictive or hybrid.")
    ] = None,
    target_shortage: Annotated[
        float | None,
        typer.Option("--target-shortage", help="Share of steps allowed short (the service knob)."),
    ] = None,
    at: Annotated[
        str | None, typer.Option("--at", help="Decision time (default: now, UTC).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Make one planning decision and print it with the reason and inputs of each part.

    The demand outlook comes from a forecast file (quantiles per group and horizon, GPUs;
    give the last observed demand with --observed) or from a trace's history, forecast by
    --model from its last step. The fleet is given per pool. With no error history the
    safety margin is zero, so the bound is the forecast's own upper quantile.
    """
    from datetime import UTC, datetime

    from predictor.foundation.errors import InputError
    from scaler.cli import plan_inputs
    from scaler.cluster.pools import load_pools
    from scaler.planning.planner import FleetCapacity, plan

    if (forecast_file is None) == (trace is None):
        raise InputError("give exactly one of --forecast and --trace")
    _shares([target_shortage], "--target-shortage", "target_shortage")
    pools = load_pools(pools_file)
    policy = _load_policy(policy_file, mode, target_shortage)
    lead = max(p.boot_steps(policy.step_seconds) for p in pools)
    seen = plan_inputs.observed_gpus(observed or [])
    configured = plan_inputs.group_models(group_models or [], pools)
    fleet = plan_inputs.fleet(fleet_spec or [], pools, pools_file)
    when = datetime.now(UTC).replace(tzinfo=None) if at is None else plan_inputs.decision_time(at)
    # The modes that plan on a forecast read its median and its base quantile.
    reads_forecast = policy.mode in ("predictive", "hybrid")
    needed = (policy.median_quantile, policy.base_quantile) if reads_forecast else ()
    if forecast_file is not None:
        frame = plan_inputs.read_forecast(forecast_file, needed)
    else:
        from predictor.data.loaders import load_trace

        history = load_trace(trace).resampled().frame
        forecaster = _model_factory(model)().fit(history)
        quantiles = (policy.median_quantile, 0.9, policy.base_quantile)
        frame = forecaster.forecast(history, list(range(1, lead + 2)), sorted(set(quantiles))).frame
        last = history.sort_values("ds").groupby("unique_id")["y"].last()
        seen = {**{str(k): float(v) for k, v in last.items()}, **seen}
    outlooks = _outlooks(frame, seen, configured, pools, forecast_file)
    decided = plan(outlooks, FleetCapacity(at=when, pools=tuple(fleet)), pools, policy)
    if as_json:
        typer.echo(json.dumps(decided.to_dict(), indent=2))
        return
    from rich.table import Table

    table = Table(title=f"capacity plan ({decided.mode}) at {when:%Y-%m-%d %H:%M}")
    for column in ("pool", "now", "desired", "action", "reason"):
        table.add_column(column, justify="right" if column in ("now", "desired") else "left")
    for d in decided.decisions:
        table.add_row(d.pool, str(d.current), str(d.desired), d.action, d.reason)
    console = table_console()
    console.print(table)
    for need in decided.needs:
        console.print(
            f"[bold]{need.group}[/]: add up to {need.add_to:.1f} GPUs, keep {need.keep:.1f}: "
            f"{need.reason}"
        )


def _shares(values: Sequence[float | None] | None, option: str, field: str) -> None:
    """Knob values from the command line, each held to the bounds of the policy's `field`
    (`target_shortage`, `job_wait_share`): else an error naming the option, where the
    policy's own validation would name only its field."""
    from pydantic import ValidationError

    from scaler.planning.planner import PlannerPolicy

    for value in values or ():
        if value is None:
            continue
        try:
            PlannerPolicy.model_validate({field: value})
        except ValidationError as e:
            reason = e.errors()[0]["msg"].lower()
            raise typer.BadParameter(
                f"{value:g} is not a share: {reason}", param_hint=option
            ) from None


def _load_policy(
    path: Path | None,
    mode: str | None,
    target_shortage: float | None,
    wait_share: float | None = None,
) -> PlannerPolicy:
    from predictor.foundation.config_files import read_yaml, validated
    from predictor.foundation.errors import InputError
    from scaler.planning.planner import PlannerPolicy

    document = None if path is None else read_yaml(path)
    data = {} if document is None else document.data or {}
    if not isinstance(data, dict):
        raise InputError("a policy is a mapping of PlannerPolicy fields", path=path)
    if mode is not None:
        data["mode"] = mode
    if target_shortage is not None:
        data["target_shortage"] = target_shortage
    if wait_share is not None:
        data["job_wait_share"] = wait_share
    return validated(PlannerPolicy, data, path, None if document is None else document.text)


def _outlooks(
    frame: pd.DataFrame,
    seen: dict[str, object],
    configured: dict[str, list[str]],
    pools: tuple[NodePool, ...],
    source: Path | None,
) -> list[DemandOutlook]:
    import numpy as np

    from predictor.foundation.errors import InputError
    from predictor.models.forecast import quantile_column
    from scaler.cluster.pools import serving_models
    from scaler.planning.planner import DemandOutlook

    # The columns are `quantile_column`'s (plan_inputs.read_forecast's or the model's).
    levels = tuple(sorted(float(c[1:]) for c in frame.columns if c.startswith("q")))
    out = []
    for group, rows in frame.groupby("unique_id", sort=True):
        rows = rows.sort_values("horizon")
        horizons = rows["horizon"].astype(int).tolist()
        if horizons != list(range(1, len(horizons) + 1)):
            raise InputError(
                f"group {group}: horizons must run 1, 2, ... without gaps",
                path=source,
                column="horizon",
            )
        if str(group) not in seen:
            raise InputError(
                f"no observed demand for group {group!r}: give --observed {group}=GPUS"
            )
        values = np.column_stack([rows[quantile_column(q)].to_numpy(dtype=float) for q in levels])
        out.append(
            DemandOutlook(
                group=str(group),
                observed=float(seen[str(group)]),
                levels=levels,
                values=values,
                gpu_models=serving_models(str(group), configured, pools),
            )
        )
    return out


def simulate(
    out: Annotated[Path, typer.Option("--out", help="Directory for the pictures and summary.")],
    trace: Annotated[
        str | None,
        typer.Option("--trace", help="KIND:PATH to replay (its first series), or use --synthetic."),
    ] = None,
    synthetic: Annotated[
        bool,
        typer.Option("--synthetic", help="Job-level simulation on the synthetic workload instead."),
    ] = False,
    lag: Annotated[int, typer.Option("--lag", min=0, help="Boot lag in steps (replay).")] = 1,
    split: Annotated[str | None, typer.Option("--split", help="Test start (replay).")] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option("--gpus-per-node", min=1, help="`series` values are GPUs.")
    ] = None,
    knobs: Annotated[
        list[float] | None,
        typer.Option(
            "--knob",
            help="Knob settings for the frontier (repeat): a replay's --target-shortage"
            " (default 0.001, 0.003, 0.01, 0.03, 0.1), --synthetic's --wait-share (those and"
            " 0.2, 0.3).",
        ),
    ] = None,
    frontier: Annotated[
        bool,
        typer.Option(
            "--frontier",
            help="Synthetic: also run predictive at each --knob (a replay always does).",
        ),
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers", min=1, help="Synthetic: runs in parallel processes (default: CPUs)."
        ),
    ] = None,
    model: Annotated[str, typer.Option("--model", help="Forecasting model.")] = DEFAULT_MODEL,
    mode: Annotated[
        str, typer.Option("--mode", help="Planner mode: predictive or hybrid.")
    ] = "predictive",
    target_shortage: Annotated[
        float | None,
        typer.Option(
            "--target-shortage",
            help="A replay's service knob (default: the planner's, 0.001): the share of steps"
            " allowed short.",
        ),
    ] = None,
    wait_share: Annotated[
        float | None,
        typer.Option(
            "--wait-share",
            help="--synthetic's service knob (default: the planner's job_wait_share, 0.1): the"
            " share of the boot time requested GPUs may wait (a purely reactive autoscaler"
            " waits about one boot: 1.0).",
        ),
    ] = None,
    workload: Annotated[
        Path | None, typer.Option("--workload", help="Synthetic workload YAML (default shipped).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Workload seed.")] = 0,
    # Under 3 days the default model has no 12-hour horizon to train on in the quarter of
    # the span before the warm-up (2 failed late, after the workload was drawn).
    days: Annotated[float, typer.Option("--days", min=3, help="Workload days (synthetic).")] = 21.0,
    boot_minutes: Annotated[
        float, typer.Option("--boot-minutes", min=0, help="Boot time of every pool (synthetic).")
    ] = 10.0,
    queue: Annotated[
        str,
        typer.Option(
            "--queue",
            help="Admission order of waiting jobs (synthetic): fifo (arrival), priority, or"
            " qssf (smallest predicted GPU time first).",
        ),
    ] = "fifo",
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Simulate the scaler and draw it.

    With --trace: replay one series under every policy, draw the fleet against demand with
    the shortage beneath (fleet.png), and sweep the service-level knob (target shortage) of
    our planner to draw its cost/shortage points against the baselines' frontier, the
    cheapest swept baseline at each shortage level (frontier.png); `matched` in the summary
    sets each point against that cheapest baseline.

    With --synthetic: the job-level simulation on the synthetic workload; jobs arrive, wait
    for capacity in the --queue order and are placed by the placement engine's default
    policy (multi-node jobs as gangs; spare nodes are held with placeholders that real jobs
    preempt). Rows: reactive (Cluster Autoscaler), headroom (reactive plus k = 1-4 spare
    nodes per pool, as overprovisioning pods or a CapacityBuffer keep) and predictive at
    its default knob (`default: true`), with --frontier also at each --knob; scored by
    GPU-hours paid, the mean/p95/p99 wait for capacity, the share of jobs that waited and
    GPU-minutes waited. `matched` sets each predictive row against the cheapest baseline
    that waits no more and the least-waiting one that pays no more (jobs.png: reactive,
    the best headroom setting and predictive).
    """
    from predictor.foundation.errors import InputError

    if (trace is None) == (not synthetic):
        raise InputError("give exactly one of --trace and --synthetic")
    output_folder(out, "--out", SIMULATE_FILES)
    if frontier and not synthetic:
        raise typer.BadParameter(
            "is for --synthetic (a replay always sweeps the knob)", param_hint="--frontier"
        )
    if mode not in ("predictive", "hybrid"):
        raise typer.BadParameter("must be predictive or hybrid", param_hint="--mode")
    from scaler.placement.queue import ORDERS

    if queue not in ORDERS:
        raise typer.BadParameter(f"must be one of {', '.join(ORDERS)}", param_hint="--queue")
    # Each mode has its own knob; one given to the other would be ignored without a word.
    if synthetic and target_shortage is not None:
        raise typer.BadParameter(
            "is a replay's knob; --synthetic's is --wait-share", param_hint="--target-shortage"
        )
    if not synthetic and wait_share is not None:
        raise typer.BadParameter("is --synthetic's knob", param_hint="--wait-share")
    _shares([target_shortage], "--target-shortage", "target_shortage")
    _shares([wait_share], "--wait-share", "job_wait_share")
    _shares(knobs, "--knob", "job_wait_share" if synthetic else "target_shortage")
    from scaler.evaluation.simulate import simulate_jobs, simulate_trace

    policy = _load_policy(None, mode, target_shortage, wait_share)
    if synthetic:
        import os

        from scaler.evaluation.synthetic import checked_days

        checked_days(days, "--days")

        summary = simulate_jobs(
            out,
            policy,
            _model_factory(model),
            workload,
            seed,
            days,
            boot_minutes,
            queue,
            frontier=frontier,
            knobs=knobs,
            workers=workers or len(os.sched_getaffinity(0)),
        )
    else:
        summary = simulate_trace(
            out, trace, policy, _model_factory(model), lag, split, gpus_per_node, knobs
        )
    text = json.dumps(summary, indent=2, default=jsonable)
    write_text(out / "summary.json", text)
    if as_json:
        typer.echo(text)
        return
    from rich.table import Table

    table = Table(title=summary["title"])
    columns = SIMULATE_COLUMNS["jobs" if synthetic else "replay"]
    for i, label in enumerate(columns.values()):
        table.add_column(label, no_wrap=i == 0)  # labels wrap, so that no value is cut
    for row in summary["rows"]:
        table.add_row(*(_cell(row[c]) for c in columns))
    console = table_console()
    console.print(table)
    if synthetic:
        _print_matched(console, summary["matched"])
        placement = summary["placement"]
        preempted = ", ".join(
            f"{r['mode']} {r['knob']:g}: {r['placeholders_preempted']}"
            for r in summary["rows"]
            if r["default"] or r["mode"] == "headroom"
        )
        console.print(
            f"placement: the engine's {placement['policy']} policy, queue {placement['queue']};"
            " multi-node jobs as gangs; headroom and predictive modes hold spare nodes with"
            f" placeholders (times preempted: {preempted})"
        )
    console.print(f"pictures: {', '.join(summary['pictures'])}")


SIMULATE_COLUMNS = {  # row field -> column label
    "replay": {
        "policy": "policy",
        "provisioning_ratio": "ratio",
        "shortage_events": "events",
        "shortage_node_steps": "short",
        "scale_actions_per_day": "act/day",
    },
    "jobs": {
        "mode": "mode",
        "knob": "knob",
        "default": "default",
        "jobs": "jobs",
        "wait_p50_min": "p50 wait",
        "wait_p95_min": "p95 wait",
        "wait_p99_min": "p99 wait",
        "wait_mean_min": "mean wait",
        "share_waiting": "waiting",
        "gpu_minutes_waited": "GPU-min waited",
        "gpu_hours": "GPU-h",
        "cost": "cost",
        "seconds": "s",
    },
}
MATCHED_COLUMNS = {  # matched-view field -> column label
    "knob": "predictive knob",
    "default": "default",
    "gpu_hours": "GPU-h",
    "gpu_minutes_waited": "GPU-min waited",
    "cheapest_no_more_wait": "cheapest baseline waiting no more",
    "cheapest_gpu_hours": "its GPU-h",
    "gpu_hours_saving": "GPU-h saved",
    "least_wait_no_more_cost": "least-waiting baseline paying no more",
    "least_wait_gpu_minutes_waited": "its GPU-min waited",
    "wait_reduction": "wait cut",
    "dominated_by": "beaten on both by",
    "envelope_saving": "GPU-h saved, frontier",
    "envelope_wait_reduction": "wait cut, frontier",
}


def _print_matched(console: Console, matched: list[dict[str, object]]) -> None:
    from rich.table import Table

    table = Table(title="matched: each predictive row against the reactive/headroom rows")
    for i, label in enumerate(MATCHED_COLUMNS.values()):
        table.add_column(label, no_wrap=i == 0)
    for row in matched:
        cells = {**row, "dominated_by": ", ".join(row["dominated_by"]) or "-"}  # type: ignore[arg-type]
        for field in (
            "gpu_hours_saving",
            "wait_reduction",
            "envelope_saving",
            "envelope_wait_reduction",
        ):
            value = row[field]
            cells[field] = "-" if value is None else f"{value:+.1%}"
        table.add_row(*(_cell(cells[c]) for c in MATCHED_COLUMNS))
    console.print(table)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)
