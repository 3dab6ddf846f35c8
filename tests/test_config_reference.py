"""docs/configuration.md is generated from the pydantic models and kept equal to them."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

from pydantic import BaseModel, Field

from predictor.telemetry.config import CollectorConfig
from scaler.controller import config_reference
from scaler.controller.config import LiveConfig

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"


def test_the_committed_page_equals_the_models() -> None:
    assert PAGE.read_text(encoding="utf-8") == config_reference.reference(), (
        "docs/configuration.md is out of date: run"
        " python -m scaler.controller.config_reference --out docs/configuration.md"
    )


def test_check_exits_1_on_a_stale_page_and_0_on_a_fresh_one(tmp_path: Path) -> None:
    def check(page: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "scaler.controller.config_reference", "--check", str(page)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )

    fresh = tmp_path / "fresh.md"
    assert config_reference.main(["--out", str(fresh)]) == 0
    assert check(fresh).returncode == 0
    stale = tmp_path / "stale.md"
    stale.write_text(fresh.read_text().replace("| `state_dir` |", "| `state_directory` |"))
    result = check(stale)
    assert result.returncode == 1
    assert "differs from the models" in result.stderr and "--out" in result.stderr


def _rows(model: type[BaseModel], text: str) -> set[str]:
    return {name for name in model.model_fields if f"| `{name}` |" in text}


def test_every_field_of_every_section_has_a_row() -> None:
    text = config_reference.reference()
    for root in (LiveConfig, CollectorConfig):
        seen: list[type[BaseModel]] = []
        queue: list[type[BaseModel]] = [root]
        while queue:
            model = queue.pop()
            if model in seen:
                continue
            seen.append(model)
            assert _rows(model, text) == set(model.model_fields), model.__name__
            for field in model.model_fields.values():
                queue += list(config_reference._models_in(field.annotation))
    # The knobs a platform team tunes, with their defaults and bounds.
    assert "| `job_wait_share` | number | `0.1` |" in text
    assert "| `target_shortage` | number | `0.001` |" in text


def test_a_new_field_changes_the_page(monkeypatch) -> None:
    class Section(BaseModel):
        """A section a later version adds."""

        retries: int = Field(default=3, ge=0, description="how often to try again")

    class Root(BaseModel):
        """A config file."""

        section: Section = Section()
        name: typing.Literal["a", "b"] = "a"

    monkeypatch.setattr(config_reference, "ROOTS", (("x.yaml", Root, "a test."),))
    text = config_reference.reference()
    assert "### `section` {#x-section}" in text
    assert "| `retries` | integer | `3` | ≥ 0 | how often to try again |" in text
    assert "| `name` | one of `a`, `b` | `a` |  |  |" in text
    assert "| `section` | [section](#x-section) | see section |  |  |" in text
