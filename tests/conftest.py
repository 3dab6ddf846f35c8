"""Shared fixtures: where the shared real traces live, and the CI rule for service skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
TRACES = SHARED / "traces"


def require_service(reason: str) -> None:
    """Skip locally when a service or data set is missing; in CI that is a failure."""
    if os.environ.get("GPUSCALE_REQUIRE_SERVICES"):
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES.is_dir():
        require_service(f"shared traces not found at {TRACES}")
    return TRACES
