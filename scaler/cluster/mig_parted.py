"""mig-parted's named MIG configurations, and what applying one would make of a node.

NVIDIA's GPU operator partitions a node's GPUs with its MIG manager, which runs
`nvidia-mig-parted apply` with the config the node's `nvidia.com/mig.config` label names.
Those configs live in one file (the operator's `default-mig-parted-config` ConfigMap, key
`config.yaml`, or the one `migManager.config.name` names), under `mig-configs`:

    all-3g.40gb:
      - devices: all                     # or a list of GPU indices: [0, 1]
        mig-enabled: true
        mig-devices: {"3g.40gb": 2}      # instances per GPU, by profile
    all-balanced:
      - device-filter: ["0x20B510DE"]    # PCI device ids: only those GPUs
        devices: all
        mig-enabled: true
        mig-devices: {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}

`MigConfigEntry` reads one entry as mig-parted does. `resolve` says what a named config
does to a node whose MIG GPUs are `layout` and whose other GPUs are whole, as mig-parted
walks it: every entry, in order, sets each GPU it selects (its `devices`, and its
`device-filter`), so the last entry selecting a GPU wins and a GPU no entry selects is left
as it is. mig-parted then skips every GPU whose instance counts already equal the
config's; any other GPU is cleared (all its instances destroyed) and made anew, so a GPU
the config changes must be idle, every instance of it, not only those that differ.

What gpuscale cannot see from Kubernetes, it reads conservatively:

- `device-filter` names PCI device ids that no node label carries; an entry with one is
  taken to select this node's GPUs when every profile it names is one the node's GPU family
  offers (an entry for another GPU names another family's profiles), and, where it names
  none (MIG off, or on with no instances), to select them: the config then counts as one
  that changes the MIG mode, which is never applied (below).
- A config that turns MIG on or off on any GPU (a whole GPU it enables, a MIG GPU it
  disables) is refused: a mode change needs a GPU reset, with the operator often a node
  reboot (`nvidia.com/mig.config.state=rebooting`), which stops every pod on the node.
- Where a changed GPU's instances start is the driver's choice (mig-parted asks NVML for
  instances, not positions); the layout given here packs them as `mig.pack` does, largest
  first at the lowest start, the placement model's guess until the node says otherwise.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scaler.cluster.mig import MigInstance, MigLayout, pack, profiles


class MigConfigEntry(BaseModel):
    """One entry of a mig-parted config: the GPUs it selects and what they become."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    device_filter: str | tuple[str, ...] | None = Field(default=None, alias="device-filter")
    devices: Literal["all"] | tuple[int, ...]
    mig_enabled: bool = Field(alias="mig-enabled")
    mig_devices: dict[str, int] | None = Field(default=None, alias="mig-devices")

    @model_validator(mode="after")
    def _as_mig_parted_reads_it(self) -> MigConfigEntry:
        # The checks mig-parted's own reading of an entry makes (api/spec/v1).
        if self.mig_enabled and self.mig_devices is None:
            raise ValueError("mig-enabled: true needs mig-devices (may be {})")
        if not self.mig_enabled and self.mig_devices:
            raise ValueError("mig-enabled: false takes no mig-devices")
        if any(count < 0 for count in (self.mig_devices or {}).values()):
            raise ValueError("mig-devices counts are whole numbers >= 0")
        return self

    def selects(self, gpu: int, family: str) -> bool:
        """Whether this entry sets GPU `gpu` of a node whose GPUs are of `family`."""
        if self.devices != "all" and gpu not in self.devices:
            return False
        if self.device_filter is None:
            return True
        named = [p for p, count in (self.mig_devices or {}).items() if count]
        return all(p in profiles(family) for p in named)  # see the module docstring

    @property
    def counts(self) -> dict[str, int]:
        return {p: c for p, c in (self.mig_devices or {}).items() if c}


MigConfigs = Mapping[str, Sequence[MigConfigEntry]]  # config name -> its entries


@dataclass(frozen=True, slots=True)
class MigOption:
    """What giving a node config `name` makes of it: its whole `layout` then, and the MIG
    GPUs whose instances change (cleared and made anew)."""

    name: str
    layout: MigLayout
    gpus: tuple[int, ...]


def resolve(
    name: str, entries: Sequence[MigConfigEntry], layout: MigLayout, whole: Sequence[int]
) -> MigOption | str:
    """The option config `name` gives a node whose MIG GPUs are `layout` and whose whole
    GPUs are numbered `whole`, or why it gives none (a mode change, a profile its family
    does not offer, instances that do not fit one GPU, nothing changed)."""
    family = layout.family
    target: dict[int, MigConfigEntry] = {}
    for entry in entries:
        for gpu in (*layout.gpus, *whole):
            if entry.selects(gpu, family):
                target[gpu] = entry  # mig-parted applies entries in order: the last wins
    for gpu in whole:
        if gpu in target and target[gpu].mig_enabled:
            return f"{name} turns MIG on on GPU {gpu} (a mode change: a GPU reset)"
    kept: list[MigInstance] = []
    made: list[MigInstance] = []
    changed: list[int] = []
    for gpu in layout.gpus:
        now = [layout.instances[k] for k in layout.on_gpu(gpu)]
        entry = target.get(gpu)
        if entry is None:
            kept += now
            continue
        if not entry.mig_enabled:
            return f"{name} turns MIG off on GPU {gpu} (a mode change: a GPU reset)"
        counts = entry.counts
        unknown = sorted(set(counts) - set(profiles(family)))
        if unknown:
            return f"{name} asks {', '.join(unknown)}, which {family} GPUs do not offer"
        if Counter(i.profile for i in now) == Counter(counts):
            kept += now  # mig-parted skips a GPU already as the config says
            continue
        names = [p for p in sorted(counts) for _ in range(counts[p])]
        starts = pack(family, names)
        if starts is None:
            listed = ", ".join(f"{p} x{c}" for p, c in sorted(counts.items()))
            return f"{name} asks {listed} of GPU {gpu}, more than one GPU holds"
        made += [MigInstance(gpu, p, s) for p, s in zip(names, starts, strict=True)]
        changed.append(gpu)
    if not changed:
        return f"{name} changes no MIG GPU of the node"
    return MigOption(name, MigLayout.of(family, [*kept, *made]), tuple(changed))


def node_options(configs: MigConfigs, layout: MigLayout, whole_gpus: int) -> list[MigOption]:
    """Every config that would change some of the node's MIG GPUs and nothing else (no
    mode change), by name. The node's whole GPUs take the first indices its MIG GPUs leave
    free (the layout annotation's numbering, else whole GPUs first)."""
    free = (i for i in itertools.count() if i not in layout.gpus)
    whole = [next(free) for _ in range(whole_gpus)]
    found = (resolve(name, entries, layout, whole) for name, entries in sorted(configs.items()))
    return [option for option in found if isinstance(option, MigOption)]
