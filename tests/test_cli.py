from pathlib import Path

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


def _outputs(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    (tmp_path / "sim" / "summary.json").mkdir(parents=True)
    return {"file": tmp_path / "afile", "dir": tmp_path / "adir", "sim": tmp_path / "sim"}


@pytest.mark.parametrize(
    ("args", "option", "reason"),
    [
        (["generate", "--out", "{file}"], "--out", "is a file, not a folder"),
        (["generate", "--out", "{file}/sub"], "--out", "is a file, not a folder"),
        (["simulate", "--synthetic", "--out", "{file}"], "--out", "is a file, not a folder"),
        (["simulate", "--trace", "series:x.csv", "--out", "{sim}"], "--out", "is a folder"),
        (["forecast", "--trace", "series:x.csv", "--plot", "{dir}"], "--plot", "is a folder"),
        (["bench", "forecast", "--trace", "series:x.csv", "--json", "{dir}"], "--json", "folder"),
        (["bench", "scaling", "--trace", "series:x.csv", "--json", "{file}/x.json"], "--json", ""),
        (["bench", "placement", "--nodes", "n.csv", "--pods", "p.csv", "--json", "{file}/x.json"],
         "--json", "is a file, not a folder"),
        (["bench", "placement", "--nodes", "n.csv", "--pods", "p.csv", "--json", "{dir}/o.json",
          "--plot", "{dir}"], "--plot", "is a folder, not a file"),
    ],
)  # fmt: skip
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(
    tmp_path: Path, args: list[str], option: str, reason: str
) -> None:
    """Checked first: the inputs named here do not even exist, and nothing is written."""
    paths = _outputs(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    result = CliRunner().invoke(app, [a.format(**paths) for a in args], env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert f"Invalid value for {option}" in result.output and reason in result.output
    assert sorted(tmp_path.rglob("*")) == before
