"""Per-node caches that what-if copies of a cluster state share until one side writes."""

from __future__ import annotations

from typing import ClassVar, Self


class CopyOnWrite:
    """A cache of per-node arrays (the dataclass fields named in `ARRAYS`, then `shared`)
    that a copy shares until either side refreshes a node: what-if copies of a state
    (gangs, preemption, scale-down checks) mostly read them."""

    ARRAYS: ClassVar[tuple[str, ...]]
    shared: bool

    def copy(self) -> Self:
        self.shared = True
        return type(self)(*(getattr(self, name) for name in self.ARRAYS), True)

    def own(self) -> None:
        """Take private arrays before writing, if they are shared with a copy."""
        if self.shared:
            for name in self.ARRAYS:
                setattr(self, name, getattr(self, name).copy())
            self.shared = False
