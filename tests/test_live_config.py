"""The live config (`gpuscale scale`, `gpuscale defrag`): what it refuses when it is read,
naming the field and its line, and what only building the system can tell, which is still
one line naming the config file and the field, exit code 2, no traceback."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from live_fixtures import pool, write_config

from predictor.foundation.errors import InputError
from predictor.telemetry.config import KubernetesSettings
from predictor.telemetry.kubernetes import api_client
from scaler.controller.config import load_live_config
from scaler.controller.system import LiveSystem
from scaler.kube.drainability import DrainRules

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
    "cluster cache bound not positive": (
        with_(("kubernetes", "cache_stale_after_s"), 0),
        "kubernetes.cache_stale_after_s",
        "greater than 0",
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


@pytest.mark.parametrize("state_dir", ["a-file", "/proc/gpuscale"])
def test_a_state_dir_that_cannot_hold_state_names_the_field(tmp_path: Path, state_dir: str) -> None:
    (tmp_path / "a-file").write_text("x")
    config = base(tmp_path)
    config["state_dir"] = str(tmp_path / state_dir) if state_dir == "a-file" else state_dir
    path = write_config(tmp_path / "live.yaml", config)
    with pytest.raises(InputError) as caught:
        LiveSystem.build(load_live_config(path), source=path)
    assert (caught.value.path, caught.value.column) == (str(path), "state_dir")
    assert caught.value.reason.startswith(f"cannot keep state in {config['state_dir']}: ")


@pytest.mark.parametrize(
    "environment",
    [{"AWS_DEFAULT_REGION": "not a region!"}, {"AWS_ENDPOINT_URL": "notaurl"}],
    ids=["region", "endpoint"],
)
def test_a_bad_value_from_the_aws_environment_names_the_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, environment: dict[str, str]
) -> None:
    """The config leaves region and endpoint to boto3's chain, which reads them from the
    environment: only making the clients can tell they are bad."""
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    config = base(tmp_path)
    config["provider"] = {"kind": "aws", "aws": {**AWS, "region": None}}
    path = write_config(tmp_path / "live.yaml", config)
    with pytest.raises(InputError) as caught:
        LiveSystem.build(load_live_config(path), source=path)
    assert (caught.value.path, caught.value.column) == (str(path), "provider")
    assert "cannot create AWS clients" in caught.value.reason
    assert not (tmp_path / "state").exists()  # nothing written before the refusal


def test_the_drain_rules_are_cluster_autoscalers_defaults_and_its_flags_turn_them_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubernetes = {"host": "http://127.0.0.1:8001"}
    plain = write_config(tmp_path / "plain.yaml", base(tmp_path) | {"kubernetes": kubernetes})
    section = load_live_config(plain).kubernetes
    assert section is not None
    assert section.drain.rules() == DrainRules(system_pods=True, local_storage=True)

    kubernetes |= {"drain": {"skip_nodes_with_local_storage": False}}
    off = write_config(tmp_path / "off.yaml", base(tmp_path) | {"kubernetes": kubernetes})
    monkeypatch.setenv("GPUSCALE_KUBERNETES__DRAIN__SKIP_NODES_WITH_SYSTEM_PODS", "false")
    section = load_live_config(off).kubernetes
    assert section is not None
    assert section.drain.rules() == DrainRules(system_pods=False, local_storage=False)


@pytest.mark.parametrize("text", ["hello\n", "- a\n- b\n", "clusters: x\ncontexts: 3\n", "a: [\n"])
def test_a_kubeconfig_that_is_not_one_is_an_input_error_naming_it(
    tmp_path: Path, text: str
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(text)
    with pytest.raises(InputError) as caught:
        api_client(KubernetesSettings(kubeconfig=kubeconfig))
    assert caught.value.path == str(kubeconfig)
    assert "not a kubeconfig" in caught.value.reason


@pytest.mark.parametrize("command", ["scale", "defrag"])
def test_through_the_command_line_a_bad_config_is_one_line_and_exit_2(
    tmp_path: Path, command: str
) -> None:
    """Refused at build time (a state_dir that is a file) and on reading (a placement
    policy both commands make on every pass): one line on stderr, exit code 2."""
    (tmp_path / "a-file").write_text("x")
    config = base(tmp_path)
    config["state_dir"] = str(tmp_path / "a-file")
    config["kubernetes"] = {"host": "http://127.0.0.1:9"}
    built = write_config(tmp_path / "built.yaml", config)
    read = write_config(tmp_path / "read.yaml", {**config, "placement": {"policy": "nosuch"}})
    for path, field in ((built, "state_dir"), (read, "placement.policy")):
        extra = ["--once"] if command == "scale" else []
        done = subprocess.run(
            [sys.executable, "-m", "scaler", command, "--config", str(path), *extra],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and lines[0].startswith(f"error: {path}"), done.stderr
        assert f"column '{field}'" in lines[0]
