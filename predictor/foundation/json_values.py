"""How values JSON has no type for are written into records (registry metadata, the
decision log): timestamps as ISO 8601, numpy arrays and scalars as lists and numbers, the
rest as text. For `json.dumps(..., default=json_value)`."""

from __future__ import annotations


def json_value(value: object) -> object:
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
