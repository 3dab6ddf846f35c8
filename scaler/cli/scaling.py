"""CLI commands: scaling."""

from __future__ import annotations

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's commands to the app and the bench group."""
