"""A plan as the RDMA-style engines take it: absolute addresses, checked, joined, batched.

Mooncake's transfer engine and NIXL address memory by absolute virtual
address, not by region and offset. :func:`lower_to_addresses` turns a plan
into three arrays (source address, destination address, length) after

- bounds-checking every piece against both sides' registered region sizes
  (:func:`pd_transfer.transport.copy.bounds.check_bounds`): an engine writes
  wherever it is told, so nothing out of bounds may ever reach it;
- joining runs that continue each other on *both* sides (consecutive pages
  of a contiguous pool become one descriptor), without a Python loop.

:func:`batches` then cuts the descriptors into submissions of at most
``max_descriptors`` each: Mooncake's tcp path rejects a batch once its
per-peer queue (about 2,048 transfers) is full, and a partly rejected batch
keeps writing in the background with no way to cancel it.

Pure numpy; no engine is imported here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.copy.bounds import check_bounds
from pd_transfer.transport.copy.runs import expand, flatten
from pd_transfer.transport.regions import Regions, map_one


@dataclass(frozen=True)
class AddressRuns:
    """Descriptors in plan order: copy ``nbytes[i]`` from ``src_addr[i]`` to ``dst_addr[i]``."""

    src_addr: np.ndarray  # uint64
    dst_addr: np.ndarray  # uint64
    nbytes: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_nbytes(self) -> int:
        return int(self.nbytes.sum())

    def take(self, index: slice) -> AddressRuns:
        return AddressRuns(self.src_addr[index], self.dst_addr[index], self.nbytes[index])


def lower_to_addresses(
    plan,
    src_bases: Mapping[str, tuple[int, int]],
    dst_bases: Mapping[str, tuple[int, int]],
    where: str = "plan",
    *,
    dst_sizes: Mapping[str, int] | None = None,
) -> AddressRuns:
    """``plan`` as absolute-address descriptors; raises before anything is submitted.

    ``src_bases`` and ``dst_bases`` map a region id to ``(address, nbytes)``.
    ``dst_sizes`` (the sizes the peer registered in its geometry) bounds the
    destination more tightly when given: a region is checked against the
    smaller of the two sizes.
    """
    flat = flatten(plan)
    src_sizes = {r: n for r, (_, n) in src_bases.items()}
    sizes = {r: n for r, (_, n) in dst_bases.items()}
    if dst_sizes is not None:
        sizes = {r: min(n, int(dst_sizes[r])) for r, n in sizes.items() if r in dst_sizes}
    check_bounds(flat, src_sizes, sizes, where)
    runs = expand(flat)
    if not len(runs):
        empty = np.zeros(0, np.uint64)
        return AddressRuns(empty, empty, np.zeros(0, np.int64))
    src_base = np.array([src_bases[b.src_region][0] for b in flat.batches], np.uint64)
    dst_base = np.array([dst_bases[b.dst_region][0] for b in flat.batches], np.uint64)
    src_addr = src_base[runs.batch] + runs.src_offset.astype(np.uint64)
    dst_addr = dst_base[runs.batch] + runs.dst_offset.astype(np.uint64)
    return join(AddressRuns(src_addr, dst_addr, runs.nbytes.astype(np.int64, copy=False)))


def join(runs: AddressRuns) -> AddressRuns:
    """Merge neighbours where the next run starts right where this one ends, on both sides.

    Runs ``(src=100, dst=900, n=16)`` and ``(src=116, dst=916, n=16)`` become
    ``(src=100, dst=900, n=32)``; ``(src=132, dst=2000, n=16)`` stays apart.
    """
    n = len(runs)
    if n < 2:
        return runs
    ends_src = runs.src_addr[:-1] + runs.nbytes[:-1].astype(np.uint64)
    ends_dst = runs.dst_addr[:-1] + runs.nbytes[:-1].astype(np.uint64)
    continues = (runs.src_addr[1:] == ends_src) & (runs.dst_addr[1:] == ends_dst)
    if not continues.any():
        return runs
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return AddressRuns(runs.src_addr[starts], runs.dst_addr[starts], np.add.reduceat(runs.nbytes, starts))


def split_long(runs: AddressRuns, max_run_nbytes: int) -> AddressRuns:
    """Cut runs longer than ``max_run_nbytes`` into pieces of at most that (order kept)."""
    if not len(runs) or int(runs.nbytes.max()) <= max_run_nbytes:
        return runs
    pieces = -(-runs.nbytes // max_run_nbytes)
    owner = np.repeat(np.arange(len(runs)), pieces)
    step = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    offset = (step * max_run_nbytes).astype(np.uint64)
    nbytes = np.minimum(runs.nbytes[owner] - step * max_run_nbytes, max_run_nbytes)
    return AddressRuns(runs.src_addr[owner] + offset, runs.dst_addr[owner] + offset, nbytes)


def batches(runs: AddressRuns, max_descriptors: int) -> Iterator[AddressRuns]:
    """Consecutive slices of at most ``max_descriptors`` descriptors."""
    if max_descriptors < 1:
        raise TransportError(
            f"max_descriptors must be at least 1, got {max_descriptors}", code=Reason.INVALID_CONFIG
        )
    for start in range(0, len(runs), max_descriptors):
        yield runs.take(slice(start, start + max_descriptors))


def region_bases(regions: Regions, side: str) -> dict[str, tuple[int, int]]:
    """``{region: (address, nbytes)}`` of CPU regions, each validated as a flat uint8 buffer."""
    out: dict[str, tuple[int, int]] = {}
    for region_id, memory in regions.items():
        array = map_one(region_id, memory, side).array
        out[region_id] = (int(array.ctypes.data), int(array.nbytes))
    return out
