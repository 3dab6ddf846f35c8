import pytest
from typer.testing import CliRunner

from scaler.cli import app


def test_help_lists_commands() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "bench" in result.output


def test_model_options_name_every_model_kind() -> None:
    from predictor.models import MODEL_NAMES
    from scaler.cli.output import MODEL_KINDS

    assert set(MODEL_KINDS) == set(MODEL_NAMES) - {"sharded"}
    for command in ("train", "retrain"):
        result = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
        assert result.exit_code == 0
        assert "selected" in result.output and "torch-conformal" in result.output


def test_tables_into_a_pipe_are_not_cut_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    from scaler.cli.output import PIPE_WIDTH, table_console

    monkeypatch.delenv("COLUMNS", raising=False)
    assert table_console().width == PIPE_WIDTH  # pytest captures stdout: not a terminal
    monkeypatch.setenv("COLUMNS", "100")
    assert table_console().width == 100
