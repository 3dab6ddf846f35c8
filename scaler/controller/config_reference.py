"""The configuration reference (docs/configuration.md), written from the pydantic models.

The models are the contract: every field's type, default, bounds and description come from
`LiveConfig` (live.yaml: `gpuscale scale`, `serve`, `defrag`) and `CollectorConfig`
(collect.yaml: `gpuscale collect`), so the page cannot drift from what is validated at
start. A test holds the committed page equal to this module's output.

    python -m scaler.controller.config_reference --out docs/configuration.md
    python -m scaler.controller.config_reference --check docs/configuration.md
"""

from __future__ import annotations

import argparse
import inspect
import sys
import types
import typing
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from predictor.foundation.atomic_files import write_text
from predictor.telemetry.config import CollectorConfig
from scaler.controller.config import LiveConfig

ROOTS: tuple[tuple[str, type[BaseModel], str], ...] = (
    (
        "live.yaml",
        LiveConfig,
        "`gpuscale scale`, `gpuscale serve` and `gpuscale defrag --config live.yaml`; the Helm"
        " chart writes it from its values.",
    ),
    ("collect.yaml", CollectorConfig, "`gpuscale collect --config collect.yaml`."),
)

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path"}
_BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.MinLen, "min_length", "length ≥"),
    (annotated_types.MaxLen, "max_length", "length ≤"),
)


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    """The pydantic models an annotation holds (a section, a list or map of them)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def _type(annotation: Any, anchors: dict[type[BaseModel], str]) -> str:
    """A field's type as a reader of YAML sees it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if annotation is SecretStr:
        return "string (secret)"
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if inspect.isclass(annotation) and issubclass(annotation, Enum):
        return "one of " + ", ".join(f"`{m.value}`" for m in annotation)
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        anchor = anchors.get(annotation)
        return f"[section](#{anchor})" if anchor else "mapping"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a, anchors) for a in args)
    if origin in (tuple, list, set, frozenset):
        items = [a for a in args if a is not Ellipsis]
        if len(items) == 1 or (items and all(a == items[0] for a in items)):
            return f"list of {_type(items[0], anchors)}"
        return "list"
    if origin is dict:
        return f"map of {_type(args[0], anchors)} to {_type(args[1], anchors)}"
    if origin is typing.Annotated:
        return _type(args[0], anchors)
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> str:
    out = []
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                out.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(out)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        made = field.default_factory()  # type: ignore[call-arg]
        # A factory that reads the machine (the host name) has no fixed default to show.
        if isinstance(made, str):
            return f"computed (`{field.default_factory.__name__}`)"
        return _shown(made)
    return _shown(field.default)


def _shown(value: Any) -> str:
    if value is None or value is PydanticUndefined:
        return "none"
    if isinstance(value, BaseModel):
        return "see section"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (tuple, list, dict, set, frozenset)) and not value:
        return "empty"
    if isinstance(value, (tuple, list)) and all(isinstance(v, BaseModel) for v in value):
        return f"{len(value)} entries"
    text = str(list(value) if isinstance(value, tuple) else value)
    return f"`{text}`" if len(text) <= 40 else "see source"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _sections(root: type[BaseModel], file: str) -> list[tuple[str, type[BaseModel]]]:
    """Every section under `root`, breadth first, each under the first path reaching it."""
    found: list[tuple[str, type[BaseModel]]] = [(file, root)]
    seen = {root}
    queue: list[tuple[str, type[BaseModel]]] = [("", root)]
    while queue:
        prefix, model = queue.pop(0)
        for name, field in model.model_fields.items():
            many = typing.get_origin(field.annotation) in (tuple, list, dict) or any(
                typing.get_origin(a) in (tuple, list, dict)
                for a in typing.get_args(field.annotation)
            )
            path = f"{prefix}{name}{'[]' if many else ''}"
            for sub in _models_in(field.annotation):
                if sub not in seen:
                    seen.add(sub)
                    found.append((path, sub))
                    queue.append((f"{path}.", sub))
    return found


def _anchor(file: str, path: str) -> str:
    stem = file.split(".")[0]
    slug = "".join(c if c.isalnum() else "-" for c in path.lower()).strip("-")
    return stem if path == file else f"{stem}-{slug}"


def reference() -> str:
    """docs/configuration.md, as the models say it."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the pydantic models by scaler/controller/config_reference.py;"
        " do not edit by hand. -->",
        "",
        "Each file is YAML, validated at start: a wrong value stops the command with one line"
        " naming the file, the line and the field (exit 2). Environment variables override the"
        " file: `GPUSCALE_` plus the field path, nested fields joined by `__`"
        " (`GPUSCALE_STATE_DIR=/var/lib/gpuscale`, `GPUSCALE_SERVICE__TOKEN=...`). A section"
        " accepts only the fields listed here.",
        "",
        "This page is generated from the models the commands validate with; regenerate it"
        " after changing one:",
        "",
        "```bash",
        "python -m scaler.controller.config_reference --out docs/configuration.md",
        "```",
        "",
    ]
    for file, root, used_by in ROOTS:
        sections = _sections(root, file)
        anchors = {model: _anchor(file, path) for path, model in sections}
        lines += [f"## {file} {{#{anchors[root]}}}", "", f"Read by {used_by}", ""]
        for path, model in sections:
            if model is not root:
                lines += [f"### `{path}` {{#{anchors[model]}}}", ""]
            doc = (
                inspect.getdoc(model)
                if model.__doc__ and model.__doc__ != _base_doc(model)
                else None
            )
            if doc:
                lines += [" ".join(doc.split("\n\n")[0].split()), ""]
            lines += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
            for name, field in model.model_fields.items():
                lines.append(
                    f"| `{name}` | {_cell(_type(field.annotation, anchors))} | "
                    f"{_cell(_default(field))} | {_cell(_bounds(field))} | "
                    f"{_cell(field.description or '')} |"
                )
            lines.append("")
    return "\n".join(lines)


def _base_doc(model: type[BaseModel]) -> str | None:
    """The docstring a model inherits unchanged from pydantic (not its own)."""
    for base in model.__mro__[1:]:
        if base.__doc__ and base.__doc__ == model.__doc__:
            return base.__doc__
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="write the reference here")
    group.add_argument("--check", type=Path, help="exit 1 if this file differs from it")
    args = parser.parse_args(argv)
    text = reference()
    if args.out is not None:
        write_text(args.out, text)
        return 0
    try:
        current = args.check.read_text(encoding="utf-8")
    except OSError as exc:
        print(f"{args.check}: {exc.strerror}", file=sys.stderr)
        return 2
    if current != text:
        print(
            f"{args.check}: differs from the models; run python -m"
            f" scaler.controller.config_reference --out {args.check}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
