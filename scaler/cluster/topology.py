"""Where GPUs sit: NVLink / NVSwitch domains inside a node, as a node label writes them.

A domain is a group of GPU indices that talk over NVLink; a node with an NVSwitch has one
domain of all its GPUs. Written as groups of indices or ranges, separated by `_` (what a
Kubernetes label value allows), `,` or `;` (an annotation or a config may use them):
`0-3_4-7`, `0,1,2,3;4,5,6,7` or `0-1_2-3_4-5_6-7`; `nvswitch` (or `all`) is one domain
of every GPU. Racks and zones are plain node labels; the engine reads the rack
(`NodeSpec.rack`) to keep whole racks free, and a gang's topology names any label
(scaler.placement.gang).
"""

from __future__ import annotations

import re

ONE_DOMAIN = ("nvswitch", "all")
_GROUPS = re.compile(r"[_;]")


def parse_gpu_domains(text: str, gpus: int) -> tuple[tuple[int, ...], ...]:
    """The domains `text` writes for a node of `gpus` GPUs; ValueError says what is wrong.
    Groups are split at `_` or `;`, where a `,` joins the parts of one group; without
    either, each `,` part is a group (`0-3,4-7`: two domains)."""
    text = text.strip()
    if text.lower() in ONE_DOMAIN:
        return (tuple(range(gpus)),) if gpus else ()
    groups = _GROUPS.split(text) if _GROUPS.search(text) else text.split(",")
    seen: set[int] = set()
    domains: list[tuple[int, ...]] = []
    for group in groups:
        members = _members(group, text)
        if seen & set(members) or max(members) >= gpus:
            raise ValueError(
                f"GPU domains {text!r} name a GPU twice or beyond the node's {gpus} GPUs"
            )
        seen |= set(members)
        domains.append(members)
    return tuple(domains)


def _members(group: str, text: str) -> tuple[int, ...]:
    members: list[int] = []
    for part in filter(None, (p.strip() for p in group.split(","))):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"GPU domains {text!r}: {part!r} is not an index or a range a-b")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"GPU domains {text!r}: range {part!r} runs backwards")
        members.extend(range(first, last + 1))
    if not members:
        raise ValueError(f"GPU domains {text!r} have an empty group")
    return tuple(members)
