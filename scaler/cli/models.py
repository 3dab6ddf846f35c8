"""CLI commands `retrain`, `retrain-requests` and `models list | show | promote | rollback`:
the model registry and backtest-gated retraining from the telemetry store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from scaler.cli.output import MODEL_KINDS, table_console

STATE_DIR_HELP = "State directory holding the telemetry store."
REGISTRY_HELP = "Model registry directory (one folder per model name and version)."

RegistryOption = Annotated[
    Path, typer.Option("--registry", envvar="GPUSCALE_MODELS_DIR", help=REGISTRY_HELP)
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print as JSON.")]


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's commands to the app and the bench group."""
    app.command("retrain")(retrain)
    app.command("retrain-requests")(retrain_requests)
    models = typer.Typer(
        help="The model registry: list and inspect versions, promote one, roll back.",
        no_args_is_help=True,
    )
    models.command("list")(models_list)
    models.command("show")(models_show)
    models.command("promote")(models_promote)
    models.command("rollback")(models_rollback)
    app.add_typer(models, name="models")


def retrain(
    state_dir: Annotated[
        Path, typer.Option("--state-dir", envvar="GPUSCALE_STATE_DIR", help=STATE_DIR_HELP)
    ],
    registry: RegistryOption = Path("models"),
    name: Annotated[str, typer.Option("--name", help="Registry name of the served model.")] = (
        "gpuscale"
    ),
    model: Annotated[
        str,
        typer.Option(
            "--model",
            help=f"Kind of the candidate: {', '.join(MODEL_KINDS)}.",
        ),
    ] = "gpuscale",
    metric: Annotated[str, typer.Option("--metric", help="Store metric to forecast.")] = (
        "gpu_demand"
    ),
    series: Annotated[
        list[str] | None, typer.Option("--series", help="Only this series (repeatable).")
    ] = None,
    step: Annotated[
        str, typer.Option("--step", help="Forecast step; history is resampled (max per step).")
    ] = "10min",
    backtest_steps: Annotated[
        int, typer.Option("--backtest-steps", help="Steps in the recent window both are judged on.")
    ] = 144,
    horizons: Annotated[
        str, typer.Option("--horizons", help="Horizons in steps, comma-separated.")
    ] = "1,3,18",
    quantile: Annotated[
        float | None,
        typer.Option(
            "--quantile",
            help="Upper quantile judged (default: the planner's base quantile, 0.99).",
        ),
    ] = None,
    score: Annotated[
        str,
        typer.Option(
            "--score", help="pinball (of --quantile, the default) or rmse (of the median)."
        ),
    ] = "pinball",
    as_json: JsonOption = False,
) -> None:
    """Retrain the forecaster on the store's history; promote it only if it backtests better.

    The candidate is fitted on the history before a recent window (--backtest-steps), then
    the candidate and the served model (the latest version of --name) forecast that same
    window, each step from data up to t - h only; a served model whose training reached into
    the window is judged by its recipe (model kind and parameters) refitted before the
    window, so that neither side is scored on steps it has seen. The candidate is promoted
    (stored as the next version of --name, which makes it the served model) only when its
    score, averaged over --horizons, is lower; otherwise it is stored under NAME.rejected.
    Both scores are kept in the version's metadata. Exit status 0 either way.
    """
    import pandas as pd
    from rich.console import Console

    from predictor.foundation.errors import InputError
    from predictor.lifecycle.registry import ModelRegistry
    from predictor.lifecycle.retraining import RetrainPlan
    from predictor.lifecycle.retraining import retrain as run_retrain
    from predictor.telemetry.store import TelemetryStore

    store = TelemetryStore.existing(state_dir)  # retrain only reads it: never made here
    if score not in ("pinball", "rmse"):
        raise typer.BadParameter("pinball or rmse", param_hint="--score")
    try:
        steps = tuple(int(h) for h in horizons.split(","))
        resolution = pd.Timedelta(step)
    except ValueError as exc:
        raise InputError(f"bad --horizons or --step: {exc}") from None
    if resolution <= pd.Timedelta(0):  # as `store import --step` says
        raise typer.BadParameter("must be positive", param_hint="--step")
    if quantile is None:
        from scaler.planning.planner import PlannerPolicy

        quantile = float(PlannerPolicy.model_fields["base_quantile"].default)
    plan = RetrainPlan(
        name=name,
        model=model,
        metric=metric,
        series=tuple(series) if series else None,
        step=resolution,
        backtest_steps=backtest_steps,
        horizons=steps,
        quantile=quantile,
        score=score,  # type: ignore[arg-type]
    )
    console = Console(stderr=True, quiet=as_json)
    with console.status("retraining") as status:
        outcome = run_retrain(
            store,
            ModelRegistry(registry),
            plan,
            on_step=lambda what: status.update(what),
        )
    document = {
        "promoted": outcome.promoted,
        "reason": outcome.reason,
        "stored_as": f"{outcome.record.name}:{outcome.record.version}",
        "score": plan.score_name,
        "window": [outcome.window[0].isoformat(), outcome.window[1].isoformat()],
        "candidate": outcome.candidate.to_dict(),
        "served": None
        if outcome.current is None
        else {
            "version": outcome.current_version,
            "refitted": outcome.current_refitted,
            **outcome.current.to_dict(),
        },
    }
    if _echo_verdict(document, as_json):
        return
    for h, value in outcome.candidate.per_horizon.items():
        current = (
            "" if outcome.current is None else f", served {outcome.current.per_horizon[h]:.4g}"
        )
        typer.echo(f"  h={h}: candidate {value:.4g}{current} ({plan.score_name})")


def _echo_verdict(document: dict[str, object], as_json: bool) -> bool:
    """A retrain's outcome: the whole document as JSON (True: nothing more to print), or
    its verdict and where the candidate was stored, before the per-horizon or per-pool
    lines."""
    if as_json:
        typer.echo(json.dumps(document, indent=2))
        return True
    verdict = "PROMOTED" if document["promoted"] else "KEPT the served model"
    typer.echo(f"{verdict}: {document['reason']}")
    typer.echo(f"candidate stored as {document['stored_as']}")
    return False


def retrain_requests(
    config: Annotated[
        Path, typer.Option("--config", help="The scale config: its pools and state directory.")
    ],
    registry: Annotated[
        Path | None,
        typer.Option(
            "--registry",
            envvar="GPUSCALE_MODELS_DIR",
            help="Model registry directory (default: the config's model.registry).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Retrain the request-rate model (the GPUs jobs will ask of new nodes in the hour a
    boot ahead, which sizes the job-level spare) on the store's last four weeks; promote it
    only if it backtests better than both the seasonal table and the served model.

    Both are judged by Poisson deviance on the held-out last quarter of the history (a
    served model trained into it by its parameters refitted before it). Promoted, it is
    stored as the next version of the config's model.requests name, which `gpuscale scale`
    serves from its next start; otherwise under NAME.rejected. Exit status 0 either way.
    """
    from predictor.foundation.errors import InputError
    from predictor.lifecycle.registry import ModelRegistry
    from predictor.lifecycle.request_training import PoolShape
    from predictor.lifecycle.request_training import retrain_requests as run_retrain
    from predictor.telemetry.store import TelemetryStore
    from scaler.controller.config import load_live_config

    live = load_live_config(config)
    root = registry or live.model.registry
    if root is None:
        raise InputError("no registry: pass --registry or set model.registry", path=config)
    pools = {p.name: PoolShape(p.gpus_per_node, p.boot_seconds / 60) for p in live.pools}
    outcome = run_retrain(
        TelemetryStore.existing(live.state_dir), ModelRegistry(root), pools, live.model.requests
    )
    if _echo_verdict(outcome.to_dict(), as_json):
        return
    for pool, value in outcome.candidate.items():
        served = "" if outcome.served is None else f", served {outcome.served.get(pool, 0):.4g}"
        typer.echo(
            f"  {pool}: candidate {value:.4g}, seasonal {outcome.seasonal[pool]:.4g}{served}"
            " (Poisson deviance, the hour from a boot ahead)"
        )


def models_list(registry: RegistryOption = Path("models"), as_json: JsonOption = False) -> None:
    """List every stored version: when it was made, what kind, its backtest score, how it
    got there (retrain, promote, rollback) and which version each name serves.

    A version folder without a readable metadata.json or model.pkl (an interrupted copy)
    is listed as DAMAGED with the file at fault; while it is a name's newest version the
    name serves nothing, and commands that need its served model refuse to run.
    """
    from predictor.foundation.errors import InputError
    from predictor.lifecycle.registry import ModelRegistry

    if not registry.is_dir():  # a mistyped path is not an empty registry
        raise InputError("no such directory (the model registry)", path=registry)
    reg = ModelRegistry(registry)
    rows = []
    for name in reg.names():
        found = reg.scan(name)
        rows += [_list_row(entry, entry is found[-1]) for entry in found]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"model registry {registry}")
    for column in ("name", "version", "created", "model", "score", "by", "serving"):
        table.add_column(column)
    for row in rows:
        value = "" if row["value"] is None else f"{row['score']} {row['value']:.4g}"
        table.add_row(
            row["name"],
            str(row["version"]),
            str(row["created"] or ""),
            str(row["model"] or ""),
            value,
            row["by"] or "",
            "yes" if row["serving"] else "DAMAGED" if row["damaged"] else "",
        )
    table_console().print(table)
    for row in rows:
        if row["damaged"]:
            typer.echo(f"damaged: {row['damaged']}")


def _list_row(entry: Any, newest: bool) -> dict[str, Any]:
    """One version as `models list` prints it; a damaged one says what is wrong and, the
    newest, makes its name serve nothing until it is repaired or removed."""
    from predictor.lifecycle.registry import REJECTED_SUFFIX, DamagedVersion

    if isinstance(entry, DamagedVersion):
        keys = ("created", "model", "score", "value", "by")
        return {
            "name": entry.name,
            "version": entry.version,
            **dict.fromkeys(keys),
            "serving": False,
            "damaged": str(entry.error()),
        }
    meta = entry.metadata
    backtest = meta.get("backtest") or {}
    return {
        "name": entry.name,
        "version": entry.version,
        "created": meta.get("created"),
        "model": meta.get("model"),
        "score": backtest.get("score"),
        "value": (backtest.get("candidate") or {}).get("value"),
        "by": (meta.get("decision") or {}).get("by"),
        "serving": newest and not entry.name.endswith(REJECTED_SUFFIX),
        "damaged": None,
    }


def models_show(
    reference: Annotated[str, typer.Argument(help="NAME or NAME:VERSION (default: latest).")],
    registry: RegistryOption = Path("models"),
    selection: Annotated[
        bool,
        typer.Option(
            "--selection",
            help="Print only a `selected` model's offline choice per series, horizon and level"
            " (weights and validation pinball of every candidate) as a table, with the"
            " settings of its online choice after training.",
        ),
    ] = False,
) -> None:
    """Print one version's metadata (training window, features, settings, backtest scores,
    decision, library versions, artifact checksum) as JSON.

    For a `selected` model the settings hold its choice per series, horizon and level:
    the weight of each candidate and the validation pinball losses behind it
    (--selection prints them as a table).
    """
    from predictor.lifecycle.registry import ModelRegistry, parse_reference

    name, version = parse_reference(reference)
    record = ModelRegistry(registry).record(name, version)
    if selection:
        _print_selection(record)
        return
    typer.echo(json.dumps(record.metadata, indent=2))


def _print_selection(record: Any) -> None:
    from rich.table import Table

    from predictor.foundation.errors import InputError

    chosen = (record.metadata.get("settings") or {}).get("selection")
    if chosen is None:
        raise InputError(f"{record.name}:{record.version} is not a selected model")
    settings = record.metadata["settings"]
    candidates = settings["candidates"]
    online = settings.get("online")
    caption = (
        None
        if online is None
        else f"After training ({online['trained_until']}), the forecasts of all series take"
        " the mix with the lowest pinball, relative to the baseline's and averaged over the"
        f" series, over each series' last {online['window']} realised forecasts (the last"
        f" {online['validation']:g} of training seeds them) where it beats the prior"
        f" ({settings['prior']}) by {online['margin']:.0%}; a series counts from"
        f" {online['minimum']} realised forecasts on, and with none counting they take this"
        " table's offline choice."
    )
    table = Table(
        title=f"{record.name} v{record.version}: offline choice on the validation tail",
        caption=caption,
    )
    for column in ("series", "horizon", "level", "weights", *candidates, "chosen"):
        table.add_column(column, justify="left" if column in ("series", "weights") else "right")
    for c in chosen:
        weights = ", ".join(f"{n} {w:g}" for n, w in c["weights"].items())
        scores = c["pinball"] or {}
        table.add_row(
            "(unseen series)" if c["series"] == "*" else c["series"],
            str(c["horizon"]),
            f"{c['level']:g}",
            weights,
            *(f"{scores[n]:.4g}" if n in scores else "" for n in (*candidates, "chosen")),
        )
    table_console().print(table)


def models_promote(
    reference: Annotated[str, typer.Argument(help="NAME:VERSION to serve (e.g. a rejected one).")],
    registry: RegistryOption = Path("models"),
    to: Annotated[
        str | None,
        typer.Option("--to", help="Name to serve it under (default: NAME without .rejected)."),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Serve a stored version by hand: a copy becomes the newest version of the served name."""
    from predictor.lifecycle.registry import ModelRegistry
    from predictor.lifecycle.retraining import promote

    record = promote(ModelRegistry(registry), reference, to)
    _say(record, as_json)


def models_rollback(
    name: Annotated[str, typer.Argument(help="Served model name.")],
    registry: RegistryOption = Path("models"),
    as_json: JsonOption = False,
) -> None:
    """Serve again the model served before the current one (a copy becomes the newest
    version; repeated rollbacks walk further back)."""
    from predictor.lifecycle.registry import ModelRegistry, check_name
    from predictor.lifecycle.retraining import rollback

    record = rollback(ModelRegistry(registry), check_name(name))
    _say(record, as_json)


def _say(record: Any, as_json: bool) -> None:
    decision = record.metadata["decision"]
    document = {"serving": f"{record.name}:{record.version}", "reason": decision["reason"]}
    if as_json:
        typer.echo(json.dumps(document, indent=2))
    else:
        typer.echo(f"{record.name} now serves version {record.version} ({decision['reason']})")
