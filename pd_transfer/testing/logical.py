"""The full logical tensors of a world: what every shard is a slice of.

For every tensor key registered on both sides, the oracle invents one
*logical* tensor of random bytes with the shard axis at its global extent.
Every prefill view holds a slice of it (its own shard ranges) and every decode
view must end up holding another slice of it (the decode shard ranges) at the
requested indices.

Axes are matched by *name*, not position, because two sides may order them
differently (HND ``[page, head, token, dim]`` against page_first
``[page, token, head, dim]``). The index axis is matched by role: requests
address it, and its extent differs between pools.

Imports numpy and the layout description only; never the planner,
reconciliation, lowering or sharding modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.layout.views import AxisRole, TensorView
from pd_transfer.testing.shards import shard_positions, view_shard


@dataclass(frozen=True, eq=False)
class LogicalTensor:
    """One tensor at full (unsharded) extent.

    ``data`` is ``uint8`` with shape ``(index_count, *other axes, itemsize)``;
    ``axis_names`` names every axis but the trailing byte axis, index first,
    the rest in the reference prefill view's order. ``shard_axis`` is the
    position of the shard axis in ``axis_names`` (None: replicated tensor).
    """

    key: tuple
    path: str
    dtype: str
    axis_names: tuple[str, ...]
    shard_axis: int | None
    data: np.ndarray

    @property
    def index_count(self) -> int:
        return int(self.data.shape[0])

    def token_axis(self, view: TensorView) -> int:
        """Position in ``axis_names`` of ``view``'s token axis (a token-paged view)."""
        return self.axis_names.index(view.axes[view.axis_of(AxisRole.TOKEN)].name)

    def page_size(self, view: TensorView) -> int:
        """Tokens per page of the prefill tensor (its token axis' extent)."""
        return int(self.data.shape[self.token_axis(view)])

    def slice_for(self, view: TensorView, indices: np.ndarray | None = None) -> np.ndarray:
        """What ``view`` holds (or should hold) of this tensor, in logical axis order.

        ``indices`` selects items along the index axis first (all when None);
        the shard axis is then cut to the view's ranges, group by group.
        """
        data = self.data if indices is None else self.data[indices]
        if self.shard_axis is None:
            return data
        return np.take(data, shard_positions(view_shard(view)), axis=self.shard_axis)


def make_logical(view: TensorView, rng: np.random.Generator) -> LogicalTensor:
    """A random logical tensor shaped after the reference (prefill) view ``view``."""
    index_axis = view.axis_of(AxisRole.INDEX)
    names = [view.axes[index_axis].name]
    shape = [view.shape[index_axis]]
    shard_axis = None
    for j, axis in enumerate(view.axes):
        if j == index_axis:
            continue
        if axis.role is AxisRole.SHARD:
            shard_axis = len(names)
            shape.append(view_shard(view).global_extent)
        else:
            shape.append(view.shape[j])
        names.append(axis.name)
    shape.append(view.itemsize)
    nbytes = int(np.prod(shape, dtype=np.int64))
    data = np.frombuffer(rng.bytes(nbytes), dtype=np.uint8).reshape(shape).copy()
    return LogicalTensor(view.key, view.path, view.dtype, tuple(names), shard_axis, data)


def axis_order(
    view: TensorView, logical: LogicalTensor, *, same_index_count: bool, rank_id: str
) -> tuple[int, ...]:
    """For each logical axis, the view axis that holds it; raises if they do not pair.

    ``same_index_count`` demands the view's index extent equal the logical one
    (true for prefill views, which all share the prefill index space) and
    its token extent too: a decode view may hold pages of another size.
    """
    problems = []
    if view.dtype != logical.dtype:
        problems.append(f"dtype {view.dtype}, but the prefill tensor is {logical.dtype}")
    view_names = {a.name for j, a in enumerate(view.axes) if a.role is not AxisRole.INDEX}
    if view_names != set(logical.axis_names[1:]) or len(view.axes) != len(logical.axis_names):
        problems.append(
            f"axes {[a.name for a in view.axes]}, but the prefill tensor has {list(logical.axis_names)}"
        )
        _raise(view, rank_id, problems)
    order = [view.axis_of(AxisRole.INDEX)]
    if same_index_count and view.shape[order[0]] != logical.index_count:
        problems.append(f"{view.shape[order[0]]} index items, other prefill ranks have {logical.index_count}")
    for position, name in enumerate(logical.axis_names[1:], start=1):
        j = view.axis_named(name)
        order.append(j)
        if view.axes[j].role is AxisRole.TOKEN and not same_index_count:
            continue  # decode pages may hold another number of tokens
        problems += _axis_problems(view, j, logical, position)
    if problems:
        _raise(view, rank_id, problems)
    return tuple(order)


def _axis_problems(view: TensorView, j: int, logical: LogicalTensor, position: int) -> list[str]:
    name = logical.axis_names[position]
    want = int(logical.data.shape[position])
    is_shard = view.axes[j].role is AxisRole.SHARD
    if position == logical.shard_axis:
        if not is_shard or view.shard is None:
            return [f"axis {name!r} is sharded on prefill but not on this view"]
        if view.shard.global_extent != want:
            return [f"axis {name!r} has global extent {view.shard.global_extent}, prefill {want}"]
        return []
    if is_shard:
        return [f"axis {name!r} is sharded here but not on the prefill tensor"]
    if view.shape[j] != want:
        return [f"axis {name!r} has extent {view.shape[j]}, prefill {want}"]
    return []


def _raise(view: TensorView, rank_id: str, problems: list[str]) -> None:
    lines = [f"{rank_id} {view.path} does not pair with its prefill tensor:"]
    lines += [f"  - {p}" for p in problems]
    raise GeometryError("\n".join(lines), code=Reason.AXES_MISMATCH)
