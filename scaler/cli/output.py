"""What every command shares in how it talks: help text from docstrings, JSON values, and
the up-front check of the paths it will write."""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.console import Console

# Into a pipe or a CI log rich assumes 80 columns and cuts table cells; tables are meant
# to be read whole there too.
PIPE_WIDTH = 160

# The model kinds a user may ask for by name (`predictor.models`, less `sharded`, which
# `--dask-scheduler` builds); kept here so `--help` needs no import of the models.
MODEL_KINDS = (
    "gpuscale",
    "lightgbm",
    "torch",
    "torch-conformal",
    "selected",
    "empirical",
    "persistence",
    "seasonal-naive",
)


def prose(doc: str | None) -> str:
    """A docstring as help text: paragraphs kept, the hard line wraps inside them removed
    (Typer's rich help would print them as they stand)."""
    paragraphs = inspect.cleandoc(doc or "").split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


def jsonable(value: object) -> object:
    """`json.dumps` default for what benchmark rows carry: NaN as null, the rest as text."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def table_console() -> Console:
    """A console on stdout for tables: the terminal's width, or PIPE_WIDTH columns when
    stdout is not a terminal (COLUMNS, when set, still decides)."""
    import os

    from rich.console import Console

    console = Console()
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(width=PIPE_WIDTH)


def output_file(path: Path | None, option: str) -> None:
    """Refuse, before any work, a file the command could not write at its end: a folder at
    its path, or a folder for it that is a file or may not be written (None: no output)."""
    if path is None:
        return
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a folder, not a file", param_hint=option)
    _creatable(path.parent, option)


def output_folder(path: Path, option: str, names: Sequence[str] = ()) -> None:
    """Refuse, before any work, a folder the command could not write its files `names`
    into: a file at its path or at a folder above it, a folder at one of the files' paths,
    or a folder that may not be written."""
    if path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{path} is a file, not a folder", param_hint=option)
    for name in names:
        if (path / name).is_dir():
            raise typer.BadParameter(f"{path / name} is a folder, not a file", param_hint=option)
    _creatable(path, option)


def _creatable(folder: Path, option: str) -> None:
    """`folder` may be written into, or made: its nearest existing ancestor is a folder
    this process may write (mkdir and the atomic writes' rename need that)."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise typer.BadParameter(f"{existing} is a file, not a folder", param_hint=option)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"cannot write into {existing}", param_hint=option)
