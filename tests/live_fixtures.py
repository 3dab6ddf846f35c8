"""Helpers for the live loop's tests: an Auto Scaling group in moto, a stand-in kubelet that
registers the group's instances as Kubernetes nodes, demand written into the store, config
files, and the `gpuscale scale` command line run in-process or as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import typer
from fake_kube import FakeKube

from predictor.telemetry.store import TelemetryStore

ZONE = "us-east-1a"
POOL_LABEL = "gpuscale.io/pool"
GPU_PRODUCT = "nvidia.com/gpu.product"
# `gpuscale scale` as a process, whatever the lead's CLI registers: the command module's
# own register() on a bare Typer app.
LAUNCH = (
    "import typer; from scaler.cli import live; app = typer.Typer();"
    " live.register(app, typer.Typer()); app()"
)


def scale_app() -> typer.Typer:
    from scaler.cli import live

    app = typer.Typer()
    live.register(app, typer.Typer())
    return app


def utc_now() -> pd.Timestamp:
    return pd.Timestamp.now(tz="UTC").tz_localize(None)


def write_demand(state_dir: Path, series: str, values: list[float], step_s: float = 1.0) -> None:
    """Demand points ending now, one every `step_s` seconds."""
    end = utc_now().floor(f"{step_s}s")
    ds = pd.date_range(end=end, periods=len(values), freq=f"{step_s}s")
    TelemetryStore(state_dir).append(pd.DataFrame({"unique_id": series, "ds": ds, "y": values}))


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def pool(name: str = "a100", *, min_size: int = 1, max_size: int = 10) -> dict[str, Any]:
    return {
        "name": name,
        "gpu_model": "A100",
        "gpus_per_node": 8,
        "cpu_milli_per_node": 96_000,
        "memory_mib_per_node": 1_048_576,
        "price_per_hour": 32.0,
        "boot_seconds": 0,
        "min_size": min_size,
        "max_size": max_size,
    }


def fast_policy(step_s: float = 1.0) -> dict[str, Any]:
    """Decide on the latest demand step as it is: no dip hold, no hysteresis, and a margin
    that needs more history than a test has (the bound is the forecast quantile)."""
    return {
        "mode": "predictive",
        "step_seconds": step_s,
        "drop_hold_steps": 0,
        "min_scores": 10_000,
        "calibration_window": 10_000,
    }


@dataclass
class Asg:
    """One Auto Scaling group in moto, seen through a client straight to moto."""

    name: str
    autoscaling: Any
    ec2: Any

    @classmethod
    def create(cls, session: Any, endpoint: str, desired: int, max_size: int = 10) -> Asg:
        name = f"gpu-{uuid.uuid4().hex[:8]}"
        ec2 = session.client("ec2", endpoint_url=endpoint)
        autoscaling = session.client("autoscaling", endpoint_url=endpoint)
        ec2.create_launch_template(
            LaunchTemplateName=name,
            LaunchTemplateData={"ImageId": "ami-12345678", "InstanceType": "p4d.24xlarge"},
        )
        autoscaling.create_auto_scaling_group(
            AutoScalingGroupName=name,
            MinSize=0,
            MaxSize=max_size,
            DesiredCapacity=desired,
            LaunchTemplate={"LaunchTemplateName": name, "Version": "$Latest"},
            AvailabilityZones=[ZONE],
        )
        return cls(name, autoscaling, ec2)

    def describe(self) -> dict[str, Any]:
        groups = self.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[self.name])
        return groups["AutoScalingGroups"][0]

    @property
    def desired(self) -> int:
        return int(self.describe()["DesiredCapacity"])

    def in_service(self) -> list[str]:
        return sorted(
            i["InstanceId"]
            for i in self.describe()["Instances"]
            if i["LifecycleState"] in ("InService", "Pending")
        )

    def launched(self) -> dict[str, str]:
        """Every instance the group ever launched -> its EC2 state (by its own launch
        template: moto drops the group tag from terminated instances)."""
        (template,) = self.ec2.describe_launch_templates(LaunchTemplateNames=[self.name])[
            "LaunchTemplates"
        ]
        tag = {"Name": "tag:aws:ec2launchtemplate:id", "Values": [template["LaunchTemplateId"]]}
        answer = self.ec2.describe_instances(Filters=[tag])
        return {
            i["InstanceId"]: i["State"]["Name"]
            for r in answer["Reservations"]
            for i in r["Instances"]
        }


def aws_config(path: Path, moto_url: str, asg: Asg, state_dir: Path, **extra: Any) -> Path:
    """A live config on the AWS provider (moto's server), one pool bound to `asg`, the
    persistence model and the fast policy; `extra` adds or replaces top-level sections."""
    from moto_fixture import REGION

    return write_config(
        path,
        {
            "state_dir": str(state_dir),
            "pools": [pool(min_size=1)],
            "provider": {
                "kind": "aws",
                "aws": {
                    "region": REGION,
                    "endpoint_url": moto_url,
                    "bindings": [{"pool": "a100", "auto_scaling_group": asg.name}],
                },
            },
            "model": {"name": "persistence"},
            "policy": fast_policy(),
            **extra,
        },
    )


def kube_node_name(instance: str) -> str:
    return f"ip-{instance}.ec2.internal"


def register_nodes(fake: FakeKube, asg: Asg, pool_name: str = "a100") -> dict[str, str]:
    """What kubelets and the cloud controller do: every serving instance becomes a ready
    node with its providerID; a node whose instance is gone is deleted. Returns instance
    -> node name."""
    serving = set(asg.in_service())
    for node in fake.objects("nodes"):
        instance = node["spec"].get("providerID", "").rsplit("/", 1)[-1]
        if instance not in serving:
            fake.delete("nodes", node["metadata"]["name"])
    names = {}
    known = {n["metadata"]["name"] for n in fake.objects("nodes")}
    for instance in sorted(serving):
        name = kube_node_name(instance)
        names[instance] = name
        if name not in known:
            ready_gpu_node(fake, name, instance, pool_name)
    return names


def ready_gpu_node(
    fake: FakeKube, name: str, instance: str | None = None, pool_name: str = "a100"
) -> str:
    """A registered, ready 8-GPU A100 node of `pool_name` backed by EC2 `instance` (by
    default one named after the node)."""
    fake.create(
        "nodes",
        {
            "metadata": {"name": name, "labels": {POOL_LABEL: pool_name, GPU_PRODUCT: "A100"}},
            "spec": {"providerID": f"aws:///{ZONE}/{instance or 'i-' + name}"},
            "status": {
                "allocatable": {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": "8"},
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        },
    )
    return name


def run_pod(
    fake: FakeKube,
    name: str,
    node: str,
    *,
    gpus: int = 0,
    labels: dict[str, str] | None = None,
    namespace: str = "ml",
) -> None:
    resources = {"requests": {"cpu": "1", "memory": "1Gi"}}
    if gpus:
        resources["requests"]["nvidia.com/gpu"] = str(gpus)
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
    owner = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": name, "uid": f"rs-{name}"}
    fake.create(
        "pods",
        {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": labels or {},
                # A drain may evict it: its controller recreates it.
                "ownerReferences": [owner | {"controller": True}],
            },
            "spec": {
                "nodeName": node,
                "containers": [{"name": "main", "image": "busybox", "resources": resources}],
            },
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        },
    )


def aws_env() -> dict[str, str]:
    """The standard credential chain's variables, pointing boto3 at moto's fake account."""
    from moto_fixture import CREDENTIALS, REGION

    return {
        "AWS_ACCESS_KEY_ID": CREDENTIALS["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": CREDENTIALS["aws_secret_access_key"],
        "AWS_DEFAULT_REGION": REGION,
    }


def spawn_scale(
    config: Path, *args: str, output: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`gpuscale scale --config CONFIG ARGS` as a real process; stdout and stderr go to the
    file `output` (a pipe nobody reads would fill and stall a long-running loop)."""
    full = {**os.environ, **(env or {})}
    if "GPUSCALE_PAUSE_AT" not in (env or {}):
        full.pop("GPUSCALE_PAUSE_AT", None)
    with output.open("ab") as sink:
        return subprocess.Popen(
            [sys.executable, "-c", LAUNCH, "scale", "--config", str(config), *args],
            env=full,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )


def wait_for(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)
