"""CUDA tensors shared between processes through CUDA IPC handles.

A GPU worker allocates its KV pools as CUDA tensors and publishes, per region,
a handle string ``cuda-ipc:<base64 msgpack>``; its sidecar (and a same-host
peer) opens the handle and gets a uint8 CUDA tensor over the same device
memory. The handle is encoded with msgpack, never pickle: a peer's handle
arrives from the network, and unpickling it would run the peer's code.

torch is imported lazily so CPU-only processes never pay for CUDA setup.
"""

from __future__ import annotations

import base64
from typing import Any

from pd_transfer.errors import PdTransferError, ProtocolError, Reason
from pd_transfer.wire.envelope import pack, unpack
from pd_transfer.wire.limits import CUDA_IPC_HANDLE_LIMITS, MAX_CUDA_IPC_HANDLE_LEN

PREFIX = "cuda-ipc:"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def is_cuda_handle(handle: str) -> bool:
    return handle.startswith(PREFIX)


def share(tensor: Any) -> str:
    """The IPC handle string of a CUDA tensor's storage (whole storage, uint8 view)."""
    if not tensor.is_cuda:
        raise PdTransferError("only CUDA tensors have CUDA IPC handles", code=Reason.BAD_FIELD)
    fields = tensor.untyped_storage()._share_cuda_()
    packed = pack(
        [
            int(fields[0]),
            bytes(fields[1]),
            int(fields[2]),
            int(fields[3]),
            bytes(fields[4]),
            int(fields[5]),
            bytes(fields[6]),
            bool(fields[7]),
        ]
    )
    return PREFIX + base64.b64encode(packed).decode()


def open_handle(handle: str, min_nbytes: int) -> Any:
    """A uint8 CUDA tensor over the memory behind ``handle`` (checked, never unpickled)."""
    import torch

    fields = _decode(handle)
    torch.cuda.init()  # opening a handle before CUDA is initialized crashes the process
    try:
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
    except RuntimeError as err:
        raise PdTransferError(
            f"cannot open CUDA IPC handle: {err}".splitlines()[0],
            code=Reason.REGION_INVALID,
            hint="the peer must be on this host and keep its tensors alive",
        ) from None
    if storage.nbytes() < min_nbytes:
        raise PdTransferError(
            f"CUDA IPC region holds {storage.nbytes()} bytes but {min_nbytes} are registered",
            code=Reason.REGION_INVALID,
        )
    device = torch.device("cuda", fields[0])
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _decode(handle: str) -> list:
    if not is_cuda_handle(handle) or len(handle) > MAX_CUDA_IPC_HANDLE_LEN:
        raise PdTransferError("not a CUDA IPC handle", code=Reason.BAD_FIELD)
    try:
        fields = unpack(base64.b64decode(handle[len(PREFIX) :], validate=True), CUDA_IPC_HANDLE_LIMITS)
    except (ValueError, ProtocolError):  # binascii.Error is a ValueError
        raise PdTransferError("malformed CUDA IPC handle", code=Reason.BAD_FIELD) from None
    kinds = (int, bytes, int, int, bytes, int, bytes, bool)
    if (
        not isinstance(fields, list)
        or len(fields) != len(kinds)
        or not all(isinstance(v, k) and (k is bool or not isinstance(v, bool)) for v, k in zip(fields, kinds))
    ):
        raise PdTransferError("malformed CUDA IPC handle fields", code=Reason.BAD_FIELD)
    return fields
