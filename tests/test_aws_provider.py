"""The AWS provider against moto in server mode (boto3 with endpoint_url, nothing mocked):
the provider contract for Auto Scaling groups and for EKS managed node groups, then what is
particular to AWS: the chosen instance goes and the desired capacity drops by exactly one,
throttling and busy groups are retried, errors carry no credentials, provider IDs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from provider_contract import ContractCloud, ProviderContract, contract_pools

from scaler.cluster.pools import NodePool
from scaler.providers.aws import AwsCloud, AwsPoolBinding, AwsSettings, provider_id, scrub
from scaler.providers.base import ProviderError

pytestmark = pytest.mark.integration

ZONE = "us-east-1a"
ROLE = "arn:aws:iam::123456789012:role/nodes"


@pytest.fixture(scope="module")
def proxy(moto: Any) -> Iterator[Any]:
    from moto_fixture import AwsProxy

    proxy = AwsProxy(moto.url).start()
    yield proxy
    proxy.stop()


@dataclass
class Aws:
    """Builds fresh AWS infrastructure per test (unique names, one shared moto server)."""

    proxy: Any
    prefix: str
    session: Any
    clients: dict[str, Any]
    cluster: str

    def client(self, service: str) -> Any:
        """A client straight to moto, past the proxy: the test's own view of the cloud."""
        if service not in self.clients:
            self.clients[service] = self.session.client(service, endpoint_url=self.proxy.upstream)
        return self.clients[service]

    def asg(self, name: str, *, min_size: int = 0, max_size: int = 10, desired: int = 0) -> str:
        full = f"{self.prefix}-{name}"
        self.client("ec2").create_launch_template(
            LaunchTemplateName=full,
            LaunchTemplateData={"ImageId": "ami-12345678", "InstanceType": "p4d.24xlarge"},
        )
        self.client("autoscaling").create_auto_scaling_group(
            AutoScalingGroupName=full,
            MinSize=min_size,
            MaxSize=max_size,
            DesiredCapacity=desired,
            LaunchTemplate={"LaunchTemplateName": full, "Version": "$Latest"},
            AvailabilityZones=[ZONE],
        )
        return full

    def nodegroup(self, name: str) -> tuple[str, str]:
        """An EKS managed node group with the Auto Scaling group EKS would have made."""
        cluster, nodegroup = self.cluster, f"{self.prefix}-{name}"
        made = self.client("eks").create_nodegroup(
            clusterName=cluster,
            nodegroupName=nodegroup,
            nodeRole=ROLE,
            subnets=["subnet-1"],
            scalingConfig={"minSize": 0, "maxSize": 10, "desiredSize": 0},
        )["nodegroup"]
        (asg,) = made["resources"]["autoScalingGroups"]
        self.client("ec2").create_launch_template(
            LaunchTemplateName=asg["name"],
            LaunchTemplateData={"ImageId": "ami-12345678", "InstanceType": "g4dn.12xlarge"},
        )
        self.client("autoscaling").create_auto_scaling_group(
            AutoScalingGroupName=asg["name"],
            MinSize=0,
            MaxSize=10,
            DesiredCapacity=0,
            LaunchTemplate={"LaunchTemplateName": asg["name"], "Version": "$Latest"},
            AvailabilityZones=[ZONE],
        )
        return cluster, nodegroup

    def cloud(
        self, pools: Sequence[NodePool], bindings: Sequence[AwsPoolBinding], **settings: Any
    ) -> AwsCloud:
        from moto_fixture import REGION

        settings.setdefault("busy_backoff_s", 0.01)
        config = AwsSettings(
            region=REGION, endpoint_url=self.proxy.url, bindings=tuple(bindings), **settings
        )
        return AwsCloud(pools, config, session=self.session)

    def describe(self, asg: str) -> dict[str, Any]:
        answer = self.client("autoscaling").describe_auto_scaling_groups(
            AutoScalingGroupNames=[asg]
        )
        return answer["AutoScalingGroups"][0]


@pytest.fixture(scope="module")
def shared(proxy: Any) -> tuple[Any, dict[str, Any], str]:
    """One boto3 session (it parses the service models once) and one EKS cluster (its node
    groups are fresh per test)."""
    from moto_fixture import session

    boto = session()
    eks = boto.client("eks", endpoint_url=proxy.upstream)
    eks.create_cluster(name="gpu", roleArn=ROLE, resourcesVpcConfig={"subnetIds": []})
    return boto, {"eks": eks}, "gpu"


@pytest.fixture
def aws(proxy: Any, shared: tuple[Any, dict[str, Any], str]) -> Aws:
    proxy.reset()
    return Aws(proxy, f"t{uuid.uuid4().hex[:8]}", *shared)


def asg_cloud(aws: Aws, pools: Sequence[NodePool], **settings: Any) -> AwsCloud:
    bindings = [AwsPoolBinding(pool=p.name, auto_scaling_group=aws.asg(p.name)) for p in pools]
    return aws.cloud(pools, bindings, **settings)


def eks_cloud(aws: Aws, pools: Sequence[NodePool], **settings: Any) -> AwsCloud:
    bindings = []
    for pool in pools:
        cluster, nodegroup = aws.nodegroup(pool.name)
        bindings.append(
            AwsPoolBinding(pool=pool.name, eks_cluster=cluster, eks_nodegroup=nodegroup)
        )
    return aws.cloud(pools, bindings, **settings)


def _no_wait(seconds: float) -> None:
    """moto's instances are in service as soon as they are launched."""


def contract_cloud(aws: Aws, cloud: AwsCloud) -> ContractCloud:
    """The contract's view of `cloud`, its capacity limits played by the proxy on each
    pool's Auto Scaling group (an EKS node group's is the one EKS made for it)."""

    def asg_of(pool: str) -> str:
        (group,) = [g for g in cloud.node_groups() if g.id() == pool]
        b = group.binding
        if b.auto_scaling_group is not None:
            return b.auto_scaling_group
        made = aws.client("eks").describe_nodegroup(
            clusterName=b.eks_cluster, nodegroupName=b.eks_nodegroup
        )
        (asg,) = made["nodegroup"]["resources"]["autoScalingGroups"]
        return str(asg["name"])

    return ContractCloud(
        provider=cloud,
        wait=_no_wait,
        limit=lambda pool, nodes: aws.proxy.limit(asg_of(pool), nodes),
    )


class TestAutoScalingContract(ProviderContract):
    @pytest.fixture(autouse=True)
    def _infrastructure(self, aws: Aws) -> None:
        self.aws = aws

    def make(self, pools: Sequence[NodePool]) -> ContractCloud:
        return contract_cloud(self.aws, asg_cloud(self.aws, pools))


class TestEksNodeGroupContract(ProviderContract):
    @pytest.fixture(autouse=True)
    def _infrastructure(self, aws: Aws) -> None:
        self.aws = aws

    def make(self, pools: Sequence[NodePool]) -> ContractCloud:
        return contract_cloud(self.aws, eks_cloud(self.aws, pools))


def a100(max_size: int = 6) -> NodePool:
    return contract_pools()[0].model_copy(update={"max_size": max_size})


def test_the_chosen_instance_goes_and_desired_drops_by_exactly_one(aws: Aws) -> None:
    cloud = asg_cloud(aws, [a100()])
    (group,) = cloud.node_groups()
    group.increase_size(4)
    asg = group.binding.auto_scaling_group
    before = sorted(i["InstanceId"] for i in aws.describe(asg)["Instances"])
    chosen = before[2]
    group.delete_nodes([chosen])
    after = aws.describe(asg)
    assert after["DesiredCapacity"] == 3
    assert sorted(i["InstanceId"] for i in after["Instances"]) == [i for i in before if i != chosen]
    (reservation,) = aws.client("ec2").describe_instances(InstanceIds=[chosen])["Reservations"]
    assert reservation["Instances"][0]["State"]["Name"] in ("shutting-down", "terminated")
    assert aws.proxy.calls("TerminateInstanceInAutoScalingGroup") == 1
    assert aws.proxy.calls("SetDesiredCapacity") == 1  # only the increase set a size
    assert group.target_size() == 3 and len(group.nodes()) == 3


def test_a_drained_kubernetes_node_is_the_instance_that_goes(aws: Aws) -> None:
    """Kubernetes names the node, its providerID names the instance, and exactly that
    instance is terminated once its pods have been evicted."""
    from fake_kube import FakeKube, disruption_budget_policy
    from kubernetes import client as k8s

    from scaler.kube.nodes import DrainSettings, NodeRemoval, RemovalStatus

    cloud = asg_cloud(aws, [a100()])
    (group,) = cloud.node_groups()
    group.increase_size(3)
    fake = FakeKube().start()
    try:
        fake.eviction_policy = disruption_budget_policy(fake)
        instances = sorted(n.name for n in group.nodes())
        for i, instance in enumerate(instances):
            spec = {"providerID": cloud.provider_id(instance)}
            fake.create("nodes", {"metadata": {"name": f"ip-10-0-0-{i}"}, "spec": spec})
        containers = [{"name": "main", "image": "busybox"}]
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "job", "uid": "u"}
        pod = {
            "metadata": {"name": "job", "ownerReferences": [owner | {"controller": True}]},
            "spec": {"nodeName": "ip-10-0-0-1", "containers": containers},
        }
        fake.create("pods", {**pod, "status": {"phase": "Running"}})
        api = k8s.ApiClient(k8s.Configuration(host=fake.url))
        outcome = NodeRemoval(api, cloud, DrainSettings(timeout_s=1, poll_s=0.02)).remove(
            "ip-10-0-0-1"
        )
    finally:
        fake.stop()
    assert outcome.status is RemovalStatus.REMOVED, outcome.reason
    assert outcome.cloud_node == instances[1]
    assert fake.objects("pods") == []
    after = aws.describe(group.binding.auto_scaling_group)
    assert after["DesiredCapacity"] == 2
    assert sorted(i["InstanceId"] for i in after["Instances"]) == [instances[0], instances[2]]


def test_bounds_are_the_tighter_of_pool_and_group(aws: Aws) -> None:
    pool = a100(max_size=6).model_copy(update={"min_size": 1})
    name = aws.asg("tight", min_size=0, max_size=3, desired=1)
    cloud = aws.cloud([pool], [AwsPoolBinding(pool=pool.name, auto_scaling_group=name)])
    (group,) = cloud.node_groups()
    assert (group.min_size(), group.max_size(), group.target_size()) == (1, 3, 1)


def test_growth_past_the_groups_max_size_stops_there_and_says_why(
    aws: Aws, caplog: pytest.LogCaptureFixture
) -> None:
    """The pool allows 6, the Auto Scaling group 3: asked for 1 + 5, the group grows to
    3 (it used to refuse the whole growth and stay at 1) and the log names the bound."""
    pool = a100(max_size=6).model_copy(update={"min_size": 1})
    name = aws.asg("tight", min_size=0, max_size=3, desired=1)
    cloud = aws.cloud([pool], [AwsPoolBinding(pool=pool.name, auto_scaling_group=name)])
    (group,) = cloud.node_groups()
    with caplog.at_level("WARNING", logger="scaler.providers.pool_group"):
        group.increase_size(5)
    assert aws.describe(name)["DesiredCapacity"] == 3
    assert group.target_size() == 3
    assert f"a100: 6 nodes asked, target 3: max 3 (the MaxSize of Auto Scaling group {name})" in (
        caplog.messages
    )


def test_growth_is_set_from_the_target_seen_not_added_to_a_raise_since(aws: Aws) -> None:
    """The pass read 1 and wants 3 (+2); someone raises the group to 2 before the change
    lands: the group goes to 3, not 2 + 2. Raised past 3 instead, it is left there (a
    lower desired capacity would let AWS terminate instances of its choosing)."""
    pool = a100(max_size=6)
    name = aws.asg("raced", max_size=10, desired=1)
    cloud = aws.cloud([pool], [AwsPoolBinding(pool=pool.name, auto_scaling_group=name)])
    cloud.refresh()
    (group,) = cloud.node_groups()
    scaling = aws.client("autoscaling")
    scaling.set_desired_capacity(AutoScalingGroupName=name, DesiredCapacity=2)
    group.increase_size(2)
    assert aws.describe(name)["DesiredCapacity"] == 3
    cloud.refresh()
    scaling.set_desired_capacity(AutoScalingGroupName=name, DesiredCapacity=5)
    group.increase_size(1)
    assert aws.describe(name)["DesiredCapacity"] == 5
    assert group.target_size() == 5


def test_throttling_and_server_errors_are_retried(aws: Aws) -> None:
    from moto_fixture import Fault

    cloud = asg_cloud(aws, [a100()])
    aws.proxy.faults += [
        Fault("DescribeAutoScalingGroups", "Throttling", 400),
        Fault("SetDesiredCapacity", "Throttling", 400),
        Fault("DescribeInstances", "RequestLimitExceeded", 503),
        Fault("TerminateInstanceInAutoScalingGroup", "InternalFailure", 500, message="oops"),
    ]
    (group,) = cloud.node_groups()
    group.increase_size(2)
    victim = group.nodes()[0].name
    group.delete_nodes([victim])
    assert sorted(aws.proxy.seen.failed) == sorted(f.action for f in aws.proxy.faults)
    assert aws.describe(group.binding.auto_scaling_group)["DesiredCapacity"] == 1
    assert victim not in {n.name for n in group.nodes()} and len(group.nodes()) == 1


def test_a_busy_group_is_retried_with_backoff(aws: Aws) -> None:
    from moto_fixture import Fault

    cloud = asg_cloud(aws, [a100()])
    (group,) = cloud.node_groups()
    group.increase_size(2)
    aws.proxy.faults.append(
        Fault("TerminateInstanceInAutoScalingGroup", "ScalingActivityInProgress", 400, times=2)
    )
    group.delete_nodes([group.nodes()[1].name])
    assert aws.proxy.calls("TerminateInstanceInAutoScalingGroup") == 3
    assert aws.describe(group.binding.auto_scaling_group)["DesiredCapacity"] == 1


def test_persistent_throttling_becomes_a_provider_error_without_credentials(aws: Aws) -> None:
    from moto_fixture import CREDENTIALS, Fault

    cloud = asg_cloud(aws, [a100()], max_attempts=2)
    (group,) = cloud.node_groups()
    aws.proxy.faults.append(
        Fault(
            "SetDesiredCapacity",
            "Throttling",
            400,
            times=5,
            message="Rate exceeded; {authorization}",
        )
    )
    with pytest.raises(ProviderError) as caught:
        group.increase_size(1)
    message = str(caught.value)
    assert "Throttling" in message and "a100" in message
    assert CREDENTIALS["aws_access_key_id"] not in message
    assert "Signature=" not in message or "Signature=<redacted>" in message
    assert aws.proxy.calls("SetDesiredCapacity") == 2
    assert group.target_size() == 0


def test_scrub_blanks_credential_material() -> None:
    text = (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20240101/us-east-1/ec2/aws4_request, "
        "SignedHeaders=host, Signature=abcdef0123 X-Amz-Security-Token=FQoGZXIvYXdzE "
        "aws_secret_access_key = wJalrXUtnFEMI"
    )
    cleaned = scrub(text)
    for secret in ("AKIAIOSFODNN7EXAMPLE", "abcdef0123", "FQoGZXIvYXdzE", "wJalrXUtnFEMI"):
        assert secret not in cleaned


def test_eks_grows_through_the_node_group_and_shrinks_by_the_chosen_instance(aws: Aws) -> None:
    cloud = eks_cloud(aws, [a100()])
    (group,) = cloud.node_groups()
    eks = aws.client("eks")
    b = group.binding
    group.increase_size(3)
    scaling = eks.describe_nodegroup(clusterName=b.eks_cluster, nodegroupName=b.eks_nodegroup)
    assert scaling["nodegroup"]["scalingConfig"]["desiredSize"] == 3
    assert aws.proxy.calls("UpdateNodegroupConfig") == 1
    assert aws.proxy.calls("SetDesiredCapacity") == 0  # EKS, not gpuscale, sizes the ASG
    names = sorted(n.name for n in group.nodes())
    group.delete_nodes([names[0]])
    scaling = eks.describe_nodegroup(clusterName=b.eks_cluster, nodegroupName=b.eks_nodegroup)
    assert scaling["nodegroup"]["scalingConfig"]["desiredSize"] == 2
    assert sorted(n.name for n in group.nodes()) == names[1:]
    assert aws.proxy.calls("TerminateInstanceInAutoScalingGroup") == 1


def test_eks_throttling_and_update_in_progress_are_retried(aws: Aws) -> None:
    from moto_fixture import Fault

    cloud = eks_cloud(aws, [a100()])
    (group,) = cloud.node_groups()
    aws.proxy.faults += [
        Fault("UpdateNodegroupConfig", "ThrottlingException", 429),
        Fault("UpdateNodegroupConfig", "ResourceInUseException", 409, message="update in progress"),
        Fault("DescribeNodegroup", "ServiceUnavailableException", 503),
    ]
    group.increase_size(2)
    assert aws.proxy.calls("UpdateNodegroupConfig") == 3
    assert group.target_size() == 2 and len(group.nodes()) == 2


def test_nodes_map_to_kubernetes_by_provider_id(aws: Aws) -> None:
    cloud = asg_cloud(aws, [a100()])
    (group,) = cloud.node_groups()
    group.increase_size(2)
    ec2 = aws.client("ec2")
    for node in group.nodes():
        (reservation,) = ec2.describe_instances(InstanceIds=[node.name])["Reservations"]
        zone = reservation["Instances"][0]["Placement"]["AvailabilityZone"]
        assert cloud.provider_id(node.name) == f"aws:///{zone}/{node.name}"
    assert provider_id("eu-west-1b", "i-0abc") == "aws:///eu-west-1b/i-0abc"
    with pytest.raises(ProviderError):
        cloud.provider_id("i-notours")


def test_a_missing_group_is_named(aws: Aws) -> None:
    pool = a100()
    cloud = aws.cloud([pool], [AwsPoolBinding(pool=pool.name, auto_scaling_group="nope")])
    with pytest.raises(ProviderError, match="auto scaling groups not found: nope"):
        cloud.refresh()


@pytest.mark.parametrize(
    "fields",
    [
        {"pool": "a"},
        {"pool": "a", "eks_cluster": "c"},
        {"pool": "a", "auto_scaling_group": "g", "eks_cluster": "c", "eks_nodegroup": "n"},
    ],
)
def test_a_binding_names_exactly_one_backing(fields: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        AwsPoolBinding.model_validate(fields)


def test_pools_must_be_known() -> None:
    settings = AwsSettings(
        region="us-east-1",
        endpoint_url="http://127.0.0.1:9",
        bindings=(AwsPoolBinding(pool="other", auto_scaling_group="g"),),
    )
    with pytest.raises(ProviderError, match="other"):
        AwsCloud([a100()], settings)
