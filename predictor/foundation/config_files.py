"""Config files: YAML text into validated pydantic models, with errors that name the file,
the line and the field (`pools.1.max_size`), as `InputError` does everywhere.

Every config of the product (collector, live loop, pools, planner policy, synthetic
workload) is read through here, so a mistake reads the same wherever it is made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from predictor.foundation.errors import InputError

Model = TypeVar("Model", bound=BaseModel)


class FieldError(ValueError):
    """A check across fields, raised in a validator, that still names the field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class FileSettings(BaseSettings):
    """Settings read from a YAML file that `GPUSCALE_*` environment variables override
    (nested fields with `__`), as a Secret or a Deployment's env would in a cluster."""

    model_config = SettingsConfigDict(
        env_prefix="GPUSCALE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML file arrives as init values; the environment overrides it.
        return (env_settings, init_settings)


@dataclass(frozen=True)
class YamlDocument:
    """A parsed file and its text (kept to find the line of a field that fails)."""

    path: Path
    text: str
    data: Any


def read_yaml(path: str | Path) -> YamlDocument:
    """Parse a YAML file; `data` is None for an empty one."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("file not found", path=file) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", path=file) from None
    try:
        return YamlDocument(file, text, yaml.safe_load(text))
    except yaml.YAMLError as exc:
        # PyYAML's own text quotes the file over several lines; the error is one line.
        mark = getattr(exc, "problem_mark", None)
        line = None if mark is None else mark.line + 1
        problem, context = getattr(exc, "problem", None), getattr(exc, "context", None)
        reason = " ".join(str(exc).split()) if problem is None else problem
        if problem is not None and context:
            reason += f" ({context})"
        raise InputError(f"not valid YAML: {reason}", path=file, line=line) from None


def load_model(model: type[Model], path: str | Path) -> Model:
    """A mapping file into `model`. Built through the constructor, so a pydantic-settings
    model still lets its environment variables override the file."""
    document = read_yaml(path)
    data = {} if document.data is None else document.data
    if not isinstance(data, dict):
        raise InputError("config must be a mapping of settings", path=document.path)
    return validated(model, data, source=document.path, text=document.text)


def validated(
    model: type[Model], data: Any, source: str | Path | None = None, text: str | None = None
) -> Model:
    """`model` from `data`; the first error names its field, and its line when `text` (the
    YAML it came from) is given."""
    try:
        return model(**data) if isinstance(data, dict) else model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        loc = tuple(first["loc"])
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, FieldError):
            field, message = cause.field, str(cause)
            # A check across fields runs on the section above the field it names: the
            # line (and any overriding variable) is the named field's.
            loc = tuple(int(p) if p.isdigit() else p for p in field.split("."))
        else:
            field = ".".join(str(part) for part in loc) or None
            message = first["msg"].removeprefix("Value error, ")
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
        variable = _environment_source(model, loc)
        if variable is not None:  # the file's line would point at a value that was overridden
            where = f"environment variable {variable}"
            raise InputError(message, path=where, column=field) from None
        line = None if text is None else _line_of(text, loc)
        raise InputError(message, path=source, line=line, column=field) from None


def _environment_source(model: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """The `GPUSCALE_*` variable that set the field at `loc` (or a section above it), for a
    settings model; None when the value came from the file."""
    if not issubclass(model, BaseSettings) or not loc:
        return None
    prefix = str(model.model_config.get("env_prefix") or "")
    delimiter = str(model.model_config.get("env_nested_delimiter") or "__")
    present = {name.upper(): name for name in os.environ}
    for depth in range(len(loc), 0, -1):
        wanted = (prefix + delimiter.join(str(part) for part in loc[:depth])).upper()
        if wanted in present:
            return present[wanted]
    return None


def _line_of(text: str, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at `loc`, or of its deepest ancestor present (a
    missing field is reported where its section is)."""
    node: Any = yaml.compose(text)
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = [v for k, v in node.value if k.value == str(part)]
            if not found:
                break
            node = found[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            node = node.value[part]
        else:
            break
        line = node.start_mark.line + 1
    return line
