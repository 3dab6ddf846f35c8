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


def with_(path: tuple[str, ...], value: Any, **top: Any) -> Callable[[dict[str, Any]], None]:
    """Set the field at `path` to `value`, and any top-level sections `top` names."""

    def change(config: dict[str, Any]) -> None:
        config.update(top)
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
    "aws binding for no pool": (
        with_(
            ("provider",),
            {
                "kind": "aws",
                "aws": {
                    **AWS,
                    "bindings": [*AWS["bindings"], {"pool": "v100", "auto_scaling_group": "x"}],
                },
            },
        ),
        "provider.aws.bindings",
        "names pools not in `pools`: v100",
    ),
    "karpenter NodePool for no pool": (
        with_(
            ("provider",),
            {
                "kind": "karpenter",
                "karpenter": {
                    "node_pools": [
                        {"pool": "a100", "node_pool": "a"},
                        {"pool": "zzz", "node_pool": "z"},
                    ]
                },
            },
            kubernetes={"host": "http://127.0.0.1:9"},
        ),
        "provider.karpenter.node_pools",
        "names pools not in `pools`: zzz",
    ),
    "bad region": (
        with_(("provider",), {"kind": "aws", "aws": {**AWS, "region": "not a region!"}}),
        "provider.aws.region",
        "not a region name: 'not a region!'",
    ),
    "endpoint not a URL": (
        with_(("provider",), {"kind": "aws", "aws": {**AWS, "endpoint_url": "notaurl"}}),
        "provider.aws.endpoint_url",
        "not an endpoint URL (scheme and host): 'notaurl'",
    ),
    "initial size above max": (
        with_(("provider", "simulated", "initial_sizes"), {"a100": 500}),
        "provider.simulated.initial_sizes.a100",
        "500 is above the pool's max_size 10",
    ),
    "capacity for no pool": (
        with_(("provider", "simulated", "capacity"), {"v100": 3}),
        "provider.simulated.capacity",
        "names pools not in `pools`: v100",
    ),
    "unknown placement policy": (
        with_(("placement", "policy"), "nosuch"),
        "placement.policy",
        "unknown placement policy 'nosuch' (known: random, bestfit,",
    ),
    "demand group on a GPU model no pool has": (
        with_(("demand", "groups"), {"x": {"gpu_models": ["A100", "Z9000"]}}),
        "demand.groups.x.gpu_models",
        "no pool has GPU model Z9000 (pools have A100)",
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
