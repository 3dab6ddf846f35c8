"""Karpenter's static provisioning, played against the fake API server for tests.

On every write of a static NodePool (one with `spec.replicas`) its NodeClaims are made or
deleted to match at once, as Karpenter's static provisioning and deprovisioning
controllers do (kubernetes-sigs/karpenter, pkg/controllers/static): a missing NodeClaim is
launched (a providerID, the Launched condition), a surplus one deleted (unready ones
first, then the newest). `advance(seconds)` moves the test's clock: a NodeClaim whose
boot time has passed turns Ready and its node registers, labelled with the NodePool and
the NodePool template's labels. A NodeClaim deleted takes its node with it (Karpenter's
termination: drain, then the instance goes). `limit(pool, n)` plays a cloud out of
capacity: at most n NodeClaims of the NodePool exist, as when Karpenter deletes each whose
launch fails on insufficient capacity and tries again later; lifted (None), the missing
ones are made.
"""

from __future__ import annotations

import itertools
from typing import Any

from fake_kube import FakeKube

NODE_POOL_LABEL = "karpenter.sh/nodepool"
ZONE = "us-east-1a"


def node_pool(name: str, replicas: int, labels: dict[str, str] | None = None, **spec: Any) -> dict:
    template = {
        "metadata": {"labels": labels or {}},
        "spec": {
            "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "gpu"}
        },
    }
    return {"metadata": {"name": name}, "spec": {"template": template, "replicas": replicas} | spec}


class FakeKarpenter:
    def __init__(self, fake: FakeKube, boot_s: float, gpus: int = 8) -> None:
        self.fake = fake
        self.boot_s = boot_s
        self.gpus = gpus
        self.clock = 0.0
        self.launched: dict[str, float] = {}  # NodeClaim -> clock at launch
        self.capacity: dict[str, int] = {}  # NodePool -> most NodeClaims the cloud can run
        self._ids = itertools.count()
        fake.on_write.append(self._react)

    def _react(self, type_: str, plural: str, obj: dict[str, Any]) -> None:
        if plural == "nodepools" and type_ != "DELETED" and "replicas" in obj["spec"]:
            self._reconcile(obj)
        if plural == "nodeclaims" and type_ == "DELETED":
            node = obj.get("status", {}).get("nodeName")
            if node and any(n["metadata"]["name"] == node for n in self.fake.objects("nodes")):
                self.fake.delete("nodes", node)

    def claims(self, pool: str) -> list[dict[str, Any]]:
        return [
            c
            for c in self.fake.objects("nodeclaims")
            if c["metadata"]["labels"].get(NODE_POOL_LABEL) == pool
        ]

    def limit(self, pool: str, nodes: int | None) -> None:
        if nodes is None:
            self.capacity.pop(pool, None)
        else:
            self.capacity[pool] = nodes
        self._reconcile(self.fake.get("nodepools", pool))

    def _reconcile(self, pool: dict[str, Any]) -> None:
        name = pool["metadata"]["name"]
        claims = self.claims(name)
        wanted = int(pool["spec"]["replicas"])
        launchable = min(wanted, self.capacity.get(name, wanted))
        for _ in range(launchable - len(claims)):
            i = next(self._ids)
            claim = f"{name}-{i:05x}"
            self.fake.create(
                "nodeclaims",
                {
                    "metadata": {"name": claim, "labels": {NODE_POOL_LABEL: name}},
                    "spec": {"nodeClassRef": pool["spec"]["template"]["spec"]["nodeClassRef"]},
                    "status": {
                        "providerID": f"aws:///{ZONE}/i-{i:08x}",
                        "conditions": [{"type": "Launched", "status": "True"}],
                    },
                },
            )
            self.launched[claim] = self.clock
        if len(claims) > wanted:
            ready = {c["metadata"]["name"]: self._ready(c) for c in claims}
            order = sorted(
                claims,
                key=lambda c: (ready[c["metadata"]["name"]], -self.launched[c["metadata"]["name"]]),
            )
            for claim in order[: len(claims) - wanted]:
                self.fake.delete("nodeclaims", claim["metadata"]["name"])

    @staticmethod
    def _ready(claim: dict[str, Any]) -> bool:
        return any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in claim.get("status", {}).get("conditions", [])
        )

    def advance(self, seconds: float) -> None:
        self.clock += seconds
        for claim in self.fake.objects("nodeclaims"):
            name = claim["metadata"]["name"]
            if self._ready(claim) or self.clock - self.launched[name] < self.boot_s:
                continue
            pool = self.fake.get("nodepools", claim["metadata"]["labels"][NODE_POOL_LABEL])
            node = f"ip-{name}.ec2.internal"
            labels = {NODE_POOL_LABEL: pool["metadata"]["name"]}
            labels |= pool["spec"]["template"]["metadata"].get("labels") or {}
            self.fake.create(
                "nodes",
                {
                    "metadata": {"name": node, "labels": labels},
                    "spec": {"providerID": claim["status"]["providerID"]},
                    "status": {
                        "allocatable": {
                            "cpu": "96",
                            "memory": "1Ti",
                            "nvidia.com/gpu": str(self.gpus),
                        },
                        "conditions": [{"type": "Ready", "status": "True"}],
                    },
                },
            )
            conditions = [*claim["status"]["conditions"], {"type": "Ready", "status": "True"}]
            self.fake.patch(
                "nodeclaims", name, {"status": {"nodeName": node, "conditions": conditions}}
            )
