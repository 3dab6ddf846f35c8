"""CSV tables (plain or gzip) read fast with pandas, with errors that name file, line, column.

pandas parses the whole file in one pass (numbers straight to numeric columns, names and
timestamps as text); only a column that did not parse cleanly takes the slow path that
finds the offending cell. Line numbers are 1-based file lines (the header is line 1); they
map one-to-one to rows because blank lines are kept as rows and records never span lines
in these formats.
"""

from __future__ import annotations

import csv
import gzip
import io
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from predictor.foundation.errors import InputError

GZIP_MAGIC = b"\x1f\x8b"
_PARSER_LINE = re.compile(r"line (\d+)")
# The spellings read_csv's documentation lists as missing by default: number cells keep
# reading them as missing (written out, as pandas keeps its own list private).
MISSING_NUMBER_SPELLINGS = (
    "", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND",
    "1.#QNAN", "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null",
)  # fmt: skip


@dataclass(frozen=True, eq=False)
class CsvTable:
    """The cells of one CSV file; row i of `frame` sits on file line i + 2."""

    path: Path
    frame: pd.DataFrame

    def line(self, row: int) -> int:
        return int(row) + 2

    def error(self, message: str, row: int, column: str | None = None) -> InputError:
        return InputError(message, path=self.path, line=self.line(row), column=column)

    def header_error(self, message: str, column: str | None = None) -> InputError:
        """An error in what the header names (a column's name, one it lacks): line 1."""
        return InputError(message, path=self.path, line=1, column=column)

    def text(self, column: str, *, required: bool = True) -> pd.Series:
        """A text column, stripped; a missing cell (empty, NaN or only blanks) is an error
        unless `required` is False (then it reads as the empty string)."""
        if required:
            self._require_values(column)
        values = self.frame[column].fillna("").str.strip()
        # Blanks around a name are read away, so a cell of only blanks names nothing.
        blank = values == ""
        if required and blank.any():
            raise self.error("missing value (only blanks)", _first(blank), column)
        return values

    def numbers(
        self,
        column: str,
        *,
        integer: bool = False,
        minimum: float | None = 0.0,
        maximum: float | None = None,
        required: bool = True,
    ) -> pd.Series:
        """A numeric column as float64 (NaN only where `required` is False and the cell is
        empty), checked to be finite, within [minimum, maximum], and whole if `integer`."""
        cells = self.frame[column]
        if required:
            self._require_values(column)
        if pd.api.types.is_numeric_dtype(cells) and not pd.api.types.is_bool_dtype(cells):
            values = cells.astype("float64")
        else:
            values = pd.to_numeric(cells.str.strip(), errors="coerce").astype("float64")
            bad = values.isna() & cells.notna()
            if bad.any():
                row = _first(bad)
                raise self.error(f"not a number: {_quote(cells.iloc[row])}", row, column)
        bad = np.isinf(values)
        if bad.any():
            row = _first(bad)
            raise self.error(f"not a finite number: {_quote(cells.iloc[row])}", row, column)
        if integer:
            bad = values.notna() & (values != np.floor(values))
            if bad.any():
                row = _first(bad)
                raise self.error(f"not a whole number: {_quote(cells.iloc[row])}", row, column)
        if minimum is not None:
            bad = values < minimum
            if bad.any():
                row = _first(bad)
                raise self.error(
                    f"value {_quote(cells.iloc[row])} is below the minimum {minimum:g}", row, column
                )
        if maximum is not None:
            bad = values > maximum
            if bad.any():
                row = _first(bad)
                raise self.error(
                    f"value {_quote(cells.iloc[row])} is above the maximum {maximum:g}", row, column
                )
        return values

    def timestamps(self, column: str) -> pd.Series:
        """An ISO 8601 timestamp column as naive datetime64[ns]; offsets are converted to UTC."""
        cells = self.frame[column]
        self._require_values(column)
        parsed = pd.to_datetime(cells, format="ISO8601", utc=True, errors="coerce")
        if parsed.isna().any():  # slow path: tolerate surrounding blanks, then find the culprit
            parsed = pd.to_datetime(cells.str.strip(), format="ISO8601", utc=True, errors="coerce")
        bad = parsed.isna()
        if bad.any():
            row = _first(bad)
            raise self.error(f"not an ISO 8601 timestamp: {_quote(cells.iloc[row])}", row, column)
        return parsed.dt.tz_localize(None).astype("datetime64[ns]")

    def check_increasing(self, ds: pd.Series, ids: pd.Series | None, column: str) -> None:
        """Timestamps must strictly increase, in file order, within each series."""
        step = ds.diff() if ids is None else ds.groupby(ids.to_numpy(), sort=False).diff()
        bad = step <= pd.Timedelta(0)
        if not bad.any():
            return
        row = _first(bad)
        of = "" if ids is None else f" of series {ids.iloc[row]!r}"
        what = "duplicate" if step.iloc[row] == pd.Timedelta(0) else "out of order"
        raise self.error(
            f"timestamp {ds.iloc[row]} is {what}{of}: each must come after the one before",
            row,
            column,
        )

    def check_unique(self, values: pd.Series, column: str) -> None:
        dup = values.duplicated()
        if dup.any():
            row = _first(dup)
            raise self.error(f"duplicate value {_quote(values.iloc[row])}", row, column)

    def _require_values(self, column: str) -> None:
        empty = self.frame[column].isna()
        if empty.any():
            raise self.error("missing value (empty or NaN)", _first(empty), column)


def read_table(
    path: str | Path,
    required: Sequence[str],
    optional: Sequence[str] = (),
    *,
    matching: re.Pattern[str] | None = None,
    text: Sequence[str] = (),
) -> CsvTable:
    """Read the `required` and present `optional` columns of a CSV or gzip CSV, and those
    whose whole name is `matching` (a family named by a pattern, such as q<level>); the
    `text` columns (names, timestamps) stay text, the others are parsed as numbers where
    they can. In a text column only an empty cell is missing: a group, series, node or pod
    may be named `NA`, `None`, `null` or `nan`. In the others pandas' NA strings are
    missing values, as an empty cell is.

    Gzip is recognised by its magic bytes, whatever the name; a `.gz` name on a file that is
    not gzip is an error (it is almost always a truncated or mislabelled download).
    """
    file = Path(path).expanduser()
    compression = _compression(file)
    raw = _header(file, compression)
    header = [name.strip() for name in raw]
    missing = [c for c in required if c not in header]
    if missing:
        raise InputError(
            f"missing column {missing[0]!r} (the header has: {', '.join(header)})",
            path=file,
            line=1,
            column=missing[0],
        )
    wanted = set(required) | set(optional)
    columns = [c for c in header if c in wanted or (matching and matching.fullmatch(c))]
    # pandas names the columns as the header spells them, blanks and all.
    names = [r for r, name in zip(raw, header, strict=True) if name in text]
    try:
        frame = pd.read_csv(
            file,
            compression=compression,
            dtype=dict.fromkeys(names, str),
            # A name is missing only where empty; numbers keep pandas' NA strings (`NaN`,
            # `NA`, ...) as missing, as read_csv's default has always read them.
            keep_default_na=False,
            na_values={r: [""] if r in names else list(MISSING_NUMBER_SPELLINGS) for r in raw},
            skip_blank_lines=False,
            encoding="utf-8-sig",
        )
    except pd.errors.ParserError as exc:
        found = _PARSER_LINE.search(str(exc))
        raise InputError(
            "wrong number of fields", path=file, line=int(found.group(1)) if found else None
        ) from exc
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise InputError(f"corrupt gzip data: {exc}", path=file) from exc
    except UnicodeDecodeError as exc:
        raise _not_utf8(file, compression, exc) from exc
    # All columns are parsed (not `usecols`) so that a line with extra fields is caught.
    frame = frame.rename(columns=str.strip)[columns]
    # Blank lines at the very end are harmless; anywhere else they fail as missing values.
    blank = frame.isna().all(axis=1).to_numpy()
    if blank.any() and blank[-1]:
        keep = len(blank) - int(np.argmin(blank[::-1])) if not blank.all() else 0
        frame = frame.iloc[:keep]
    if frame.empty:
        raise InputError("no data rows after the header", path=file, line=2)
    return CsvTable(file, frame)


def _compression(file: Path) -> str | None:
    try:
        with file.open("rb") as handle:
            magic = handle.read(2)
    except FileNotFoundError:
        raise InputError("file not found", path=file) from None
    except IsADirectoryError:
        raise InputError("is a directory, not a CSV file", path=file) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", path=file) from exc
    if magic == GZIP_MAGIC:
        return "gzip"
    if file.suffix == ".gz":
        raise InputError("named .gz but not gzip-compressed", path=file)
    return None


def _header(file: Path, compression: str | None) -> list[str]:
    """The header's names as written, blanks and all (pandas names the columns so), each
    unique once stripped."""
    try:
        with (
            gzip.open(file, "rb") if compression == "gzip" else file.open("rb") as raw,
            io.TextIOWrapper(raw, encoding="utf-8-sig", newline="") as text,
        ):
            first = text.readline()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise InputError(f"corrupt gzip data: {exc}", path=file) from exc
    except UnicodeDecodeError as exc:
        raise _not_utf8(file, compression, exc) from exc
    if not first.strip():
        raise InputError("empty file: no header line", path=file, line=1)
    header = next(csv.reader([first]))
    seen: set[str] = set()
    for name in (raw.strip() for raw in header):
        if name in seen:
            raise InputError(f"column {name!r} appears twice", path=file, line=1, column=name)
        seen.add(name)
    return header


def _not_utf8(file: Path, compression: str | None, exc: UnicodeDecodeError) -> InputError:
    """The error for undecodable bytes, with the line they sit on (found on this slow path
    only: decoders report a byte offset inside a buffer, not a line)."""
    opener = gzip.open if compression == "gzip" else open
    with opener(file, "rb") as raw:
        for number, line in enumerate(raw, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return InputError(f"not UTF-8 text: {exc.reason}", path=file, line=number)
    return InputError(f"not UTF-8 text: {exc.reason}", path=file)


def _first(mask: pd.Series) -> int:
    return int(np.argmax(mask.to_numpy()))


def _quote(cell: object) -> str:
    text = "" if cell is None or (isinstance(cell, float) and np.isnan(cell)) else str(cell)
    return repr(text if len(text) <= 40 else text[:37] + "...")
