"""The one error type for bad input, so every front end can report it the same way."""

from __future__ import annotations

from pathlib import Path


class InputError(ValueError):
    """Input that cannot be used: names the file and, where known, the line and column.

    The CLI turns it into one line on stderr and exit code 2; the service into a 4xx.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        line: int | None = None,
        column: str | None = None,
    ) -> None:
        self.path = None if path is None else str(path)
        self.line = line
        self.column = column
        self.reason = message
        where = []
        if self.path is not None:
            where.append(self.path + (f":{line}" if line is not None else ""))
        elif line is not None:
            where.append(f"line {line}")
        if column is not None:
            where.append(f"column '{column}'")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)
