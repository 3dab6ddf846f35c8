"""The deploy/ artefacts: the Helm chart renders to valid Kubernetes objects, its RBAC grants
exactly the API calls the code makes, its config loads, and the Dockerfile builds a non-root
image whose entry point is the CLI.

The chart is rendered by Helm v4's own engine (helm-python-sdk bundles Helm's Go SDK as a
native library), as `helm template` renders it: values coalesced with values.yaml and checked
against values.schema.json, then every template through Helm's template functions.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from helm_python import _native

from scaler.cluster.pools import NodePool
from scaler.controller.config import LiveConfig, load_live_config
from scaler.kube.permissions import (
    API_CALLS,
    COMPONENT_MODULES,
    CUSTOM_OBJECT_CALLS,
    READ_VERBS,
    READS_ONLY,
    Permission,
    permissions_of,
)

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "gpuscale"
RELEASE = "gpuscale"
NAMESPACE = "gpuscale-system"
KUBE_VERSION = "1.30.0"


# The custom resources a setup needs the cluster to serve, as Helm's capabilities name them.
MONITORING = "monitoring.coreos.com/v1/ServiceMonitor"
CAPACITY_BUFFER = "autoscaling.x-k8s.io/v1beta1/CapacityBuffer"
NODE_POOL = "karpenter.sh/v1/NodePool"
WORKLOAD = "kueue.x-k8s.io/v1beta2/Workload"  # Kueue 0.15 and later


def render(
    values: dict[str, Any] | None = None,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    api_versions: Iterable[str] = (),
) -> dict[str, str]:
    """Template path -> rendered text, as `helm template RELEASE deploy/helm/gpuscale -n
    NAMESPACE --kube-version KUBE_VERSION --api-versions ...` gives it. `values` are what a
    user passes (-f / --set); Helm merges them over values.yaml and checks the result
    against values.schema.json."""
    options = {
        "name": release,
        "namespace": namespace,
        "kube_version": f"v{KUBE_VERSION}",
        "api_versions": list(api_versions),
    }
    with helm.Chart.load(CHART) as chart:
        # Chart.render passes the release name and namespace only; the library's helm_render
        # also takes the Kubernetes version and API versions the capabilities report.
        text = _native.call_string(
            "helm_render", chart._raw(), json.dumps(values or {}), json.dumps(options)
        )
    return json.loads(text)


def manifests(values: dict[str, Any] | None = None, **options: Any) -> list[dict[str, Any]]:
    docs = []
    for path, text in sorted(render(values, **options).items()):
        if path.endswith(".yaml"):
            docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every object that runs pods, by name."""
    kinds = ("Deployment", "StatefulSet", "DaemonSet")
    return {name: w for kind in kinds for name, w in by_kind(docs, kind).items()}


@dataclass(frozen=True)
class Setup:
    """One way a team runs gpuscale (a section of deploy/README.md): the values it sets and
    the custom resources its cluster serves."""

    values: dict[str, Any]
    api_versions: tuple[str, ...] = (MONITORING,)


# A team that lets gpuscale defragment: moves made, MIG repartitions through the MIG manager.
DEFRAG_VALUES: dict[str, Any] = {
    "enabled": True,
    "apply": True,
    "intervalSeconds": 600,
    "goal": "gpus",
    "maxMoves": 3,
    "windowSeconds": 7200,
    "priorityClasses": ["batch-low"],
    "mig": {
        "waitSeconds": 300,
        "configs": {
            "all-1g.10gb": [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}],
        },
    },
}

SETUPS = {
    "nodegroups": Setup({}),
    "nodegroups-no-preposition": Setup({"prePosition": "none"}),
    "autoscaler-placeholders": Setup({"actuator": "autoscaler"}),
    "capacity-buffer": Setup(
        {"actuator": "autoscaler", "prePosition": "capacityBuffer"},
        (MONITORING, CAPACITY_BUFFER),
    ),
    "karpenter": Setup(
        {
            "actuator": "karpenter",
            "karpenter": {"nodePools": [{"pool": "a100", "nodePool": "gpu"}]},
        },
        (MONITORING, NODE_POOL),
    ),
    "capacity-buffer-kueue": Setup(
        {"actuator": "autoscaler", "prePosition": "capacityBuffer", "kueue": {"enabled": True}},
        (MONITORING, CAPACITY_BUFFER, WORKLOAD),
    ),
    "nodegroups-defrag": Setup({"defrag": DEFRAG_VALUES}),
}


@cache
def _rendered(name: str) -> str:
    setup = SETUPS[name]
    return json.dumps(manifests(setup.values, api_versions=setup.api_versions))


def setup_docs(name: str) -> list[dict[str, Any]]:
    return json.loads(_rendered(name))  # a fresh copy: tests may change it


@pytest.fixture
def docs() -> list[dict[str, Any]]:
    return setup_docs("nodegroups")


def live_config(docs: list[dict[str, Any]], tmp_path: Path) -> LiveConfig:
    data = by_kind(docs, "ConfigMap")["gpuscale-config"]["data"]
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    return load_live_config(tmp_path / "live.yaml")


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_chart_renders_to_valid_kubernetes_objects(setup: str) -> None:
    import kubernetes_validate

    docs = setup_docs(setup)
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "Deployment", "StatefulSet", "ServiceMonitor", "Secret"} <= kinds
    assert "ConfigMap" in kinds
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in the Kubernetes API; checked below
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "gpuscale"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    ports = {p["name"] for s in by_kind(docs, "Service").values() for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == ports


def test_services_select_their_pods(docs: list[dict[str, Any]]) -> None:
    pods = {
        name: w["spec"]["template"]["metadata"]["labels"] for name, w in workloads(docs).items()
    }
    for name, workload in workloads(docs).items():
        assert workload["spec"]["selector"]["matchLabels"].items() <= pods[name].items()
    for service in by_kind(docs, "Service").values():
        chosen = [
            n for n, labels in pods.items() if service["spec"]["selector"].items() <= labels.items()
        ]
        assert len(chosen) == 1, service["metadata"]["name"]


def test_the_services_ingress_is_kept_to_the_peers_named_once_enabled() -> None:
    """The extender's verbs take no token (kube-scheduler sends none): the policy is how an
    operator keeps them to the scheduler and the service's clients."""
    import kubernetes_validate

    assert by_kind(manifests(), "NetworkPolicy") == {}
    scheduler = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"component": "kube-scheduler"}},
    }
    docs = manifests({"service": {"networkPolicy": {"enabled": True, "from": [scheduler]}}})
    (policy,) = by_kind(docs, "NetworkPolicy").values()
    kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
    service = workloads(docs)["gpuscale-service"]["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= service.items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [scheduler] and rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    closed = manifests({"service": {"networkPolicy": {"enabled": True}}})
    assert next(iter(by_kind(closed, "NetworkPolicy").values()))["spec"]["ingress"][0]["from"] == []


def test_service_monitor_only_where_the_cluster_serves_its_crd() -> None:
    docs = manifests(api_versions=())
    assert by_kind(docs, "ServiceMonitor") == {}
    assert "no ServiceMonitor was made" in render()["gpuscale/templates/NOTES.txt"]


@pytest.mark.parametrize("setup", sorted(s for s in SETUPS if len(SETUPS[s].api_versions) > 1))
def test_a_setup_fails_to_install_where_its_crd_is_not_served(setup: str) -> None:
    values, apis = SETUPS[setup].values, SETUPS[setup].api_versions
    for missing in apis[1:]:
        with pytest.raises(helm.HelmRenderError, match=f"the cluster serves no {missing}"):
            render(values, api_versions=[a for a in apis if a != missing])


def test_a_kueue_before_0_15_serving_v1beta1_only_is_enough() -> None:
    setup = SETUPS["capacity-buffer-kueue"]
    older = "kueue.x-k8s.io/v1beta1/Workload"
    apis = [older if a == WORKLOAD else a for a in setup.api_versions]
    assert by_kind(manifests(setup.values, api_versions=apis), "ConfigMap")


def test_custom_resource_rules_only_for_the_setup_using_them() -> None:
    def groups(name: str) -> set[str]:
        roles = [d for d in setup_docs(name) if d["kind"] in {"ClusterRole", "Role"}]
        return {g for role in roles for rule in role["rules"] for g in rule["apiGroups"]}

    custom = {"autoscaling.x-k8s.io", "karpenter.sh", "kueue.x-k8s.io"}
    assert groups("nodegroups") & custom == set()
    assert groups("capacity-buffer") & custom == {"autoscaling.x-k8s.io"}
    assert groups("karpenter") & custom == {"karpenter.sh"}
    assert groups("capacity-buffer-kueue") & custom == {"autoscaling.x-k8s.io", "kueue.x-k8s.io"}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_every_setup_lets_the_scaler_and_the_service_read_cron_jobs(setup: str) -> None:
    """Scheduled jobs are known demand in every setup: the loop's cluster cache and its
    collector watch the CronJobs; /v1/plan reads them as the loop does, through the
    service's cache. Nothing more: gpuscale never writes a CronJob."""
    docs = setup_docs(setup)

    def cron_job_verbs(name: str) -> set[str]:
        role = by_kind(docs, "ClusterRole")[name]
        return {
            verb
            for rule in role["rules"]
            if "batch" in rule["apiGroups"] and "cronjobs" in rule["resources"]
            for verb in rule["verbs"]
        }

    assert cron_job_verbs("gpuscale-scaler") == {"list", "watch"}
    assert cron_job_verbs("gpuscale-service") == {"list", "watch"}
    scan = code_calls()
    assert "+watch" in scan["predictor/telemetry/scheduled_jobs.py"]  # through its informer
    assert {"+watch", "list_cron_job_for_all_namespaces"} <= scan[
        "predictor/telemetry/watch_cache.py"
    ]
    assert "list_cron_job_for_all_namespaces" in scan["scaler/kube/cronjobs.py"]  # no cache


def test_validator_rejects_a_broken_manifest(docs: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    broken = by_kind(docs, "StatefulSet")["gpuscale-scaler"]
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


def test_helm_lint_finds_nothing_to_fix() -> None:
    report = helm.lint(CHART, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    # Severity 1 is advice (an icon for a chart repository); 2 and up are warnings and errors.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"actuator": "fargate"}, "/actuator"),
        ({"prePosition": True}, "/prePosition"),
        ({"scaler": {"replicas": "two"}}, "/scaler/replicas"),
        (
            {"pools": [{"name": "a100", "gpu_model": "A100", "gpus_per_node": 0}]},
            "/pools/0/gpus_per_node",
        ),
        ({"service": {"port": 80_000}}, "/service/port"),
        ({"sevice": {"port": 8080}}, "'sevice'"),
        ({"prePosition": "capacityBuffer"}, "/actuator"),  # only an autoscaler reads buffers
        ({"actuator": "karpenter"}, "/karpenter/nodePools"),
    ],
)
def test_values_schema_refuses_a_bad_value_naming_it(values: dict[str, Any], named: str) -> None:
    with pytest.raises(helm.HelmValuesError) as refused:
        render(values)
    assert named in str(refused.value)


def test_values_schema_describes_a_pool_as_the_code_reads_it() -> None:
    def untitled(schema: Any) -> Any:
        if isinstance(schema, dict):
            return {k: untitled(v) for k, v in schema.items() if k != "title"}
        return [untitled(v) for v in schema] if isinstance(schema, list) else schema

    schema = json.loads((CHART / "values.schema.json").read_text())
    want = untitled(NodePool.model_json_schema())
    assert schema["properties"]["pools"]["items"] == want, json.dumps(want, indent=2)


def test_workloads_run_the_cli_hardened(docs: list[dict[str, Any]]) -> None:
    from scaler.cli import app

    commands = {c.name for c in app.registered_commands}
    running = workloads(docs)
    assert set(running) == {"gpuscale-scaler", "gpuscale-service", "gpuscale-collector"}
    for workload in running.values():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert container["args"][0] in commands
            hardened = container["securityContext"]
            assert hardened["allowPrivilegeEscalation"] is False
            assert hardened["readOnlyRootFilesystem"] is True
    assert running["gpuscale-scaler"]["spec"]["replicas"] == 2
    scaler = running["gpuscale-scaler"]["spec"]["template"]["spec"]["containers"][0]
    assert "--apply" in scaler["args"] and "--metrics-port" in scaler["args"]
    env = {e["name"]: e for e in scaler["env"]}
    assert env["GPUSCALE_LEASE__IDENTITY"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.name"
    )
    node = running["gpuscale-collector"]["spec"]["template"]["spec"]
    assert node["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert node["automountServiceAccountToken"] is False


def test_scaler_apply_false_runs_the_loop_as_a_dry_run() -> None:
    """A shadow rollout: the same loop and metrics, without --apply (nothing changed)."""

    def scaler_args(values: dict[str, Any]) -> list[str]:
        workload = by_kind(manifests(values), "StatefulSet")["gpuscale-scaler"]
        return workload["spec"]["template"]["spec"]["containers"][0]["args"]

    acting, shadow = scaler_args({}), scaler_args({"scaler": {"apply": False}})
    assert "--apply" in acting and "--apply" not in shadow
    assert [a for a in acting if a != "--apply"] == shadow
    assert shadow[:3] == ["scale", "--config", "/etc/gpuscale/live.yaml"]
    with pytest.raises(helm.HelmValuesError, match="/scaler/apply"):
        render({"scaler": {"apply": "no"}})


def test_defrag_runs_only_where_enabled_with_its_section_in_the_config(tmp_path: Path) -> None:
    from scaler.cli import app

    for folder in ("default", "defrag"):
        (tmp_path / folder).mkdir()
    assert "gpuscale-defrag" not in by_kind(setup_docs("nodegroups"), "Deployment")
    default = live_config(setup_docs("nodegroups"), tmp_path / "default").defrag
    assert default == LiveConfig.model_fields["defrag"].default  # values.yaml = the code's

    docs = setup_docs("nodegroups-defrag")
    workload = by_kind(docs, "Deployment")["gpuscale-defrag"]["spec"]
    assert workload["replicas"] == 1 and workload["strategy"] == {"type": "Recreate"}
    pod = workload["template"]["spec"]
    assert pod["serviceAccountName"] == "gpuscale-scaler"  # the account granted evictions
    (container,) = pod["containers"]
    assert container["args"][0] in {c.name for c in app.registered_commands}
    args = container["args"]
    assert args[args.index("--every") + 1] == "600" and "--apply" in args
    assert container["securityContext"]["readOnlyRootFilesystem"] is True

    section = live_config(docs, tmp_path / "defrag").defrag
    assert (section.goal, section.max_moves, section.window_s) == ("gpus", 3, 7200.0)
    assert section.priority_classes == ("batch-low",)
    assert section.mig.wait_s == 300.0 and set(section.mig.configs) == {"all-1g.10gb"}
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    assert "defrag" in {e["port"] for e in monitor["spec"]["endpoints"]}

    plan_only = manifests({"defrag": {"enabled": True}}, api_versions=(MONITORING,))
    container = by_kind(plan_only, "Deployment")["gpuscale-defrag"]["spec"]["template"]
    assert "--apply" not in container["spec"]["containers"][0]["args"]


def _state_volume(workload: dict[str, Any]) -> dict[str, Any] | None:
    pod = workload["spec"]["template"]["spec"]
    return {v["name"]: v for v in pod["volumes"]}.get("state")


def test_scaler_and_defrag_state_lives_on_claims_that_outlive_their_pods(tmp_path: Path) -> None:
    docs = setup_docs("nodegroups-defrag")
    live = live_config(docs, tmp_path)
    scaler = by_kind(docs, "StatefulSet")["gpuscale-scaler"]
    assert by_kind(docs, "Deployment").keys() == {"gpuscale-service", "gpuscale-defrag"}
    # One claim per replica, from the template; none in the pod's volumes.
    (claim,) = scaler["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "state"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "5Gi"}},
    }  # no storageClassName: the cluster's default class
    assert _state_volume(scaler) is None
    for container in scaler["spec"]["template"]["spec"]["containers"]:  # loop and collector
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["state"] == str(live.state_dir)
    governing = by_kind(docs, "Service")[scaler["spec"]["serviceName"]]
    assert governing["spec"]["clusterIP"] == "None"
    assert scaler["spec"]["podManagementPolicy"] == "Parallel"

    defrag = by_kind(docs, "Deployment")["gpuscale-defrag"]
    assert defrag["spec"]["strategy"] == {"type": "Recreate"}  # one pod on the claim at a time
    assert _state_volume(defrag) == {
        "name": "state",
        "persistentVolumeClaim": {"claimName": "gpuscale-defrag-state"},
    }
    made = by_kind(docs, "PersistentVolumeClaim")["gpuscale-defrag-state"]
    assert made["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert made["spec"]["resources"] == {"requests": {"storage": "1Gi"}}
    # The service plans from a store of its own: no claim (see its values).
    assert "emptyDir" in _state_volume(by_kind(docs, "Deployment")["gpuscale-service"])


@pytest.mark.parametrize(
    ("persistence", "class_name"), [({"storageClass": "gp3"}, "gp3"), ({"storageClass": "-"}, "")]
)
def test_state_claims_take_the_storage_class(persistence: dict[str, Any], class_name: str) -> None:
    values = {"scaler": {"persistence": persistence}, "defrag": {"enabled": True}}
    values["defrag"]["persistence"] = persistence
    docs = manifests(values)
    (claim,) = by_kind(docs, "StatefulSet")["gpuscale-scaler"]["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == class_name
    made = by_kind(docs, "PersistentVolumeClaim")["gpuscale-defrag-state"]
    assert made["spec"]["storageClassName"] == class_name


def test_state_on_an_existing_claim_or_an_empty_dir_where_persistence_is_off() -> None:
    import kubernetes_validate

    off = {"persistence": {"enabled": False}}
    docs = manifests({"scaler": off, "defrag": {"enabled": True} | off})
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    scaler = by_kind(docs, "StatefulSet")["gpuscale-scaler"]
    assert "volumeClaimTemplates" not in scaler["spec"]
    assert _state_volume(scaler) == {"name": "state", "emptyDir": {}}
    assert _state_volume(by_kind(docs, "Deployment")["gpuscale-defrag"]) == {
        "name": "state",
        "emptyDir": {},
    }
    assert by_kind(docs, "PersistentVolumeClaim") == {}

    mine = {"persistence": {"existingClaim": "mine"}}
    docs = manifests({"scaler": {"replicas": 1} | mine, "defrag": {"enabled": True} | mine})
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    scaler = by_kind(docs, "StatefulSet")["gpuscale-scaler"]
    assert "volumeClaimTemplates" not in scaler["spec"]
    for workload in (scaler, by_kind(docs, "Deployment")["gpuscale-defrag"]):
        assert _state_volume(workload) == {
            "name": "state",
            "persistentVolumeClaim": {"claimName": "mine"},
        }
    assert by_kind(docs, "PersistentVolumeClaim") == {}
    # One ReadWriteOnce claim cannot hold two replicas' stores.
    with pytest.raises(helm.HelmValuesError, match="/scaler/replicas"):
        render({"scaler": mine})


def test_the_scaler_and_the_service_accounts_carry_their_own_annotations() -> None:
    """IRSA: the scaler's role sets the node groups, the service's describes them for
    /v1/nodepools and /v1/plan."""
    role = "eks.amazonaws.com/role-arn"
    docs = manifests(
        {
            "scaler": {"serviceAccount": {"annotations": {role: "arn:aws:iam::1:role/scale"}}},
            "service": {"serviceAccount": {"annotations": {role: "arn:aws:iam::1:role/read"}}},
        }
    )
    accounts = by_kind(docs, "ServiceAccount")
    assert accounts["gpuscale-scaler"]["metadata"]["annotations"] == {
        role: "arn:aws:iam::1:role/scale"
    }
    assert accounts["gpuscale-service"]["metadata"]["annotations"] == {
        role: "arn:aws:iam::1:role/read"
    }
    service = by_kind(docs, "Deployment")["gpuscale-service"]["spec"]["template"]["spec"]
    assert service["serviceAccountName"] == "gpuscale-service"
    assert (
        "annotations" not in by_kind(manifests(), "ServiceAccount")["gpuscale-service"]["metadata"]
    )
    notes = " ".join(render()["gpuscale/templates/NOTES.txt"].split())
    assert "service.serviceAccount.annotations" in notes
    assert '/v1/plan say "no demand series in the store"' in notes  # what PlanDesk answers


def test_placeholder_priority_class_matches_the_code(docs: list[dict[str, Any]]) -> None:
    from scaler.kube.placeholders import PlaceholderSettings, priority_class

    (made,) = by_kind(docs, "PriorityClass").values()
    expected = priority_class(PlaceholderSettings())
    assert made["metadata"]["name"] == expected["metadata"]["name"] == "gpuscale-placeholder"
    assert made["value"] == expected["value"] == -10
    assert made["preemptionPolicy"] == expected["preemptionPolicy"] == "Never"
    assert by_kind(setup_docs("nodegroups-no-preposition"), "PriorityClass") == {}


def test_config_map_loads_and_the_token_comes_from_the_secret(
    docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    from predictor.telemetry.config import load_config

    live = live_config(docs, tmp_path)
    assert live.lease.namespace == NAMESPACE
    assert live.kubernetes is not None and live.kubernetes.placeholders.namespace == NAMESPACE
    assert load_config(tmp_path / "collector.yaml").kubernetes is not None
    assert load_config(tmp_path / "node-collector.yaml").nvml is not None

    service = by_kind(docs, "Deployment")["gpuscale-service"]["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in service["containers"][0]["volumeMounts"]}
    secret = {v["name"]: v for v in service["volumes"]}["token"]["secret"]["secretName"]
    assert str(live.service.token_file) == f"{mounts['token']}/token"
    assert "token" in by_kind(docs, "Secret")[secret]["stringData"]


# What each setup's live.yaml tells the code: provider kind, pre-positioning, Kueue demand.
READS = {
    "nodegroups": ("aws", "placeholders", False),
    "nodegroups-no-preposition": ("aws", "none", False),
    "autoscaler-placeholders": ("autoscaler", "placeholders", False),
    "capacity-buffer": ("autoscaler", "capacity-buffer", False),
    "karpenter": ("karpenter", "placeholders", False),
    "capacity-buffer-kueue": ("autoscaler", "capacity-buffer", True),
    "nodegroups-defrag": ("aws", "placeholders", False),
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_each_setup_configures_the_code_as_its_values_say(setup: str, tmp_path: Path) -> None:
    from predictor.telemetry.config import load_config

    live = live_config(setup_docs(setup), tmp_path)
    collector = load_config(tmp_path / "collector.yaml").kubernetes
    assert live.kubernetes is not None and collector is not None
    kind, pre_position, kueue = READS[setup]
    assert (live.provider.kind, live.kubernetes.pre_position) == (kind, pre_position)
    assert live.kubernetes.kueue is collector.kueue is kueue
    if kind == "karpenter":
        assert live.provider.karpenter is not None
        assert [(b.pool, b.node_pool) for b in live.provider.karpenter.node_pools] == [
            ("a100", "gpu")
        ]


def test_the_cluster_naming_reaches_the_scaler_and_its_collector(tmp_path: Path) -> None:
    from predictor.telemetry.config import load_config

    names = {"poolLabel": "karpenter.sh/nodepool", "gpuResource": "amd.com/gpu"}
    live = live_config(manifests({"kubernetes": names}), tmp_path)
    collector = load_config(tmp_path / "collector.yaml").kubernetes
    assert live.kubernetes is not None and collector is not None
    for read in (live.kubernetes, collector):
        assert (read.pool_label, read.gpu_resource) == ("karpenter.sh/nodepool", "amd.com/gpu")
    assert live.kubernetes.placeholders.node_pool_label == "karpenter.sh/nodepool"


def test_another_release_and_namespace_name_its_objects_and_config(tmp_path: Path) -> None:
    setup = SETUPS["capacity-buffer"]
    docs = manifests(
        setup.values, release="prod", namespace="ml-infra", api_versions=setup.api_versions
    )
    names = {d["metadata"]["name"] for d in docs}
    assert {"prod-gpuscale-scaler", "prod-gpuscale-config", "prod-gpuscale-token"} <= names
    assert {d["metadata"].get("namespace", "ml-infra") for d in docs} == {"ml-infra"}
    data = by_kind(docs, "ConfigMap")["prod-gpuscale-config"]["data"]
    (tmp_path / "live.yaml").write_text(data["live.yaml"])
    live = load_live_config(tmp_path / "live.yaml")
    assert (live.lease.name, live.lease.namespace) == ("prod-gpuscale-scaler", "ml-infra")
    assert live.kubernetes is not None
    assert live.kubernetes.placeholders.priority_class == "prod-gpuscale-placeholder"
    assert live.kubernetes.placeholders.namespace == "ml-infra"
    assert live.kubernetes.capacity_buffers.namespace == "ml-infra"
    binding = by_kind(docs, "RoleBinding")["prod-gpuscale-scaler"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "prod-gpuscale-scaler", "namespace": "ml-infra"}
    ]


# ------------------------------------------------------------------ RBAC against the code


def _api_methods() -> set[str]:
    from kubernetes import client as k8s

    return {
        name
        for cls in vars(k8s).values()
        if isinstance(cls, type) and cls.__name__.endswith("Api") and cls.__name__ != "ApiClient"
        for name in vars(cls)
        if not name.startswith("_") and not name.endswith("_with_http_info")
    }


def code_calls() -> dict[str, set[str]]:
    """Kubernetes client methods each source module calls or hands to a watch ("+watch"):
    the client's Watch, or the cluster cache's (its `Reflector`, or a kind handed to it
    with `watch_kind`: list, then watch)."""
    methods = _api_methods() - {"get_api_resources", "get_code"}
    found: dict[str, set[str]] = {}
    for package in ("scaler", "predictor"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = {
                n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in methods
            }
            watched = any(
                (isinstance(n, ast.Attribute) and n.attr in ("Watch", "watch_kind"))
                or (isinstance(n, ast.Name) and n.id == "Reflector")
                for n in ast.walk(tree)
            )
            if names:
                rel = path.relative_to(ROOT).as_posix()
                found[rel] = names | ({"+watch"} if watched else set())
    return found


# The modules a component runs only in some setups, and the test on its live.yaml saying
# whether it does: gpuscale cordons and drains the nodes itself only where it sizes the node
# groups; placeholder pods, or CapacityBuffers, only where it pre-positions with them; the
# Karpenter provider only for static NodePools; Kueue's queue only where it is enabled.
def _pre_positions(mode: str) -> Callable[[LiveConfig], bool]:
    return lambda live: live.kubernetes is not None and live.kubernetes.pre_position == mode


RUNS_ONLY_WHEN: dict[str, Callable[[LiveConfig], bool]] = {
    "scaler/kube/nodes.py": lambda live: live.provider.scale_down == "drain",
    "scaler/kube/placeholders.py": _pre_positions("placeholders"),
    "scaler/kube/capacity_buffers.py": _pre_positions("capacity-buffer"),
    "scaler/providers/karpenter.py": lambda live: live.provider.kind == "karpenter",
    "scaler/providers/autoscaler.py": lambda live: live.provider.kind == "autoscaler",
    "scaler/kube/kueue.py": lambda live: live.kubernetes is not None and live.kubernetes.kueue,
    "predictor/telemetry/kueue.py": lambda live: (
        live.kubernetes is not None and live.kubernetes.kueue
    ),
}


def required(
    component: str, calls: dict[str, set[str]], live: LiveConfig | None = None
) -> set[Permission]:
    out: set[Permission] = set()
    for module in COMPONENT_MODULES[component]:
        runs = RUNS_ONLY_WHEN.get(module)
        if live is not None and runs is not None and not runs(live):
            continue
        names = calls.get(module, set())
        reads_only = module in READS_ONLY.get(component, ())
        for name in names - {"+watch"}:
            for p in permissions_of(module, name):
                if reads_only and p.verb not in READ_VERBS:
                    continue
                out.add(p)
                if "+watch" in names and p.verb == "list":
                    out.add(Permission(p.group, p.resource, "watch", p.scope))
    # A verb granted cluster-wide need not be granted again in the namespace.
    cluster = {(p.group, p.resource, p.verb) for p in out if p.scope == "cluster"}
    return {p for p in out if p.scope == "cluster" or (p.group, p.resource, p.verb) not in cluster}


def granted(docs: list[dict[str, Any]], kind: str, name: str, scope: str) -> set[Permission]:
    role = by_kind(docs, kind).get(name)
    if role is None:
        return set()
    return {
        Permission(group, resource, verb, scope)  # type: ignore[arg-type]
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_every_kubernetes_call_in_the_code_is_in_the_permission_table() -> None:
    calls = code_calls()
    assert calls, "the scan found no Kubernetes client calls at all"
    custom = {(m, n) for m, methods in CUSTOM_OBJECT_CALLS.items() for n in methods}
    made = {(m, n) for m, names in calls.items() for n in names - {"+watch"}}
    used = {n for m, n in made - custom}
    assert used - set(API_CALLS) == set(), "add these calls to scaler/kube/permissions.py"
    assert set(API_CALLS) - used == set(), "the table lists calls the code no longer makes"
    assert custom - made == set(), "CUSTOM_OBJECT_CALLS lists calls the code no longer makes"
    owned = {m for modules in COMPONENT_MODULES.values() for m in modules}
    assert set(calls) - owned == set(), "modules calling the API that no component runs"
    assert set(RUNS_ONLY_WHEN) <= owned


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("component", sorted(COMPONENT_MODULES))
def test_rbac_grants_exactly_what_the_code_calls(
    setup: str, component: str, tmp_path: Path
) -> None:
    docs = setup_docs(setup)
    want = required(component, code_calls(), live_config(docs, tmp_path))
    name = f"gpuscale-{component}"
    have = granted(docs, "ClusterRole", name, "cluster") | granted(docs, "Role", name, "namespace")
    assert sorted(have) == sorted(want)
    for binding_kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = by_kind(docs, binding_kind).get(name)
        if name in by_kind(docs, role_kind):
            assert binding is not None and binding["roleRef"]["name"] == name
            assert binding["subjects"] == [
                {"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}
            ]
    accounts = {
        w["spec"]["template"]["spec"]["serviceAccountName"] for w in workloads(docs).values()
    }
    assert name in accounts


def test_rbac_comparison_catches_an_extra_verb(docs: list[dict[str, Any]]) -> None:
    role = by_kind(docs, "ClusterRole")["gpuscale-service"]
    role["rules"].append({"apiGroups": [""], "resources": ["nodes"], "verbs": ["delete"]})
    have = granted(docs, "ClusterRole", "gpuscale-service", "cluster")
    assert have != required("service", code_calls())


# ------------------------------------------------------------------ the container image


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "a continuation line runs off the end"
    return out


def test_dockerfile_is_multi_stage_non_root_with_the_cli_as_entry_point() -> None:
    steps = dockerfile_instructions((ROOT / "deploy" / "Dockerfile").read_text())
    known = {"ARG", "FROM", "ENV", "RUN", "WORKDIR", "COPY", "USER", "EXPOSE", "HEALTHCHECK"}
    assert {word for word, _ in steps} <= known | {"ENTRYPOINT", "CMD"}
    froms = [rest for word, rest in steps if word == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build")
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG" and "=" in rest)
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    assert args["TORCH_VARIANT"] == "cpu" and args["TORCH_VERSION"] == "2.13.0"
    torch = [rest for word, rest in steps if word == "RUN" and "torch==" in rest]
    assert torch and '--index-url "$TORCH_INDEX_URL"' in torch[0]
    final = steps[max(i for i, (word, _) in enumerate(steps) if word == "FROM") :]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    assert json.loads(dict(final)["ENTRYPOINT"]) == ["gpuscale"]
    assert dict(final)["HEALTHCHECK"].startswith("--interval")
    assert any(word == "COPY" and rest.startswith("--from=build") for word, rest in final)
    for word, rest in steps:
        if word == "RUN" and "apt-get install" in rest:
            assert "--no-install-recommends" in rest and "rm -rf /var/lib/apt/lists" in rest
        if word == "RUN" and "pip install" in rest:
            assert all("http" not in token for token in shlex.split(rest.replace(";", " ")))
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ignored[ignored.index("*") :][:1] == ["*"]
    assert {"!predictor/", "!scaler/", "!pyproject.toml"} <= set(ignored)


# ------------------------------------------------------------------ alert rules


def _alert(rules: dict[str, dict[str, Any]], name: str, summary: str, **labels: str) -> dict:
    rule = rules[name]
    annotations = {"summary": summary}
    if "description" in rule["annotations"]:
        annotations["description"] = rule["annotations"]["description"]
    return {"exp_labels": rule["labels"] | labels, "exp_annotations": annotations}


def test_alert_rules_fire_on_the_metrics_the_code_exports(tmp_path: Path) -> None:
    """promtool's rule unit tests: each alert fires on the series that should raise it and
    stays quiet otherwise (placeholder pods are not waiting work; what a replica exports
    while it does not lead counts for nothing)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    source = ROOT / "deploy" / "prometheus" / "alerts.yaml"
    groups = yaml.safe_load(source.read_text())["groups"]
    rules = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    a = partial(_alert, rules)
    gpus = 'kube_pod_container_resource_requests{resource="nvidia_com_gpu",'
    phase = 'kube_pod_status_phase{phase="Pending",'
    leader = 'instance="scaler-0:9100"'
    series = {
        'gpuscale_collector_lag_seconds{source="kubernetes"}': "0+60x90",
        'gpuscale_collector_lag_seconds{source="prometheus"}': "30x90",
        'gpuscale_scaler_actions_total{action="set_target",status="failed"}': "0 0 0 1 1 1",
        'gpuscale_scaler_actions_total{action="set_target",status="done"}': "0+1x90",
        gpus + 'namespace="ml",pod="j"}': "4x90",
        phase + 'namespace="ml",pod="j"}': "1x90",
        gpus + 'namespace="gpuscale-system",pod="p"}': "8x90",
        phase + 'namespace="gpuscale-system",pod="p"}': "1x90",
        f"gpuscale_scaler_leader{{{leader}}}": "1x90",
        f'gpuscale_scaler_demand_gpus{{group="a100",{leader}}}': "100x90",
        f'gpuscale_scaler_forecast_gpus{{group="a100",quantile="0.5",{leader}}}': "50x90",
        f'gpuscale_scaler_demand_gpus{{group="h100",{leader}}}': "40x90",
        f'gpuscale_scaler_forecast_gpus{{group="h100",quantile="0.5",{leader}}}': "41x90",
        'gpuscale_defrag_runs_total{result="move_failed"}': "0 0 0 1 2 2",
        'gpuscale_defrag_runs_total{result="ok"}': "0+1x90",
        # The last pass that planned at t = 0 (Unix time 0), none after it.
        "gpuscale_defrag_last_run_timestamp_seconds": "0x90",
    }
    cases = [
        ("20m", "GpuscaleTelemetryStale", [a("GpuscaleTelemetryStale",
            "gpuscale telemetry from kubernetes is 20m 0s old", source="kubernetes")]),
        ("5m", "GpuscaleScaleActionsFailing", [a("GpuscaleScaleActionsFailing",
            "gpuscale set_target actions failed in the last 30 minutes", action="set_target")]),
        ("60m", "GpuscaleScaleActionsFailing", []),
        ("20m", "GpuscalePodsWaitingForCapacity", [a("GpuscalePodsWaitingForCapacity",
            "4 GPUs requested by pods pending for 15 minutes")]),
        ("80m", "GpuscaleForecastErrorDrift", [a("GpuscaleForecastErrorDrift",
            "gpuscale forecast error for a100 is 50%", group="a100")]),
        ("6m", "GpuscaleDefragFailing", [a("GpuscaleDefragFailing",
            "2 gpuscale defragmentation passes failed in the last hour")]),
        ("70m", "GpuscaleDefragFailing", []),
        ("50m", "GpuscaleDefragStalled", []),
        ("70m", "GpuscaleDefragStalled", [a("GpuscaleDefragStalled",
            "no gpuscale defragmentation pass has planned for an hour")]),
    ]  # fmt: skip
    # A failover at 30m: scaler-0 led, then stands by still exporting its last turn's
    # series (as a replica did before it stopped exporting them); scaler-1 leads, short of
    # nothing, until its own input problems from 51m.
    old, new = 'instance="scaler-0:9100"', 'instance="scaler-1:9100"'
    failover = {
        f"gpuscale_scaler_leader{{{old}}}": "1x29 0x60",
        f"gpuscale_scaler_input_problems{{{old}}}": "2x90",
        f'gpuscale_scaler_demand_gpus{{group="a100",{old}}}': "300x90",
        f'gpuscale_scaler_pool_capacity_gpus{{pool="a100",{old}}}': "160x90",
        f"gpuscale_scaler_leader{{{new}}}": "0x29 1x60",
        f"gpuscale_scaler_input_problems{{{new}}}": "0x50 1x40",
        f'gpuscale_scaler_demand_gpus{{group="a100",{new}}}': "100x90",
        f'gpuscale_scaler_pool_capacity_gpus{{pool="a100",{new}}}': "160x90",
    }
    failover_cases = [
        ("28m", "GpuscaleGpuShortage", [a("GpuscaleGpuShortage",
            "GPU demand exceeds the fleet by 140 GPUs for 15 minutes")]),
        ("70m", "GpuscaleGpuShortage", []),
        ("70m", "GpuscaleScalerInputProblems", []),
        ("85m", "GpuscaleScalerInputProblems", [a("GpuscaleScalerInputProblems",
            "gpuscale has planned on missing or stale telemetry for 30 minutes")]),
    ]  # fmt: skip
    shutil.copy(source, tmp_path / "alerts.yaml")
    test = {
        "rule_files": ["alerts.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in given.items()],
                "alert_rule_test": [
                    {"eval_time": t, "alertname": name, "exp_alerts": exp} for t, name, exp in at
                ],
            }
            for given, at in ((series, cases), (failover, failover_cases))
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    checked = subprocess.run(
        [promtool, "check", "rules", "alerts.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_alert_and_dashboard_count_pending_gpus_as_the_collector_does() -> None:
    """Pending GPUs on the alert and the dashboard are the collector's `pending` query
    (init containers, MIG instances, placeholders by label), not a copy that drifts."""
    from predictor.telemetry.config import pod_gpu_requests

    pending = pod_gpu_requests("Pending")
    groups = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    rules = {r["alert"]: r for g in groups["groups"] for r in g["rules"] if "alert" in r}
    assert rules["GpuscalePodsWaitingForCapacity"]["expr"] == f"({pending}) > 0"
    assert pending in _dashboard_queries()


def test_alerts_and_dashboard_use_only_metrics_the_code_exports() -> None:
    exported = set()
    for path in [*ROOT.joinpath("scaler").rglob("*.py"), *ROOT.joinpath("predictor").rglob("*.py")]:
        for match in re.finditer(
            r'(?:Counter|Gauge|Histogram)\(\s*"(gpuscale_\w+)"', path.read_text()
        ):
            exported.add(match[1])
    assert {"gpuscale_scaler_demand_gpus", "gpuscale_service_requests"} <= exported
    suffixes = ("_total", "_bucket", "_count", "_sum")
    texts = [
        (ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text(),
        (ROOT / "deploy" / "grafana" / "gpuscale-dashboard.json").read_text(),
    ]
    for text in texts:
        for name in set(re.findall(r"\bgpuscale_\w+\b(?!\*)", text)):
            base = next((name.removesuffix(s) for s in suffixes if name.endswith(s)), name)
            assert name in exported or base in exported, name


def _dashboard_queries() -> list[str]:
    def walk(node: Any) -> Iterable[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield from [value] if key == "expr" else walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    text = (ROOT / "deploy" / "grafana" / "gpuscale-dashboard.json").read_text()
    return list(walk(json.loads(text)))


# The scaler's series every replica exports; all others are what the leader decided.
EVERY_REPLICA = {
    "gpuscale_scaler_passes_total",
    "gpuscale_scaler_actions_total",
    "gpuscale_scaler_last_pass_timestamp_seconds",
    "gpuscale_scaler_leader",
}
LEADER_JOIN = re.compile(r"and on \(instance\) \(gpuscale_scaler_leader( offset \S+)? == 1\)")


def test_alerts_and_dashboard_read_decisions_from_the_leader_only() -> None:
    """Each read of what a pass decided is joined on the replica that leads, so that an
    ex-leader's last values (or a leader's whose lease lapsed mid-pass) count for nothing."""
    from scaler.controller.metrics import LoopMetrics

    assert "gpuscale_scaler_leader" in {m.name for m in LoopMetrics().registry.collect()}
    groups = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    queries = [r["expr"] for g in groups["groups"] for r in g["rules"]] + _dashboard_queries()
    joined = 0
    for query in queries:
        decided = set(re.findall(r"\bgpuscale_scaler_\w+", query)) - EVERY_REPLICA
        reads = sum(len(re.findall(rf"\b{name}\b", query)) for name in decided)
        assert len(LEADER_JOIN.findall(query)) == reads, query
        joined += reads
    assert joined >= 10  # the scan found the decision gauges at all


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    rules = [
        {"record": f"dashboard:query_{i}", "expr": q.replace("$step", "10m")}
        for i, q in enumerate(_dashboard_queries())
    ]
    (tmp_path / "dashboard.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})
    )
    checked = subprocess.run(
        [promtool, "check", "rules", "dashboard.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
