"""What every command shares in how it talks: help text from docstrings, JSON values."""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING

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
