"""MIG: a GPU partitioned into instances, NVIDIA's placement rules, and how full a GPU is.

A MIG-capable GPU (A100, H100, H200) has 7 compute slices and 8 memory slices. An instance
profile (`3g.40gb`: 3 compute slices, 40 GB) occupies `size` consecutive memory slices
from a start its profile allows, the placements `nvidia-smi mig -lgipp` lists (MIG user
guide, "Supported MIG Profiles"); instances of one GPU never overlap. Every family of
these GPUs has the same six shapes, named after its memory:

    shape        compute  slices  starts      A100-40GB  80GB (A100, H100)  H200-141GB
    1g small     1        1       0..6        1g.5gb     1g.10gb            1g.18gb
    1g large     1        2       0,2,4,6     1g.10gb    1g.20gb            1g.35gb
    2g           2        2       0,2,4       2g.10gb    2g.20gb            2g.35gb
    3g           3        4       0,4         3g.20gb    3g.40gb            3g.71gb
    4g           4        4       0           4g.20gb    4g.40gb            4g.71gb
    7g           7        8       0           7g.40gb    7g.80gb            7g.141gb

A name means different shapes in different families (`1g.10gb` is the large 1g of an
A100-40GB and the small one of an 80 GB GPU), so a node's family is worked out once, from
its GPU memory, product name or instance names (`family_of`).

A node's layout (`MigLayout`) is its instances, by GPU and start. It is read, in this
order, from a layout annotation (`parse_layout`: `0=3g.40gb@4,2g.20gb@0;1=7g.80gb`, a
start optional), or from the per-profile counts the GPU operator's "mixed" strategy
publishes as allocatable `nvidia.com/mig-<profile>` resources, spread evenly over the
node's MIG GPUs (`layout_from_counts`): the counts say how many instances there are, not
where, and the even spread is what the operator's `all-*` configurations make.

How fragmented a GPU is (`waste`): for each of its family's shapes, the free slices it
could not use even if the free part of the GPU were partitioned anew for that shape alone,
weighted by the shape's size, so that a placement that costs a 7g its room counts most.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np

from scaler.cluster.limits import MAX_NODE_GPUS

SLICES = 8  # memory slices of a MIG GPU: placements are given in them
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

# (compute slices, memory slices, allowed starts) of the six shapes, in the table's order.
_SHAPES: tuple[tuple[int, int, tuple[int, ...]], ...] = (
    (1, 1, (0, 1, 2, 3, 4, 5, 6)),
    (1, 2, (0, 2, 4, 6)),
    (2, 2, (0, 2, 4)),
    (3, 4, (0, 4)),
    (4, 4, (0,)),
    (7, 8, (0,)),
)
# Family -> its GPU memory (GB) and its six profile names in `_SHAPES` order; where names
# alone cannot tell families apart, the first listed is assumed.
FAMILIES: dict[str, tuple[int, tuple[str, ...]]] = {
    "80GB": (80, ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
    "A100-40GB": (40, ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")),
    "H100-94GB": (94, ("1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb")),
    "H100-96GB": (96, ("1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb")),
    "H200-141GB": (141, ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb")),
}
_PROFILE_NAME = re.compile(r"^([1-7])g\.(\d+)gb$")
_MEMORY_IN_NAME = re.compile(r"(\d+)GB", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class MigProfile:
    name: str
    compute: int
    size: int  # memory slices
    starts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One instance of a node's layout: profile `profile` on GPU `gpu` from slice `start`."""

    gpu: int
    profile: str
    start: int

    @property
    def text(self) -> str:
        return f"{self.profile}@{self.start}"


def profiles(family: str) -> dict[str, MigProfile]:
    """The profiles of a family by name."""
    return _profiles(family)


@cache
def _profiles(family: str) -> dict[str, MigProfile]:
    if family not in FAMILIES:
        raise ValueError(f"unknown MIG GPU family {family!r} (known: {', '.join(FAMILIES)})")
    names = FAMILIES[family][1]
    return {n: MigProfile(n, c, s, st) for n, (c, s, st) in zip(names, _SHAPES, strict=True)}


def profile_problem(name: str) -> str | None:
    """Why `name` is no MIG profile any known family offers (None: some family does)."""
    if not _PROFILE_NAME.match(name):
        return f"MIG profile {name!r} is not of the form <compute>g.<memory>gb (e.g. 1g.10gb)"
    if not any(name in names for _, names in FAMILIES.values()):
        return f"no MIG GPU family offers profile {name!r}"
    return None


def family_of(names: Iterable[str], memory_mib: int | None = None, product: str = "") -> str | None:
    """The family of a GPU whose instances are named `names`: the one family that offers
    them all, else (names shared by families) the one nearest the GPU memory, else the one
    whose memory the product name states, else the first listed (80 GB). None: no family
    offers them all."""
    wanted = set(names)
    fits = [f for f, (_, offered) in FAMILIES.items() if wanted <= set(offered)]
    if len(fits) <= 1:
        return fits[0] if fits else None
    if memory_mib:
        return min(fits, key=lambda f: abs(FAMILIES[f][0] * 1024 - memory_mib))
    stated = [int(m) for m in _MEMORY_IN_NAME.findall(product)]
    for gb in stated:
        for f in fits:
            if FAMILIES[f][0] == gb:
                return f
    return fits[0]


def mask_of(profile: MigProfile, start: int) -> int:
    """The memory slices an instance occupies, as bits."""
    return ((1 << profile.size) - 1) << start


def pack(family: str, names: Sequence[str], taken: int = 0) -> tuple[int, ...] | None:
    """Starts for instances `names` on one GPU whose slices `taken` (bits) are used (in
    the given order), or None when they cannot all be placed. Largest first, each at the
    lowest start that leaves the rest a placement."""
    table = profiles(family)
    if sum(table[n].size for n in names) + taken.bit_count() > SLICES:
        return None
    return _pack(family, tuple(names), taken)


# Dealing a node's instances over its GPUs asks the same GPUs' questions again and again.
@lru_cache(maxsize=4096)
def _pack(family: str, names: tuple[str, ...], taken: int) -> tuple[int, ...] | None:
    table = profiles(family)
    order = sorted(range(len(names)), key=lambda i: (-table[names[i]].size, i))
    starts = [0] * len(names)
    # The order is fixed, so whether instances k.. fit depends on `used` alone: a state
    # that failed once fails again (without this, 8 small instances, one too many for a
    # GPU, tried every arrangement of the first 7).
    failed: set[tuple[int, int]] = set()

    def place(k: int, used: int) -> bool:
        if k == len(order):
            return True
        if (k, used) in failed:
            return False
        profile = table[names[order[k]]]
        for start in profile.starts:
            bits = mask_of(profile, start)
            if not used & bits and place(k + 1, used | bits):
                starts[order[k]] = start
                return True
        failed.add((k, used))
        return False

    return tuple(starts) if place(0, taken) else None


def check_gpu(family: str, instances: Sequence[MigInstance]) -> str | None:
    """Why the instances of one GPU break NVIDIA's placement rules (None: they do not)."""
    table = profiles(family)
    used = 0
    for inst in instances:
        profile = table.get(inst.profile)
        if profile is None:
            return f"GPU {inst.gpu}: family {family} has no profile {inst.profile!r}"
        if inst.start not in profile.starts:
            allowed = ",".join(map(str, profile.starts))
            return f"GPU {inst.gpu}: {inst.profile} may start at {allowed}, not {inst.start}"
        bits = mask_of(profile, inst.start)
        if used & bits:
            return f"GPU {inst.gpu}: {inst.text} overlaps another instance"
        used |= bits
    return None


@dataclass(frozen=True, slots=True)
class MigLayout:
    """A node's MIG instances (by GPU, then start) and their family."""

    family: str
    instances: tuple[MigInstance, ...]

    @classmethod
    def of(cls, family: str, instances: Iterable[MigInstance]) -> MigLayout:
        """A layout, checked against the placement rules (ValueError says which GPU)."""
        ordered = tuple(sorted(instances, key=lambda i: (i.gpu, i.start)))
        for gpu in sorted({i.gpu for i in ordered}):
            problem = check_gpu(family, [i for i in ordered if i.gpu == gpu])
            if problem:
                raise ValueError(problem)
        return cls(family, ordered)

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(sorted({i.gpu for i in self.instances}))

    def on_gpu(self, gpu: int) -> list[int]:
        """Indices of the instances on `gpu`."""
        return [k for k, inst in enumerate(self.instances) if inst.gpu == gpu]

    def masks(self) -> tuple[int, ...]:
        """Each instance's slices as bits."""
        table = profiles(self.family)
        return tuple(mask_of(table[i.profile], i.start) for i in self.instances)

    def text(self) -> str:
        """The layout in `parse_layout`'s notation."""
        return ";".join(
            f"{gpu}=" + ",".join(self.instances[k].text for k in self.on_gpu(gpu))
            for gpu in self.gpus
        )


def parse_layout(text: str, family: str) -> MigLayout:
    """A layout written `GPU=profile[@start],...;GPU=...` (e.g. `0=3g.40gb@4,2g.20gb@0;
    1=7g.80gb`); a GPU whose starts are left out gets them from `pack`. ValueError names
    the part that is wrong."""
    instances: list[MigInstance] = []
    seen: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(";"))):
        gpu_text, sep, rest = part.partition("=")
        if not sep or not gpu_text.strip().isdigit():
            raise ValueError(f"MIG layout part {part!r} is not GPU=profile[@start],...")
        gpu = int(gpu_text)
        if gpu >= MAX_NODE_GPUS:
            raise ValueError(f"MIG layout names GPU {gpu}: a node holds at most {MAX_NODE_GPUS}")
        if gpu in seen:
            raise ValueError(f"MIG layout names GPU {gpu} twice")
        seen.add(gpu)
        named = [item.strip().partition("@") for item in rest.split(",") if item.strip()]
        if not named:
            raise ValueError(f"MIG layout part {part!r} names no instance")
        for name, _, _ in named:
            if name not in profiles(family):
                raise ValueError(f"MIG layout part {part!r}: family {family} has no {name!r}")
        if all(start for _, _, start in named):
            starts = tuple(_start(part, start) for _, _, start in named)
        elif not any(start for _, _, start in named):
            packed = pack(family, [name for name, _, _ in named])
            if packed is None:
                raise ValueError(f"MIG layout part {part!r} does not fit one GPU")
            starts = packed
        else:
            raise ValueError(f"MIG layout part {part!r}: give every start or none")
        instances += [MigInstance(gpu, n, s) for (n, _, _), s in zip(named, starts, strict=True)]
    return MigLayout.of(family, instances)


def layout_of(text: str, product: str = "", memory_mib: int | None = None) -> MigLayout:
    """The layout `text` writes (`parse_layout`), on GPUs of the family its profiles, the
    GPU memory or the product name say (`family_of`)."""
    names = layout_profiles(text)
    family = family_of(names, memory_mib, product)
    if family is None:
        raise ValueError(f"no MIG GPU family offers all of {', '.join(sorted(names))}")
    return parse_layout(text, family)


def layout_profiles(text: str) -> set[str]:
    """The profile names a layout in `parse_layout`'s notation uses."""
    return {
        item.strip().partition("@")[0]
        for part in text.split(";")
        for item in part.partition("=")[2].split(",")
        if item.strip()
    }


def _start(part: str, text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"MIG layout part {part!r}: start {text!r} is not a slice index")
    return int(text)


def layout_from_counts(
    counts: Mapping[str, int], family: str, gpus: int | None = None, first_gpu: int = 0
) -> MigLayout:
    """The layout a node's per-profile instance counts stand for, on `gpus` MIG GPUs
    numbered from `first_gpu` (None: the fewest that hold them): the counts split evenly
    where they divide, else the instances dealt largest first to the first GPU with room."""
    table = profiles(family)
    unknown = sorted(set(counts) - set(table))
    if unknown:
        raise ValueError(f"family {family} has no MIG profile {', '.join(unknown)}")
    listed = ", ".join(f"{n}: {c}" for n, c in counts.items())
    most = MAX_NODE_GPUS * SLICES  # no GPU holds more instances than memory slices
    if sum(counts.values()) > most or (gpus or 0) > MAX_NODE_GPUS:
        raise ValueError(
            f"MIG instances ({listed}) on {gpus or 'any number of'} GPU(s): a node holds at"
            f" most {MAX_NODE_GPUS} GPUs and {most} instances"
        )
    wanted = [
        name for name in sorted(counts, key=lambda n: -table[n].size) for _ in range(counts[name])
    ]
    if not wanted:
        return MigLayout(family, ())
    least = max(1, -(-sum(table[n].size for n in wanted) // SLICES))
    for count in [gpus] if gpus else range(least, min(len(wanted), MAX_NODE_GPUS) + 1):
        per_gpu = _even(family, counts, count) or _deal(family, wanted, count)
        if per_gpu is not None:
            instances = [
                MigInstance(first_gpu + k, n, s)
                for k, names in enumerate(per_gpu)
                for n, s in zip(names, pack(family, names) or (), strict=True)
            ]
            return MigLayout.of(family, instances)
    room = f"{gpus} GPU(s)" if gpus else f"the {MAX_NODE_GPUS} GPUs a node holds at most"
    raise ValueError(f"MIG instances ({listed}) do not fit {room} of family {family}")


def _even(family: str, counts: Mapping[str, int], gpus: int) -> list[list[str]] | None:
    if any(c % gpus for c in counts.values()):
        return None
    one = [name for name, c in counts.items() for _ in range(c // gpus)]
    return [list(one) for _ in range(gpus)] if pack(family, one) is not None else None


def _deal(family: str, wanted: list[str], gpus: int) -> list[list[str]] | None:
    per_gpu: list[list[str]] = [[] for _ in range(gpus)]
    for name in wanted:
        for names in per_gpu:
            if pack(family, [*names, name]) is not None:
                names.append(name)
                break
        else:
            return None
    return per_gpu if all(pack(family, names) is not None for names in per_gpu) else None


@cache
def waste(family: str) -> np.ndarray:
    """waste[used]: the fragmentation of a GPU of `family` whose slices `used` (bits) are
    taken: per shape, the free slices it could not use, weighted by the shape's size."""
    table = list(profiles(family).values())
    weight = np.array([p.size for p in table], dtype=float)
    weight /= weight.sum()
    out = np.zeros(1 << SLICES)
    for used in range(1 << SLICES):
        free = SLICES - bin(used).count("1")
        lost = [free - p.size * _most(p, used) for p in table]
        out[used] = float(np.dot(weight, lost))
    return out


def _most(profile: MigProfile, used: int) -> int:
    """How many instances of `profile` the free slices hold at once (earliest start first
    is optimal for equal sizes)."""
    count = 0
    for start in profile.starts:
        bits = mask_of(profile, start)
        if not used & bits:
            used |= bits
            count += 1
    return count


def largest_placeable(family: str, used: int) -> str | None:
    """The largest profile that still has room on a GPU whose slices `used` are taken."""
    fitting = [p for p in profiles(family).values() if _most(p, used)]
    return max(fitting, key=lambda p: (p.size, p.compute)).name if fitting else None
