"""A worker's pools in POSIX shared memory: one segment per registered region.

:func:`allocate_pools` creates, for every region of a rank's geometry, a
zero-filled segment of exactly the region's size, named with
:func:`pd_transfer.memory.segments.segment_name`. :attr:`Pools.handles` is what
``register`` sends (region id -> segment name); :attr:`Pools.arrays` and
:attr:`Pools.tensors` are the worker's own numpy / torch uint8 views of the
same memory, which the sidecar maps and reads or writes in place.

The segments belong to the worker: :meth:`Pools.close` (also on leaving a
``with`` block, and on a failure half-way through allocating) unmaps them and
unlinks their names. A sidecar that mapped a segment keeps its mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.memory.segments import Segment, create_segment, segment_name


@dataclass(eq=False)
class Pools:
    """The shared-memory segments of one rank, by region id."""

    geometry: RankGeometry
    owner_id: str
    segments: dict[str, Segment]

    @property
    def handles(self) -> dict[str, str]:
        """Region id -> segment name: the ``handles`` of ``register``."""
        return {region_id: segment.name for region_id, segment in self.segments.items()}

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Region id -> the whole region as a flat writable numpy uint8 array."""
        return {region_id: segment.array for region_id, segment in self.segments.items()}

    @property
    def tensors(self) -> dict:
        """Region id -> the whole region as a flat torch uint8 tensor (same memory)."""
        return {region_id: segment.tensor for region_id, segment in self.segments.items()}

    @property
    def nbytes(self) -> int:
        return sum(segment.nbytes for segment in self.segments.values())

    @property
    def closed(self) -> bool:
        return not self.segments

    def close(self) -> None:
        """Unmap and unlink every segment. Idempotent.

        Drop :attr:`arrays` / :attr:`tensors` views before: a view still held
        keeps its mapping (not its name) alive until it is released.
        """
        segments, self.segments = self.segments, {}
        for segment in segments.values():
            segment.unlink()
            segment.close()

    def __enter__(self) -> Pools:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def allocate_pools(geometry: RankGeometry, owner_id: str) -> Pools:
    """One zero-filled segment per region of ``geometry``, of exactly the region's size.

    ``owner_id`` makes the names unique on the host (include the process id
    when several runs may share it). Raises
    :class:`~pd_transfer.errors.TransportError` (``segment_exists``, ...) after
    removing the segments already created.
    """
    pools = Pools(geometry, owner_id, {})
    try:
        for region in geometry.regions:
            pools.segments[region.id] = create_segment(segment_name(owner_id, region.id), region.nbytes)
    except BaseException:
        pools.close()
        raise
    return pools
