"""Model registry: trained forecasters with their metadata, one folder per version.

Layout: `<root>/<name>/<version>/model.pkl` and `metadata.json`, versions numbered 1, 2, ...
A version is written into a temporary folder beside the others and renamed into place in
one step, so a reader sees a whole version or none; a crash leaves at most a `.tmp-*`
folder that no reader lists.

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
from typing import Any

from predictor.foundation.errors import InputError
from predictor.foundation.json_values import json_value
from predictor.models.forecast import Forecaster

ARTIFACT = "model.pkl"
METADATA = "metadata.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_LIBRARIES = ("lightgbm", "pandas", "numpy", "gpuscale")


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


def parse_reference(reference: str) -> tuple[str, int | None]:
    """`NAME` or `NAME:VERSION` -> (name, version or None for the latest)."""
    name, sep, version = reference.partition(":")
    check_name(name)
    if not sep:
        return name, None
    if not version.isdigit() or int(version) < 1:
        raise InputError(f"model version {version!r} must be a whole number >= 1")
    return name, int(version)


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise InputError(
            f"model name {name!r} must be 1-64 letters, digits, '.', '_' or '-'"
            " (starting with a letter or digit)"
        )
    return name


class ModelRegistry:
    """Versions of named models under `root`."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    def save(self, name: str, model: Forecaster, metadata: dict[str, Any]) -> ModelRecord:
        """Store `model` as the next version of `name`; `metadata` is completed with the
        name, version, creation time, library versions and the artifact's checksum."""
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
            while True:
                version = max((r.version for r in self.versions(name)), default=0) + 1
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
                    # race for this version number takes the next one.
                    os.rename(staging, folder / str(version))
                except OSError:
                    if (folder / str(version)).exists():
                        continue
                    raise
                return ModelRecord(name, version, folder / str(version), record)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def versions(self, name: str) -> list[ModelRecord]:
        """Every stored version of `name`, oldest first."""
        check_name(name)
        folder = self.root / name
        if not folder.is_dir():
            return []
        out = []
        for entry in folder.iterdir():
            if entry.name.isdigit() and (entry / METADATA).is_file():
                meta = json.loads((entry / METADATA).read_text())
                out.append(ModelRecord(name, int(entry.name), entry, meta))
        return sorted(out, key=lambda r: r.version)

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            p.name for p in self.root.iterdir() if _NAME.match(p.name) and self.versions(p.name)
        )

    def record(self, name: str, version: int | None = None) -> ModelRecord:
        """The metadata of one version (the latest when `version` is None)."""
        versions = self.versions(name)
        if not versions:
            raise InputError(f"no model named {name!r} in the registry", path=self.root)
        if version is None:
            return versions[-1]
        for rec in versions:
            if rec.version == version:
                return rec
        raise InputError(
            f"model {name!r} has no version {version} (versions:"
            f" {', '.join(str(r.version) for r in versions)})",
            path=self.root,
        )

    def load(self, name: str, version: int | None = None) -> tuple[Forecaster, ModelRecord]:
        """The stored model and its record; a damaged artifact is refused."""
        rec = self.record(name, version)
        payload = (rec.path / ARTIFACT).read_bytes()
        expected = rec.metadata.get("artifact", {}).get("sha256")
        if expected != hashlib.sha256(payload).hexdigest():
            raise InputError("artifact does not match its checksum", path=rec.path / ARTIFACT)
        # The registry directory is the operator's own, and the checksum above matches the
        # record written with the artifact: no foreign bytes reach pickle.
        return pickle.loads(payload), rec  # nosec B301


def _fsync_tree(folder: Path) -> None:
    for file in folder.iterdir():
        with file.open("rb") as handle:
            os.fsync(handle.fileno())
