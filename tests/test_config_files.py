"""The one YAML reader behind every config file: its errors are one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from predictor.foundation.config_files import read_yaml
from predictor.foundation.errors import InputError


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


def test_a_bad_value_from_the_environment_names_the_variable_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from predictor.telemetry.config import load_config

    path = tmp_path / "collect.yaml"
    path.write_text("interval_s: 15\nprometheus:\n  url: http://prometheus:9090\n")
    monkeypatch.setenv("GPUSCALE_PROMETHEUS__TIMEOUT_S", "soon")
    with pytest.raises(InputError) as err:
        load_config(path)
    assert str(err.value).startswith(
        "environment variable GPUSCALE_PROMETHEUS__TIMEOUT_S, column 'prometheus.timeout_s': "
    )
    assert err.value.line is None
    # the same mistake in the file still names the file and its line
    monkeypatch.delenv("GPUSCALE_PROMETHEUS__TIMEOUT_S")
    path.write_text("interval_s: 15\nprometheus:\n  url: http://prometheus:9090\n  timeout_s: x\n")
    with pytest.raises(InputError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}:4, column 'prometheus.timeout_s': ")
