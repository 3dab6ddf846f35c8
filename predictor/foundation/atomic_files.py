"""Files written whole or not at all: a temporary name in the same folder, then a rename.

Every report, picture, JSON document and generated data file of the product goes through
here, so an interrupted run never leaves a half-written file where a reader expects one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

Writer = Callable[[Path], None]


def write_files(folder: Path, writers: Mapping[str, Writer]) -> None:
    """Write every file of `writers` (name -> function writing to the path it is given) to a
    temporary name first, then move all into place: a failure while writing leaves the old
    files untouched and no temporary files behind."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    staged: dict[str, Path] = {}
    umask = os.umask(0)
    os.umask(umask)
    try:
        for name, write in writers.items():
            handle, temp = tempfile.mkstemp(
                prefix=f".{name}.", suffix=Path(name).suffix, dir=folder
            )
            os.close(handle)
            staged[name] = Path(temp)
            write(staged[name])
            os.chmod(temp, 0o666 & ~umask)  # mkstemp makes 0600; the result is an ordinary file
        for name, temp in staged.items():
            os.replace(temp, folder / name)
    finally:
        for temp in staged.values():
            temp.unlink(missing_ok=True)


def write_file(path: Path, write: Writer) -> Path:
    """One file, atomically; returns its path."""
    path = Path(path)
    write_files(path.parent, {path.name: write})
    return path


def write_text(path: Path, text: str) -> Path:
    """A UTF-8 text file, atomically; returns its path."""
    return write_file(path, lambda temp: temp.write_text(text, encoding="utf-8"))
