"""Model registry: trained forecasters with their metadata, one folder per version.

Layout: `<root>/<name>/<version>/model.pkl` and `metadata.json`, versions numbered 1, 2, ...
A version is written into a temporary folder beside the others and renamed into place in
one step, so a reader sees a whole version or none; a crash leaves at most a `.tmp-*`
folder that no reader lists. A version folder without a whole `metadata.json` or
`model.pkl` (an interrupted copy, a damaged disk) is listed as damaged: its number is
never reused, and whatever needs it, or needs the served model while it is the newest
version, is refused with an error naming the file, rather than silently served by the
version before it. A writer whose decision rests on the served version (retrain, train,
promote, rollback) saves `after` it, and is refused if another version landed meanwhile.

Format: pickle. A deployed model is a composite (several LightGBM boosters, per-series
scales, calibration state), and pickle round-trips all of it exactly; LightGBM's own model
text would cover only the boosters and need a second format for the rest. Boosters pickle
through LightGBM's model string, so nothing depends on memory layout. Pickle runs code when
loaded: load only registries you trust. The metadata records the library versions, and
the artifact's SHA-256 is checked on load, so a damaged file is refused rather than
half-read.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle  # nosec B403
import platform
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path
from types import EllipsisType
from typing import Any

from predictor.foundation.errors import InputError
from predictor.foundation.json_values import json_value
from predictor.models.forecast import Forecaster

ARTIFACT = "model.pkl"
METADATA = "metadata.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# torch: the torch models pickle its tensors, and their numbers depend on its kernels.
_LIBRARIES = ("lightgbm", "torch", "pandas", "numpy", "gpuscale")
# A name with this suffix holds candidates that retraining rejected: it never serves.
REJECTED_SUFFIX = ".rejected"


def library_versions() -> dict[str, str]:
    """Versions of the libraries an artifact depends on (and of Python)."""
    found = {"python": platform.python_version()}
    for lib in _LIBRARIES:
        try:
            found[lib] = importlib_metadata.version(lib)
        except importlib_metadata.PackageNotFoundError:
            found[lib] = "unknown"
    return found


@dataclass(frozen=True)
class ModelRecord:
    """One stored version: where it lies and what its metadata says."""

    name: str
    version: int
    path: Path
    metadata: dict[str, Any]


@dataclass(frozen=True)
class DamagedVersion:
    """A version folder that cannot be used: `file` is what is wrong, `reason` says how."""

    name: str
    version: int
    file: Path
    reason: str

    def error(self) -> InputError:
        return InputError(
            f"{self.reason}, so {self.name}:{self.version} is damaged; restore the file or"
            f" remove {self.file.parent}",
            path=self.file,
        )


def parse_reference(reference: str) -> tuple[str, int | None]:
    """`NAME` or `NAME:VERSION` -> (name, version or None for the latest)."""
    name, sep, version = reference.partition(":")
    check_name(name)
    if not sep:
        return name, None
    if not version.isdecimal() or int(version) < 1:
        raise InputError(f"model version {version!r} must be a whole number >= 1")
    return name, int(version)


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise InputError(
            f"model name {name!r} must be 1-64 letters, digits, '.', '_' or '-'"
            " (starting with a letter or digit)"
        )
    return name


def check_served_name(name: str) -> str:
    """`name` as a name that serves: one ending in REJECTED_SUFFIX never does."""
    if check_name(name).endswith(REJECTED_SUFFIX):
        raise InputError(
            f"model name may not end in {REJECTED_SUFFIX!r}: {name!r} (such names hold"
            " rejected candidates and never serve)"
        )
    return name


class Superseded(InputError):
    """A save that was to follow `expected` found a newer version of `name` there: another
    writer (a second retrain, a promote) landed in between, and this one was not judged
    against it."""

    def __init__(self, name: str, expected: int | None, newest: int) -> None:
        self.name, self.expected, self.newest = name, expected, newest
        was = "nothing" if expected is None else f"{name}:{expected}"
        super().__init__(
            f"{name}:{newest} was saved while this ran (it began when {was} was served);"
            " nothing was saved, run it again"
        )


class ModelRegistry:
    """Versions of named models under `root`."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    def save(
        self,
        name: str,
        model: Forecaster,
        metadata: dict[str, Any],
        *,
        after: int | EllipsisType | None = ...,
    ) -> ModelRecord:
        """Store `model` as the next version of `name`; `metadata` is completed with the
        name, version, creation time, library versions and the artifact's checksum.

        `after` is the version the caller read as the newest (None: there was none); the
        save is then refused with `Superseded` when any other version has landed since,
        so a decision made against one served model never lands over another."""
        check_name(name)
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        payload = pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder))
        umask = os.umask(0)
        os.umask(umask)
        try:
            staging.chmod(0o777 & ~umask)  # mkdtemp makes 0700; a version is an ordinary folder
            (staging / ARTIFACT).write_bytes(payload)
            version = 0
            while True:
                # Above every numbered entry, damaged ones included, and above the number
                # just lost to a rival writer: the number only grows, so this ends.
                highest = self._highest(folder)
                if after is not ... and highest != (after or 0):
                    raise Superseded(name, after, highest)
                version = max(highest, version) + 1
                record = {
                    "name": name,
                    "version": version,
                    "created": datetime.now(UTC).isoformat(timespec="seconds"),
                    **metadata,
                    "artifact": {
                        "file": ARTIFACT,
                        "format": "pickle",
                        "sha256": hashlib.sha256(payload).hexdigest(),
                        "bytes": len(payload),
                    },
                    "libraries": library_versions(),
                }
                text = json.dumps(record, indent=2, default=json_value)
                (staging / METADATA).write_text(text + "\n")
                _fsync_tree(staging)
                try:
                    # rename() of a folder onto an existing one fails: a writer that lost a
                    # race for this version number takes the next one (or, with `after`,
                    # is refused on the next pass).
                    os.rename(staging, folder / str(version))
                except OSError:
                    if (folder / str(version)).exists():
                        continue
                    raise
                return ModelRecord(name, version, folder / str(version), record)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @staticmethod
    def _highest(folder: Path) -> int:
        return max((int(e.name) for e in folder.iterdir() if e.name.isdecimal()), default=0)

    def scan(self, name: str) -> list[ModelRecord | DamagedVersion]:
        """Every numbered folder of `name`, oldest first: a record, or what is damaged."""
        check_name(name)
        folder = self.root / name
        if not folder.is_dir():
            return []
        found = [_read_version(name, e) for e in folder.iterdir() if e.name.isdecimal()]
        return sorted(found, key=lambda v: v.version)

    def versions(self, name: str) -> list[ModelRecord]:
        """Every whole stored version of `name`, oldest first."""
        return [v for v in self.scan(name) if isinstance(v, ModelRecord)]

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            p.name for p in self.root.iterdir() if _NAME.match(p.name) and self.scan(p.name)
        )

    def served(self, name: str) -> ModelRecord | None:
        """The newest version of `name` (None when it has none); refused when damaged."""
        found = self.scan(name)
        return None if not found else _whole(found[-1])

    def record(self, name: str, version: int | None = None) -> ModelRecord:
        """The metadata of one version (the latest when `version` is None)."""
        found = self.scan(name)
        if not found:
            raise InputError(f"no model named {name!r} in the registry", path=self.root)
        if version is None:
            return _whole(found[-1])
        for entry in found:
            if entry.version == version:
                return _whole(entry)
        raise InputError(
            f"model {name!r} has no version {version} (versions:"
            f" {', '.join(str(v.version) for v in found)})",
            path=self.root,
        )

    def load(self, name: str, version: int | None = None) -> tuple[Forecaster, ModelRecord]:
        """The stored model and its record; a damaged artifact is refused."""
        rec = self.record(name, version)
        try:
            payload = (rec.path / ARTIFACT).read_bytes()
        except OSError as exc:  # gone or unreadable since it was listed
            raise InputError(f"cannot read: {exc.strerror}", path=rec.path / ARTIFACT) from None
        artifact = rec.metadata.get("artifact")
        expected = artifact.get("sha256") if isinstance(artifact, dict) else None
        if expected != hashlib.sha256(payload).hexdigest():
            raise InputError("artifact does not match its checksum", path=rec.path / ARTIFACT)
        # The registry directory is the operator's own, and the checksum above matches the
        # record written with the artifact: no foreign bytes reach pickle.
        return pickle.loads(payload), rec  # nosec B301


def _read_version(name: str, entry: Path) -> ModelRecord | DamagedVersion:
    """The version in folder `entry`, or what makes it unusable (checked without reading
    the artifact, which only `load` does, against its checksum)."""
    version = int(entry.name)
    meta_file = entry / METADATA
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError:
        return DamagedVersion(name, version, meta_file, "missing (an interrupted copy?)")
    except OSError as exc:
        return DamagedVersion(name, version, meta_file, f"cannot read: {exc.strerror}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return DamagedVersion(name, version, meta_file, f"not valid JSON ({exc})")
    if not isinstance(meta, dict):
        return DamagedVersion(name, version, meta_file, "not a JSON object")
    if not (entry / ARTIFACT).is_file():
        return DamagedVersion(name, version, entry / ARTIFACT, "missing")
    return ModelRecord(name, version, entry, meta)


def _whole(entry: ModelRecord | DamagedVersion) -> ModelRecord:
    if isinstance(entry, DamagedVersion):
        raise entry.error()
    return entry


def _fsync_tree(folder: Path) -> None:
    for file in folder.iterdir():
        with file.open("rb") as handle:
            os.fsync(handle.fileno())
