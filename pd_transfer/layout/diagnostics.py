"""Readable diagnostics: describing a view's sharding, folding repeated mismatches.

A dtype mismatch on a 61-layer model is one fact, not 122 lines: mismatches
that differ only by layer id are folded into one line whose path lists the
layers (``kv.layer[0-31].k.dtype``). Every mismatch is still reported; none is
dropped. Pure.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pd_transfer.errors import Mismatch
from pd_transfer.layout.views import TensorView

if TYPE_CHECKING:
    from pd_transfer.layout.geometry import RankGeometry

_LAYER = re.compile(r"\.layer\[(\d+)\]")


def describe_shard(view: TensorView, axis: str) -> str:
    if view.shard is None:
        return f"item {view.item_nbytes} B, <missing: global extent and local range of sharded axis '{axis}'>"
    return f"item {view.item_nbytes} B, '{axis}' {view.shard.describe()}"


def describe_ranks(ranks: Iterable[RankGeometry]) -> str:
    """Rank ids folded per PP stage: four decode ranks of stage 0 -> ``decode[pp0,tp0-3]``."""
    tps: dict[tuple[str, int], list[int]] = defaultdict(list)
    for geometry in ranks:
        tps[(geometry.role.value, geometry.pp_rank)].append(geometry.tp_rank)
    return ", ".join(f"{role}[pp{pp},tp{format_ranges(ids)}]" for (role, pp), ids in tps.items())


def collapse(mismatches: list[Mismatch]) -> list[Mismatch]:
    """Fold mismatches equal but for the layer id, keeping first-seen order."""
    groups: dict[tuple, list[int]] = {}
    order: list[tuple] = []
    for m in mismatches:
        found = _LAYER.search(m.path)
        layer = int(found.group(1)) if found else None
        template = _LAYER.sub(".layer[{}]", m.path) if found else m.path
        key = (template, m.code, str(m.prefill), str(m.decode), m.hint)
        if key not in groups:
            groups[key] = []
            order.append((key, m))
        if layer is not None:
            groups[key].append(layer)
    folded = []
    for key, first in order:
        layers = groups[key]
        path = key[0].format(format_ranges(layers)) if layers else first.path
        folded.append(Mismatch(path, first.code, first.prefill, first.decode, first.hint))
    return folded


def format_ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    values = sorted(set(values))
    parts = []
    start = prev = values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)
