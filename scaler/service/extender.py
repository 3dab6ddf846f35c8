"""The extender verbs over the live cluster: filter, prioritize, bind (see `scheduling`);
pods that defragmentation moved are steered to their planned nodes (see `steering`)."""

from __future__ import annotations

from kubernetes import client as k8s

from predictor.foundation.errors import InputError
from predictor.telemetry.kube_objects import read_pod
from scaler.kube.errors import KubeError, kube_call
from scaler.kube.moves import read_moves
from scaler.kube.objects import parse_taint, pod_job, taint_text
from scaler.placement import Job, Placement
from scaler.service.cluster import LiveCluster
from scaler.service.models import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    HostPriority,
    KubeNodeList,
    KubePod,
)
from scaler.service.scheduling import filter_nodes, place_on, rank
from scaler.service.steering import (
    Steer,
    Steering,
    planned_placement,
    steer_filter,
    steer_scores,
)


class Extender:
    def __init__(self, cluster: LiveCluster, steering: Steering | None = None) -> None:
        self.cluster = cluster
        self.steering = steering or Steering()

    def _steer(self, pod: KubePod, job: Job, given: KubeNodeList | None) -> Steer | None:
        """The planned move `pod` follows, if defragmentation moved it (call with the
        cluster's lock held). Nodes the scheduler sent carry their notes as they are now;
        the others as last listed."""
        names = self.cluster.names
        moves = dict(self.cluster.planned_moves())
        for node in given.items if given is not None else ():
            moves[node.metadata.name] = tuple(read_moves(node.metadata.annotations, names))
        key = pod.metadata.uid or f"{pod.metadata.namespace}/{pod.metadata.name}"
        return self.steering.steer(read_pod(pod, names), job, moves, key)

    def _job_and_candidates(self, args: ExtenderArgs) -> tuple[Job, list[str]]:
        cluster = self.cluster
        if args.Nodes is not None:
            try:
                cluster.upsert_nodes(args.Nodes.items)
            except ValueError as exc:  # a node the model cannot take (its MIG layout, size)
                raise InputError(str(exc), column="Nodes") from None
            candidates = [n.metadata.name for n in args.Nodes.items]
            taints = {taint_text(t) for n in args.Nodes.items for t in n.spec.taints}
        else:
            candidates = list(args.NodeNames or [])
            state = cluster.state()
            specs = [] if state is None else state.taints
            taints = {t for node_taints in specs for t in node_taints}
        cluster.remember_pod(args.Pod)
        job = pod_job(args.Pod, cluster.names, [parse_taint(t) for t in sorted(taints)])
        return job, candidates

    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        job, candidates = self._job_and_candidates(args)
        with self.cluster.lock:
            state = self.cluster.state()
            if state is None:
                return ExtenderFilterResult(Error="gpuscale knows no nodes yet")
            found = filter_nodes(state, job, candidates)
            steer = self._steer(args.Pod, job, args.Nodes)
        if steer is not None:
            hold_s = self.cluster.system.config.defrag.hold_s
            found = steer_filter(found, steer, self.steering.now(), hold_s)
        result = ExtenderFilterResult(
            FailedNodes=found.failed, FailedAndUnresolvableNodes=found.unresolvable
        )
        if args.Nodes is not None:
            passing = set(found.passing)
            listing = args.Nodes.model_dump(mode="json", by_alias=True, exclude_unset=True)
            listing["items"] = [
                n.model_dump(mode="json", by_alias=True, exclude_unset=True)
                for n in args.Nodes.items
                if n.metadata.name in passing
            ]
            result.Nodes = listing
        else:
            result.NodeNames = found.passing
        return result

    def prioritize(self, args: ExtenderArgs) -> list[HostPriority]:
        job, candidates = self._job_and_candidates(args)
        with self.cluster.lock:
            state = self.cluster.state()
            if state is None:
                return [HostPriority(Host=name, Score=0) for name in candidates]
            scores = rank(state, job, self.cluster.policy, candidates)
            steer = self._steer(args.Pod, job, args.Nodes)
        if steer is not None:
            scores = steer_scores(scores, steer)
        return [HostPriority(Host=name, Score=score) for name, score in scores]

    def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        cluster = self.cluster
        pod = cluster.pod(args.PodUID, args.PodNamespace, args.PodName)
        if pod is None:
            return ExtenderBindingResult(
                Error=f"pod {args.PodNamespace}/{args.PodName} is unknown (not filtered here"
                " and not on the API server)"
            )
        with cluster.lock:
            state = cluster.state()
            if state is None:
                return ExtenderBindingResult(Error="gpuscale knows no nodes yet")
            taints = [parse_taint(t) for t in sorted({t for ts in state.taints for t in ts})]
            try:
                job = pod_job(pod, cluster.names, taints)
            except InputError as exc:  # a bad GPU-share annotation: the scheduler is told
                where = f"pod {args.PodNamespace}/{args.PodName}"
                return ExtenderBindingResult(Error=f"{where}: {exc.reason}")
            # A bind the scheduler retries: decided afresh, but what the first one holds is
            # given back if the retry cannot be placed (else its GPUs would read as free and
            # a rebuild would hand them back to it over whoever took them meanwhile).
            held = state.release(job.id) if job.id in state.jobs else None
            steer = self._steer(pod, job, None)
            planned = (
                None
                if steer is None
                else planned_placement(state, job, steer, args.Node, cluster.policy.name)
            )
            decided = planned or place_on(state, job, cluster.policy, args.Node)
            if not isinstance(decided, Placement):
                if held is not None:
                    state.bind(held.job, held.node, held.gpus, held.since_s)
                return ExtenderBindingResult(Error=f"cannot bind to {args.Node}: {decided.reason}")
            cluster.record_bind(job, decided)
        if cluster.system.kube is not None:
            try:
                self._bind_in_kubernetes(cluster.system.kube, args, decided)
            except KubeError as exc:
                cluster.release(job.id)
                return ExtenderBindingResult(Error=str(exc))
        return ExtenderBindingResult()

    def _bind_in_kubernetes(
        self, api: k8s.ApiClient, args: ExtenderBindingArgs, placement: Placement
    ) -> None:
        """Record the GPU indices on the pod, then bind it (the binding subresource)."""
        core = k8s.CoreV1Api(api)
        name, ns = args.PodName, args.PodNamespace
        gpus = ",".join(str(g) for g in placement.gpus)
        meta = {"name": name, "namespace": ns}
        if args.PodUID:
            meta["uid"] = args.PodUID  # the API server binds only the pod the scheduler saw
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": args.Node},
        }
        what = f"bind {ns}/{name} to {args.Node}"
        if gpus:
            patch = {"metadata": {"annotations": {self.cluster.names.gpus_annotation: gpus}}}
            kube_call(what, lambda: core.patch_namespaced_pod(name, ns, patch))
        # The client cannot read a Binding's empty answer back; take it raw.
        kube_call(
            what, lambda: core.create_namespaced_pod_binding(name, ns, body, _preload_content=False)
        )
