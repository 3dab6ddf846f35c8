"""The live config (`gpuscale scale`, `gpuscale defrag`): what it refuses when it is read,
naming the field and its line, and what only building the system can tell, which is still
one line naming the config file and the field, exit code 2, no traceback."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from live_fixtures import pool, write_config

from predictor.foundation.errors import InputError
from scaler.controller.config import load_live_config

REPO = Path(__file__).resolve().parents[1]
AWS = {"region": "us-east-1", "bindings": [{"pool": "a100", "auto_scaling_group": "gpu-a100"}]}


def base(tmp_path: Path) -> dict[str, Any]:
    return {"state_dir": str(tmp_path / "state"), "pools": [pool(max_size=10)]}


def with_(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(config: dict[str, Any]) -> None:
        section = config
        for key in path[:-1]:
            section = section.setdefault(key, {})
        section[path[-1]] = value

    return change


REFUSED = {
    # a provider section for a kind not in effect is never read: refused, not ignored
    "aws without kind": (
        with_(("provider",), {"aws": AWS}),
        "provider.aws",
        "given but provider.kind is simulated (the default): set kind aws",
    ),
    "simulated settings under kind aws": (
        with_(("provider",), {"kind": "aws", "aws": AWS, "simulated": {"seed": 1}}),
        "provider.simulated",
        "given but provider.kind is aws:",
    ),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_a_bad_config_is_refused_when_read_naming_the_field_and_its_line(
    tmp_path: Path, case: str
) -> None:
    change, field, reason = REFUSED[case]
    config = base(tmp_path)
    change(config)
    path = write_config(tmp_path / "live.yaml", config)
    with pytest.raises(InputError) as caught:
        load_live_config(path)
    assert caught.value.column == field
    assert reason in caught.value.reason
    assert caught.value.path == str(path) and caught.value.line is not None
    leaf = field.split(".")[-1]
    assert f'"{leaf}"' in path.read_text().splitlines()[caught.value.line - 1]


def test_a_provider_section_for_the_kind_in_effect_still_loads(tmp_path: Path) -> None:
    config = base(tmp_path)
    config["provider"] = {"simulated": {"initial_sizes": {"a100": 10}, "capacity": {"a100": 4}}}
    config["demand"] = {"groups": {"x": {"gpu_models": ["A100"]}}}
    loaded = load_live_config(write_config(tmp_path / "live.yaml", config))
    assert loaded.provider.kind == "simulated"
    assert loaded.provider.simulated.initial_sizes == {"a100": 10}
    aws = copy.deepcopy(base(tmp_path))
    aws["provider"] = {"kind": "aws", "aws": AWS}
    assert load_live_config(write_config(tmp_path / "aws.yaml", aws)).provider.aws is not None
    shipped = load_live_config(REPO / "deploy" / "live-simulated.yaml")
    assert shipped.provider.kind == "simulated"
