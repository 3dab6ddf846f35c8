"""Config files: YAML text into validated pydantic models, with errors that name the file,
the line (bad YAML) or the field (bad values), as `InputError` does everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from predictor.errors import InputError

Model = TypeVar("Model", bound=BaseModel)


def read_yaml(path: str | Path) -> object:
    """The parsed document (None for an empty file)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", path=file) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = None if mark is None else mark.line + 1
        raise InputError(f"not valid YAML: {exc}", path=file, line=line) from None


def validated(model: type[Model], data: object, source: str | Path | None = None) -> Model:
    """`model` from `data`; the first error names its field, e.g. `pools.1.max_size`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise InputError(message, path=source, column=field) from None
