"""Repartitioning MIG GPUs for the pending MIG jobs: a defragmentation action.

A MIG job that finds no free instance of its profile may still fit once an idle GPU is
partitioned anew (the GPU operator's mig-manager applies a new layout; only a GPU no job
uses may be repartitioned, so no running job is touched). The plan, on a scratch copy:

1. the pending MIG jobs, largest profile first, are placed on the free instances there
   are (those need no change);
2. each one left gets its instances on an idle MIG GPU of a family that offers its
   profile, on a node that admits it and has its CPU and memory: a GPU this plan already
   repartitions where the profile still fits first, else the idle GPU whose layout loses
   least (slices of its current instances that the new one drops), ties by node name and
   GPU. The new layout is the instances the plan gives that GPU's jobs, then as many of
   its current instances (largest first) as still fit, so the GPU keeps serving what it
   served where it can;
3. at most `max_gpus` GPUs change; a job no GPU can serve is listed with the reason.

`apply_repartition` applies the plan's layouts to a state (what the engine sees once
mig-manager has applied them); the jobs are then placed as any job is.

A cluster cannot be given any layout, though: the GPU operator's MIG manager applies the
named configs of its mig-parted file, a whole node at a time (`scaler.cluster.mig_parted`).
`plan_named_repartition` plans with those (what `gpuscale defrag` applies):

1. the pending MIG jobs, largest first, take the free instances there are;
2. for those left, each node's options (the configs that change some of its MIG GPUs and
   nothing else) are tried where every GPU an option clears is idle (no job on any of its
   instances: mig-parted destroys them all) and the node is not left alone for a reason
   the caller gives (`blocked`, `busy`); the option that serves the most slices of the
   jobs left wins, ties to the one clearing fewest GPUs, then by node and config name; its
   jobs are bound on the new instances and the next is chosen, at most `max_nodes`;
3. options that would have served jobs but are refused (a GPU in use, a node left alone)
   are listed with the reason, the best per node, beside the jobs nothing serves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from scaler.cluster.job import Job
from scaler.cluster.mig import MigInstance, MigLayout, mask_of, pack, profiles
from scaler.cluster.mig_parted import MigOption
from scaler.cluster.predicates import admits
from scaler.cluster.snapshot import ClusterState
from scaler.placement.decision import Placement
from scaler.placement.engine import place
from scaler.placement.policies.base import Policy


@dataclass(frozen=True, slots=True)
class Repartition:
    """GPU `gpu` of node `node` partitioned from `before` into `after` (instances written
    as the layout annotation writes one GPU's: `3g.40gb@4,2g.20gb@0`)."""

    node: str
    gpu: int
    before: str
    after: str
    serves: tuple[str, ...]  # the pending jobs that get instances of the new layout


@dataclass(frozen=True, slots=True)
class RepartitionPlan:
    changes: tuple[Repartition, ...]
    fit_now: tuple[str, ...]  # pending MIG jobs the free instances serve without a change
    unserved: tuple[tuple[str, str], ...]  # (job, why no change serves it)


def plan_repartition(
    state: ClusterState, pending: Sequence[Job], policy: Policy, max_gpus: int = 8
) -> RepartitionPlan:
    """The plan for the pending MIG jobs (others are ignored); see the module docstring."""
    scratch = state.copy()
    jobs = [j for j in pending if j.mig_profile is not None and j.problem() is None]
    jobs.sort(key=lambda j: (-_slices(scratch, j), j.id))
    fit_now: list[str] = []
    unserved: list[tuple[str, str]] = []
    before: dict[tuple[int, int], str] = {}
    serves: dict[tuple[int, int], list[str]] = {}
    for job in jobs:
        decided = place(scratch, job, policy)
        if isinstance(decided, Placement):
            scratch.bind(job, decided.node_index, decided.gpus)
            fit_now.append(job.id)
            continue
        target = _target(scratch, job, serves, len(serves) < max_gpus)
        if target is None:
            why = (
                f"no idle MIG GPU offering {job.mig_profile} on a node that admits it and has"
                f" its CPU and memory"
                + ("" if len(serves) < max_gpus else f" among those changed ({max_gpus} at most)")
            )
            unserved.append((job.id, why))
            continue
        node, gpu, layout = target
        if (node, gpu) not in before:
            before[(node, gpu)] = _gpu_text(scratch.mig[node], gpu)
        scratch.set_mig_layout(node, layout)
        free = [
            k for k in scratch.mig_free(node, str(job.mig_profile)) if _on(scratch, node, k, gpu)
        ]
        scratch.bind(job, node, free[: job.mig_count])
        serves.setdefault((node, gpu), []).append(job.id)
    changes = tuple(
        Repartition(
            state.names[node],
            gpu,
            before[(node, gpu)],
            _gpu_text(scratch.mig[node], gpu),
            tuple(served),
        )
        for (node, gpu), served in sorted(
            serves.items(), key=lambda kv: (state.names[kv[0][0]], kv[0][1])
        )
    )
    return RepartitionPlan(changes, tuple(fit_now), tuple(unserved))


def apply_repartition(state: ClusterState, plan: RepartitionPlan) -> None:
    """Give the plan's GPUs their new layouts; ValueError (state unchanged) where a job
    now holds an instance of a GPU to change."""
    updates: dict[int, MigLayout] = {}
    for change in plan.changes:
        node = state.node_index(change.node)
        layout = updates.get(node, state.mig[node])
        family = layout.family
        kept = [i for i in layout.instances if i.gpu != change.gpu]
        new = [
            MigInstance(change.gpu, name, int(start))
            for name, _, start in (item.partition("@") for item in change.after.split(","))
            if name
        ]
        updates[node] = MigLayout.of(family, [*kept, *new])
    trial = state.copy()
    for node, layout in updates.items():
        _check_idle(trial, node, plan)
        trial.set_mig_layout(node, layout)
    for node, layout in updates.items():
        state.set_mig_layout(node, layout)


def _check_idle(state: ClusterState, node: int, plan: RepartitionPlan) -> None:
    changed = {c.gpu for c in plan.changes if c.node == state.names[node]}
    layout = state.mig[node]
    for k in np.flatnonzero(state.mig_used[node]).tolist():
        if layout.instances[k].gpu in changed:
            raise ValueError(
                f"GPU {layout.instances[k].gpu} of node {state.names[node]!r} is in use:"
                " only idle GPUs may be repartitioned"
            )


def _target(
    state: ClusterState, job: Job, serves: dict[tuple[int, int], list[str]], may_add: bool
) -> tuple[int, int, MigLayout] | None:
    """The GPU to give `job`'s instances and its node's new layout, or None."""
    profile = str(job.mig_profile)
    room = admits(state, job) & (state.cpu_free >= job.cpu_milli)
    room &= state.mem_free >= job.memory_mib
    best: tuple[tuple[int, int, str, int], int, int, MigLayout] | None = None
    for node, layout in state.mig.items():
        if not room[node] or profile not in profiles(layout.family):
            continue
        for gpu in layout.gpus:
            reused = (node, gpu) in serves
            if not reused and not may_add:
                continue
            new = _new_layout(state, node, gpu, job, reused)
            if new is None:
                continue
            lost = _lost(layout, new, gpu)
            order = (0 if reused else 1, lost, state.names[node], gpu)
            if best is None or order < best[0]:
                best = (order, node, gpu, new)
    return None if best is None else (best[1], best[2], best[3])


def _new_layout(
    state: ClusterState, node: int, gpu: int, job: Job, reused: bool
) -> MigLayout | None:
    """Node `node`'s layout with GPU `gpu` holding `job`'s instances beside those jobs hold
    there (only where this plan repartitioned it before), then as many of its other
    current instances as fit, largest first; None if the job's do not fit."""
    layout = state.mig[node]
    table = profiles(layout.family)
    on_gpu = layout.on_gpu(gpu)
    held = [layout.instances[k] for k in on_gpu if state.mig_used[node][k]]
    if held and not reused:
        return None
    taken = 0
    for inst in held:
        taken |= mask_of(table[inst.profile], inst.start)
    names = [str(job.mig_profile)] * job.mig_count
    if pack(layout.family, names, taken) is None:
        return None
    spare = [layout.instances[k] for k in on_gpu if not state.mig_used[node][k]]
    for inst in sorted(spare, key=lambda i: (-table[i.profile].size, i.start)):
        if pack(layout.family, [*names, inst.profile], taken) is not None:
            names.append(inst.profile)
    starts = pack(layout.family, names, taken) or ()
    others = [i for i in layout.instances if i.gpu != gpu]
    new = [MigInstance(gpu, n, s) for n, s in zip(names, starts, strict=True)]
    return MigLayout.of(layout.family, [*others, *held, *new])


def _lost(layout: MigLayout, new: MigLayout, gpu: int) -> int:
    """Slices of GPU `gpu`'s current instances that the new layout drops."""
    table = profiles(layout.family)
    kept = {i for i in new.instances if i.gpu == gpu}
    return sum(table[i.profile].size for i in layout.instances if i.gpu == gpu and i not in kept)


def _gpu_text(layout: MigLayout, gpu: int) -> str:
    return ",".join(layout.instances[k].text for k in layout.on_gpu(gpu))


def _on(state: ClusterState, node: int, k: int, gpu: int) -> bool:
    return state.mig[node].instances[k].gpu == gpu


def _slices(state: ClusterState, job: Job) -> int:
    """Memory slices the job's instances take (the largest of its profile's families)."""
    sizes = [
        profiles(layout.family)[str(job.mig_profile)].size
        for layout in state.mig.values()
        if str(job.mig_profile) in profiles(layout.family)
    ]
    return max(sizes, default=0) * job.mig_count


# ---- named configs: what the GPU operator's MIG manager applies --------------------------
@dataclass(frozen=True, slots=True)
class NamedRepartition:
    """Node `node` given the named config `config`: each GPU it changes, from what to what,
    with the pending jobs the new instances serve."""

    node: str
    config: str
    changes: tuple[Repartition, ...]

    @property
    def serves(self) -> tuple[str, ...]:
        return tuple(job for change in self.changes for job in change.serves)


@dataclass(frozen=True, slots=True)
class RefusedRepartition:
    """A config that would serve `would_serve` on `node`, refused: `why`."""

    node: str
    config: str
    why: str
    would_serve: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NamedRepartitionPlan:
    changes: tuple[NamedRepartition, ...]
    fit_now: tuple[str, ...]  # pending MIG jobs the free instances serve without a change
    unserved: tuple[tuple[str, str], ...]  # (job, why no change serves it)
    refused: tuple[RefusedRepartition, ...]

    def by_gpu(self) -> RepartitionPlan:
        """The same changes GPU by GPU, as `apply_repartition` takes them."""
        changes = tuple(c for named in self.changes for c in named.changes)
        return RepartitionPlan(changes, self.fit_now, self.unserved)


def plan_named_repartition(
    state: ClusterState,
    pending: Sequence[Job],
    policy: Policy,
    options: Mapping[str, Sequence[MigOption]],
    max_nodes: int,
    blocked: Mapping[str, str] | None = None,
    busy: Mapping[str, Mapping[int, str]] | None = None,
) -> NamedRepartitionPlan:
    """The plan for the pending MIG jobs with the named `options` per node (see the module
    docstring). `blocked`: nodes to leave as they are (node -> why); `busy`: GPUs that may
    hold a job the state does not show (node -> GPU -> why)."""
    blocked = blocked or {}
    busy = busy or {}
    scratch = state.copy()
    jobs = [j for j in pending if j.mig_profile is not None and j.problem() is None]
    jobs.sort(key=lambda j: (-_slices(scratch, j), j.id))
    fit_now: list[str] = []
    left: list[Job] = []
    for job in jobs:
        decided = place(scratch, job, policy)
        if isinstance(decided, Placement):
            scratch.bind(job, decided.node_index, decided.gpus)
            fit_now.append(job.id)
        else:
            left.append(job)
    changes: list[NamedRepartition] = []
    while left and len(changes) < max_nodes:
        done = {c.node for c in changes}
        best: tuple[tuple[int, int, str, str], int, MigOption, ClusterState, list[Job]] | None
        best = None
        for name in sorted(set(options) - set(blocked) - done):
            node = scratch.node_index(name)
            for option in options[name]:
                if _in_use(scratch, node, option, busy.get(name, {})) is not None:
                    continue
                trial, served = _serve(scratch, node, option, left, policy)
                if not served:
                    continue
                gain = sum(_slices(scratch, j) for j in served)
                key = (-gain, len(option.gpus), name, option.name)
                if best is None or key < best[0]:
                    best = (key, node, option, trial, served)
        if best is None:
            break
        _, node, option, trial, served = best
        changes.append(_named(scratch, trial, node, option, served))
        scratch = trial
        taken = {j.id for j in served}
        left = [j for j in left if j.id not in taken]
    refused = _refused(state, scratch, policy, options, left, changes, blocked, busy)
    spent = "" if len(changes) < max_nodes else f" within the {max_nodes} change(s) allowed"
    unserved = tuple(
        (
            job.id,
            f"no free {job.mig_profile} instance, and no named MIG config gives one on idle"
            f" GPUs of a node that admits it{spent}",
        )
        for job in left
    )
    return NamedRepartitionPlan(tuple(changes), tuple(fit_now), unserved, refused)


def _in_use(
    state: ClusterState, node: int, option: MigOption, busy: Mapping[int, str]
) -> str | None:
    """Why `option` may not clear its GPUs on `node` (None: every one of them is idle)."""
    clears = f", which {option.name} clears (only GPUs no pod uses are repartitioned)"
    for gpu in option.gpus:
        if gpu in busy:
            return busy[gpu] + clears
    layout = state.mig[node]
    for job_id in sorted(state.node_jobs[node]):
        allocation = state.jobs[job_id]
        if allocation.job.mig_profile is None:
            continue
        for k in allocation.gpus:
            inst = layout.instances[k]
            if inst.gpu in option.gpus:
                return f"{job_id} runs on {inst.text} of GPU {inst.gpu}{clears}"
    return None


def _serve(
    state: ClusterState,
    node: int,
    option: MigOption,
    jobs: Sequence[Job],
    policy: Policy,
    release: bool = False,
) -> tuple[ClusterState, list[Job]]:
    """A copy of `state` with `node` given `option` and the `jobs` its new instances take
    bound there (with `release`, the jobs on the GPUs it clears let go first: what it would
    serve were they idle)."""
    offered = {inst.profile for inst in option.layout.instances}
    if not any(str(j.mig_profile) in offered for j in jobs):
        return state, []
    trial = state.copy()
    if release:
        layout = trial.mig[node]
        for job_id in sorted(trial.node_jobs[node]):
            held = trial.jobs[job_id]
            on = {layout.instances[k].gpu for k in held.gpus} if held.job.mig_profile else set()
            if on & set(option.gpus):
                trial.release(job_id)
    trial.set_mig_layout(node, option.layout)
    among = np.array([node])
    served = []
    for job in jobs:
        decided = place(trial, job, policy, among)
        if isinstance(decided, Placement):
            trial.bind(job, node, decided.gpus)
            served.append(job)
    return trial, served


def _named(
    before: ClusterState, after: ClusterState, node: int, option: MigOption, served: list[Job]
) -> NamedRepartition:
    old, new = before.mig[node], after.mig[node]
    changes = []
    for gpu in option.gpus:
        serves = tuple(
            j.id for j in served if any(new.instances[k].gpu == gpu for k in after.jobs[j.id].gpus)
        )
        name = before.names[node]
        changes.append(Repartition(name, gpu, _gpu_text(old, gpu), _gpu_text(new, gpu), serves))
    return NamedRepartition(before.names[node], option.name, tuple(changes))


def _refused(
    state: ClusterState,
    scratch: ClusterState,
    policy: Policy,
    options: Mapping[str, Sequence[MigOption]],
    left: Sequence[Job],
    changes: Sequence[NamedRepartition],
    blocked: Mapping[str, str],
    busy: Mapping[str, Mapping[int, str]],
) -> tuple[RefusedRepartition, ...]:
    """Per node not changed, the refused option that would serve most of `left` (ties: the
    one clearing fewest GPUs, as the plan chooses)."""
    if not left:
        return ()
    out = []
    changed = {c.node for c in changes}
    for name in sorted(set(options) - changed):
        node = state.node_index(name)
        best: tuple[tuple[int, int], RefusedRepartition] | None = None
        for option in options[name]:
            why = blocked.get(name) or _in_use(state, node, option, busy.get(name, {}))
            if why is None:
                continue
            _, served = _serve(scratch, node, option, left, policy, release=True)
            key = (-len(served), len(option.gpus))
            if served and (best is None or key < best[0]):
                found = RefusedRepartition(name, option.name, why, tuple(j.id for j in served))
                best = (key, found)
        if best is not None:
            out.append(best[1])
    return tuple(out)
