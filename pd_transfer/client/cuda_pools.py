"""A GPU worker's pools as CUDA tensors, shared with its sidecar through CUDA IPC.

:func:`allocate_cuda_pools` allocates, for every region of a rank's
geometry, one zero-filled uint8 CUDA tensor of exactly the region's size.
:attr:`CudaPools.handles` is what ``register`` sends: region id -> a
``cuda-ipc:`` handle string (:mod:`pd_transfer.memory.cuda_ipc`), which the sidecar
opens to read or write the same device memory in place; a same-host peer
sidecar opens it too and copies device to device.

An engine that already owns its KV tensors registers them with
:func:`pd_transfer.memory.cuda_ipc.share` directly (one handle per tensor's
storage); this class is what the tests and simulated workers use.

The tensors belong to the worker and must outlive every sidecar mapping of
them: close the pools (or leave the ``with`` block) only after the sidecar
was told to drop the regions or has stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.memory import cuda_ipc


@dataclass(eq=False)
class CudaPools:
    """The CUDA tensors of one rank, by region id."""

    geometry: RankGeometry
    tensors: dict[str, Any]
    _handles: dict[str, str] = field(default_factory=dict)

    @property
    def handles(self) -> dict[str, str]:
        """Region id -> CUDA IPC handle: the ``handles`` of ``register``."""
        if not self._handles:
            self._handles = {rid: cuda_ipc.share(t) for rid, t in self.tensors.items()}
        return dict(self._handles)

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel()) for t in self.tensors.values())

    def close(self) -> None:
        """Drop the tensors (the caching allocator frees them). Idempotent."""
        self.tensors, self._handles = {}, {}

    def __enter__(self) -> CudaPools:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def allocate_cuda_pools(geometry: RankGeometry, device: Any = "cuda") -> CudaPools:
    """One zero-filled uint8 CUDA tensor per region of ``geometry``, on ``device``.

    Raises :class:`~pd_transfer.errors.PdTransferError` (``bad_field``) when
    there is no CUDA device.
    """
    if not cuda_ipc.cuda_available():
        raise PdTransferError(
            "CUDA pools need a CUDA device and a CUDA build of torch",
            code=Reason.BAD_FIELD,
            hint="use allocate_pools (shared memory) on CPU",
        )
    import torch

    tensors = {
        region.id: torch.zeros(region.nbytes, dtype=torch.uint8, device=device) for region in geometry.regions
    }
    return CudaPools(geometry, tensors)
