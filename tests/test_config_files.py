"""The one YAML reader behind every config file: its errors are one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from predictor.config_files import read_yaml
from predictor.errors import InputError


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("interval_s: [15\n", 2, "expected ',' or ']', but got '<stream end>'"),
        ("a: 1\n b: 2\n", 2, "mapping values are not allowed here"),
        ("a: 'open\n", 2, "found unexpected end of stream"),
    ],
)
def test_invalid_yaml_is_one_line_naming_file_and_line(
    tmp_path: Path, text: str, line: int, reason: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        read_yaml(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{line}: not valid YAML: {reason}")
    assert err.value.line == line
