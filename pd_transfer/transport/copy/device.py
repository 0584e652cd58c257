"""Executing a plan between torch tensors on any device (CUDA included).

The CPU copy engine scatters with numpy; device memory needs torch: view
both regions as rows of the largest size dividing every offset and length,
gather the source rows with ``index_select`` and scatter them with
``index_copy_`` on the device, chunk by chunk. A plan of a few hundred runs
(a 1-page room) is copied run by run instead, one slice ``copy_`` (a
device memcpy) each. Every run is bounds-checked against both regions first
(nothing moves if one is out of bounds). A region may also come as a numpy
array (host memory a sidecar mapped without torch): it is viewed as a
tensor, not copied.

CUDA kernels run asynchronously: the executor synchronizes every device it
wrote to before returning, so "returned" means "landed" (decode may report
Success and its worker read the pages at once).
"""

from __future__ import annotations

import numpy as np

from pd_transfer.transport.copy.bounds import check_bounds
from pd_transfer.transport.copy.runs import expand_batch, flatten, row_nbytes_for, rows_of

_ROW_CAP = 1 << 16
_CHUNK_ROWS = 1 << 16
# up to this many runs (a 1-page room is 64), one slice copy each: a device-to-device
# memcpy per run costs less than the index uploads and two kernels per batch below
_PER_RUN_MAX = 256


def execute_on_device(plan, src_regions: dict, dst_regions: dict, *, per_run_max: int = _PER_RUN_MAX) -> int:
    """Copy every run of ``plan``; returns the bytes copied."""
    import torch

    src_regions, dst_regions = as_tensors(src_regions), as_tensors(dst_regions)
    flat = flatten(plan)
    check_bounds(
        flat,
        {k: int(v.numel()) for k, v in src_regions.items()},
        {k: int(v.numel()) for k, v in dst_regions.items()},
    )
    if int(flat.count.sum()) <= per_run_max:
        total = _copy_each_run(plan, src_regions, dst_regions)
        _synchronize(dst_regions)
        return total
    total = 0
    for index, batch in enumerate(plan.batches):
        runs = expand_batch(batch, index)
        if len(runs) == 0:
            continue
        src, dst = src_regions[batch.src_region], dst_regions[batch.dst_region]
        row = row_nbytes_for(runs.src_offset, runs.dst_offset, runs.nbytes, cap=_ROW_CAP)
        src_rows = src[: src.numel() // row * row].view(-1, row)
        dst_rows = dst[: dst.numel() // row * row].view(-1, row)
        src_idx = rows_of(runs.src_offset, runs.nbytes, row)
        dst_idx = rows_of(runs.dst_offset, runs.nbytes, row)
        for start in range(0, len(src_idx), _CHUNK_ROWS):
            s = torch.from_numpy(np.ascontiguousarray(src_idx[start : start + _CHUNK_ROWS])).to(src.device)
            d = torch.from_numpy(np.ascontiguousarray(dst_idx[start : start + _CHUNK_ROWS])).to(dst.device)
            dst_rows.index_copy_(0, d, src_rows.index_select(0, s).to(dst.device))
        total += int(runs.nbytes.sum())
    _synchronize(dst_regions)
    return total


def as_tensors(regions: dict) -> dict:
    """``regions`` with every numpy array viewed as a torch tensor (same memory)."""
    if not any(isinstance(memory, np.ndarray) for memory in regions.values()):
        return regions
    import torch

    return {
        region_id: torch.from_numpy(memory) if isinstance(memory, np.ndarray) else memory
        for region_id, memory in regions.items()
    }


def _copy_each_run(plan, src_regions: dict, dst_regions: dict) -> int:
    total = 0
    for index, batch in enumerate(plan.batches):
        runs = expand_batch(batch, index)
        src, dst = src_regions[batch.src_region], dst_regions[batch.dst_region]
        for s, d, n in zip(runs.src_offset.tolist(), runs.dst_offset.tolist(), runs.nbytes.tolist()):
            dst[d : d + n].copy_(src[s : s + n])
            total += n
    return total


def _synchronize(regions: dict) -> None:
    import torch

    for device in {t.device for t in regions.values() if t.is_cuda}:
        torch.cuda.synchronize(device)
