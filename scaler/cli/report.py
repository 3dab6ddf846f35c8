"""CLI command `report`: what `scale --shadow` recorded, the actual fleet against gpuscale."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from predictor.foundation.errors import InputError


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's commands to the app."""
    app.command("report")(report)
    app.command("shadow-day")(shadow_day)


def report(
    state_dir: Annotated[
        Path,
        typer.Option(
            "--state-dir",
            envvar="GPUSCALE_STATE_DIR",
            help="State directory `gpuscale scale --shadow` recorded into (shadow.sqlite).",
        ),
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Folder for report.md, report.html, the PNG.")
    ] = Path("shadow-report"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Compare the cluster's fleet with gpuscale's plan over the passes `scale --shadow`
    recorded: per pool, GPU-hours paid and GPU-hours of demand left waiting by the fleet the
    cluster had, and by the sizes gpuscale would have set carried out under the pools' boot
    times on the same demand, with the frontier of Cluster Autoscaler plus 0-8 spare nodes
    replayed the same way, and the waiting pods the cluster reported. Writes report.md,
    report.html and shadow-frontier.png into --out; prints the tables (or --json).
    """
    from scaler.controller.shadow import SHADOW_FILE, ShadowLog
    from scaler.evaluation.shadow_report import markdown, shadow_report, write_report

    if not (state_dir / SHADOW_FILE).is_file():
        raise InputError(
            f"no {SHADOW_FILE}: record passes with `gpuscale scale --shadow` first",
            path=state_dir,
        )
    passes = ShadowLog(state_dir).passes()
    if not passes:
        raise InputError("no shadow passes recorded yet", path=state_dir / SHADOW_FILE)
    made = shadow_report(passes)
    written = write_report(made, out)
    if as_json:
        typer.echo(json.dumps(made.to_dict() | {"files": [str(p) for p in written]}))
        return
    typer.echo(markdown(made, picture=None))
    typer.echo("wrote " + ", ".join(str(p) for p in written))


def shadow_day(
    config: Annotated[
        Path,
        typer.Option(
            "--config",
            help="Live config YAML (its pools, model and policy; deploy/live-simulated.yaml).",
        ),
    ],
    state_dir: Annotated[
        Path, typer.Option("--state-dir", help="A fresh state directory to play the day into.")
    ],
    seed: Annotated[int, typer.Option("--seed", help="Synthetic workload seed.")] = 0,
    history_days: Annotated[
        float, typer.Option("--history-days", min=0.0, help="Days in the store before the day.")
    ] = 14.0,
    steps: Annotated[
        int, typer.Option("--steps", min=1, help="Demand steps played (144: a day of 10 min).")
    ] = 144,
) -> None:
    """Shadow mode for a simulated day: the synthetic workload's first --history-days go
    into the store, then the next --steps demand steps are played against a simulated cloud
    whose pools scale reactively (Cluster Autoscaler: to the nodes each step's demand
    needs, after the pool's boot time), with gpuscale taking a `scale --shadow` pass at each
    step. Then `gpuscale report --state-dir` compares the two.
    """
    from scaler.controller.config import load_live_config
    from scaler.controller.shadow import SHADOW_FILE
    from scaler.evaluation.shadow_day import shadow_day as play

    if (state_dir / SHADOW_FILE).exists():
        raise InputError(f"already holds {SHADOW_FILE}: give a fresh one", path=state_dir)
    played = play(
        load_live_config(config), state_dir, seed=seed, history_days=history_days, steps=steps
    )
    typer.echo(
        f"{played.passes} shadow passes from {played.first:%Y-%m-%d %H:%M} to"
        f" {played.last:%Y-%m-%d %H:%M} in {state_dir}; next: gpuscale report --state-dir"
        f" {state_dir}"
    )
