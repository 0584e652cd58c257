"""Tensor views: every registered tensor is a strided view with a sharded range.

A :class:`TensorView` says where a tensor lives (region id, byte offset), what
its elements are (dtype), how it is laid out (shape and *byte* strides, like
``torch.as_strided``), what each axis means (:class:`Axis`), and, for the
tensor-parallel sharded axis, which part of the global extent this rank holds
(:class:`ShardSpec`). NHD and HND device pools, host ``layer_first`` /
``page_first`` / ``page_first_direct`` / ``page_head`` pools, MLA latents and
Mamba states are all views with different strides; nothing downstream
special-cases a layout by name. The ``layout`` tag is kept for diagnostics and
for operations that are defined only for some layouts (page-buffer metadata).

Pure data; imports only the standard library and ``pd_transfer.errors``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.layout.dtypes import itemsize


class AxisRole(enum.Enum):
    INDEX = "index"  # page, slot or row: what transfer requests address
    TOKEN = "token"  # token within a page
    SHARD = "shard"  # the tensor-parallel sharded axis (heads, channels)
    OUTER = "outer"  # rows in front of the shard axis (Kimi/KDA conv state)
    INNER = "inner"  # everything else (head_dim, state size, bytes)


class Pool(enum.Enum):
    """Which index space a tensor is addressed by in a transfer request."""

    KV = "kv"  # full-attention KV pages (MHA/GQA or MLA)
    SWA = "swa"  # sliding-window KV pages (window pages only)
    MAMBA = "mamba"  # linear-attention / SSM state slots, one per request
    AUX = "aux"  # metadata rows (first output token, ...)


class Layout(enum.Enum):
    NHD = "nhd"  # device: [token, head, dim] per layer
    HND = "hnd"  # device: [page, head, token, dim] per layer
    LAYER_FIRST = "layer_first"  # host: (2, L, S, H, D)
    PAGE_FIRST = "page_first"  # host: (2, S, L, H, D)
    PAGE_FIRST_DIRECT = "page_first_direct"  # host: (2, P, L, ps, H, D)
    PAGE_HEAD = "page_head"  # host: (2, P, H, ps, L, D)
    SLOT = "slot"  # device state: [slot, ...] per layer
    ROW = "row"  # aux metadata rows

    @property
    def is_host(self) -> bool:
        return self in HOST_LAYOUTS


HOST_LAYOUTS = (Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT, Layout.PAGE_HEAD)
KV_LAYOUTS = (Layout.NHD, Layout.HND) + HOST_LAYOUTS


@dataclass(frozen=True)
class Axis:
    name: str
    role: AxisRole


@dataclass(frozen=True)
class ShardSpec:
    """Which part of a sharded axis this rank holds, in global coordinates.

    The axis is a concatenation of independently sharded groups. A plain axis
    (heads of a KV buffer) is one group; a GDN conv state ``[q | k | v]`` is
    three, with ``groups = (key_dim, key_dim, value_dim)`` and one local
    ``[start, end)`` range per group. The local axis is the concatenation of
    the local ranges, in group order.

    ``declared_groups`` is False when the registration gave a plain range
    without saying whether the axis is a concatenation. Reconciliation refuses
    to slice such an axis against a side that declared groups.
    """

    groups: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    declared_groups: bool = False

    @staticmethod
    def plain(global_extent: int, start: int, end: int) -> ShardSpec:
        return ShardSpec((global_extent,), ((start, end),), False)

    @staticmethod
    def full(global_extent: int) -> ShardSpec:
        return ShardSpec.plain(global_extent, 0, global_extent)

    @staticmethod
    def grouped(groups: tuple[int, ...], ranges: tuple[tuple[int, int], ...]) -> ShardSpec:
        return ShardSpec(tuple(groups), tuple(ranges), True)

    @staticmethod
    def for_rank(
        global_extent: int, tp_size: int, tp_rank: int, groups: tuple[int, ...] | None = None
    ) -> ShardSpec:
        """The canonical range of ``tp_rank`` out of ``tp_size``.

        Each group of size ``g`` splits into ``tp_size`` equal parts when
        ``g >= tp_size``; when ``g < tp_size`` (GQA with fewer KV heads than
        ranks) each element is replicated on ``tp_size // g`` consecutive ranks.
        """
        sizes = tuple(groups) if groups else (global_extent,)
        if sum(sizes) != global_extent:
            raise GeometryError(
                f"shard groups {list(sizes)} sum to {sum(sizes)}, not the axis extent {global_extent}",
                code=Reason.SHARD_RANGE_INVALID,
            )
        ranges = tuple(canonical_range(g, tp_size, tp_rank) for g in sizes)
        return ShardSpec(sizes, ranges, groups is not None)

    @property
    def global_extent(self) -> int:
        return sum(self.groups)

    @property
    def local_extent(self) -> int:
        return sum(end - start for start, end in self.ranges)

    @property
    def is_full(self) -> bool:
        return all(r == (0, g) for g, r in zip(self.groups, self.ranges))

    def describe(self) -> str:
        if len(self.groups) == 1 and not self.declared_groups:
            ((start, end),) = self.ranges
            return f"[{start},{end}) of {self.groups[0]}"
        parts = ", ".join(f"[{s},{e}) of {g}" for g, (s, e) in zip(self.groups, self.ranges))
        return f"groups {{{parts}}}"


def canonical_range(extent: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``tp_rank`` when ``extent`` is split over ``tp_size``.

    Raises :class:`GeometryError` (``shard_not_divisible``) when neither
    ``extent`` divides by ``tp_size`` nor ``tp_size`` by ``extent``.
    """
    if not 0 <= tp_rank < tp_size:
        raise GeometryError(
            f"tp_rank {tp_rank} is outside tp_size {tp_size}", code=Reason.SHARD_RANGE_INVALID
        )
    if extent >= tp_size:
        if extent % tp_size:
            raise GeometryError(
                f"extent {extent} does not split over tp_size {tp_size}", code=Reason.SHARD_NOT_DIVISIBLE
            )
        per_rank = extent // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if tp_size % extent:
        raise GeometryError(
            f"extent {extent} cannot be replicated evenly over tp_size {tp_size}",
            code=Reason.SHARD_NOT_DIVISIBLE,
        )
    # tp=8 over 2 KV heads: ranks 0-3 hold head 0, ranks 4-7 head 1
    head = tp_rank // (tp_size // extent)
    return head, head + 1


@dataclass(frozen=True)
class TensorView:
    """One registered tensor. See the module docstring."""

    pool: Pool
    layer_id: int | None
    name: str
    region: str
    offset_nbytes: int
    dtype: str
    shape: tuple[int, ...]
    strides_nbytes: tuple[int, ...]
    axes: tuple[Axis, ...]
    shard: ShardSpec | None
    layout: Layout

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise GeometryError(f"{self.path}: {problem}", code=Reason.BAD_VIEW)

    def _problem(self) -> str:
        if not (len(self.shape) == len(self.strides_nbytes) == len(self.axes)):
            return (
                f"shape {self.shape}, strides {self.strides_nbytes} and axes "
                f"{[a.name for a in self.axes]} differ in length"
            )
        if any(n <= 0 for n in self.shape):
            return f"shape {self.shape} has an empty axis"
        if any(s < 0 for s in self.strides_nbytes) or self.offset_nbytes < 0:
            return "negative strides or offset are not supported"
        roles = [a.role for a in self.axes]
        if roles.count(AxisRole.INDEX) != 1:
            return "needs exactly one index axis (page, slot or row)"
        if roles.count(AxisRole.TOKEN) > 1 or roles.count(AxisRole.SHARD) > 1:
            return "has more than one token or shard axis"
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            return f"axis names {names} repeat"
        if self.shard is not None:
            if AxisRole.SHARD not in roles:
                return "has a shard spec but no shard axis"
            if self.shard.local_extent != self.shape[roles.index(AxisRole.SHARD)]:
                return (
                    f"shard axis holds {self.shape[roles.index(AxisRole.SHARD)]} "
                    f"but the shard spec {self.shard.describe()} covers {self.shard.local_extent}"
                )
            for g, (s, e) in zip(self.shard.groups, self.shard.ranges):
                if not 0 <= s < e <= g:
                    return f"shard range [{s},{e}) is outside group of {g}"
        itemsize(self.dtype)
        return ""

    # -- naming -----------------------------------------------------------
    @property
    def key(self) -> tuple[Pool, int | None, str]:
        """What pairs a prefill tensor with a decode tensor (never position)."""
        return (self.pool, self.layer_id, self.name)

    @property
    def path(self) -> str:
        if self.layer_id is None:
            return f"{self.pool.value}.{self.name}"
        return f"{self.pool.value}.layer[{self.layer_id}].{self.name}"

    # -- axes ---------------------------------------------------------------
    def axis_index(self, role: AxisRole) -> int | None:
        for i, axis in enumerate(self.axes):
            if axis.role is role:
                return i
        return None

    def axis_of(self, role: AxisRole) -> int:
        """Position of the ``role`` axis, which the caller knows the view has (every view has
        its one index axis); GeometryError where it has none."""
        i = self.axis_index(role)
        if i is None:
            raise GeometryError(f"{self.path}: has no {role.value} axis", code=Reason.BAD_VIEW)
        return i

    def extent(self, role: AxisRole) -> int | None:
        i = self.axis_index(role)
        return None if i is None else self.shape[i]

    def axis_named(self, name: str) -> int:
        for i, axis in enumerate(self.axes):
            if axis.name == name:
                return i
        raise KeyError(name)

    @property
    def index_count(self) -> int:
        return self.shape[self.axis_of(AxisRole.INDEX)]

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def is_sharded(self) -> bool:
        """True if the view has a shard axis (with or without its metadata)."""
        return self.axis_index(AxisRole.SHARD) is not None

    @property
    def shard_metadata_missing(self) -> bool:
        return self.is_sharded and self.shard is None

    @property
    def item_nbytes(self) -> int:
        """Logical bytes of one index item (one page, slot or row)."""
        i = self.axis_index(AxisRole.INDEX)
        return math.prod(n for j, n in enumerate(self.shape) if j != i) * self.itemsize

    def span_nbytes(self) -> tuple[int, int]:
        """``[first, last)`` byte offsets this view touches in its region."""
        last = self.offset_nbytes + sum((n - 1) * s for n, s in zip(self.shape, self.strides_nbytes))
        return self.offset_nbytes, last + self.itemsize
