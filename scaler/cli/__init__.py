"""The `gpuscale` command line: a thin shell over predictor and scaler.

Each command group lives in its own module with a `register(app, bench)` function; heavy
libraries are imported inside commands so `gpuscale --help` stays fast.
"""

from __future__ import annotations

import sys

import typer

from predictor.foundation.errors import InputError
from scaler.cli import (
    data,
    defrag,
    demo,
    forecasting,
    journal,
    live,
    loop_bench,
    models,
    placing,
    report,
    scaling,
    telemetry,
)
from scaler.cli.output import prose

app = typer.Typer(
    name="gpuscale",
    help="Predictive autoscaling and fragmentation-aware placement for GPU clusters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
bench = typer.Typer(
    help="Benchmarks on real traces (protocols in BENCHMARKS.md); --json writes the rows.",
    no_args_is_help=True,
)
app.add_typer(bench, name="bench")

for module in (
    data,
    forecasting,
    scaling,
    placing,
    live,
    loop_bench,
    journal,
    report,
    defrag,
    demo,
    telemetry,
    models,
):
    module.register(app, bench)


def _help_from_docstrings(group: typer.Typer) -> None:
    """Commands are documented by their docstrings; unwrap them once, here, for all."""
    for info in group.registered_commands:
        if info.help is None and info.callback is not None:
            info.help = prose(info.callback.__doc__)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _help_from_docstrings(sub.typer_instance)


_help_from_docstrings(app)


def main() -> None:
    """Console entry point: bad input is one line on stderr and exit code 2."""
    try:
        app()
    except InputError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
