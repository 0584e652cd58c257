"""Worker API frames on a byte stream: the ``unix://`` endpoint's framing.

On a ``unix://PATH`` worker endpoint (a plain Unix stream socket instead of
ZeroMQ ``ipc://``) each worker API request and reply travels as a 4-byte
little-endian length followed by that many bytes of msgpack. The length is
checked before anything is read into memory: a header announcing more than
:data:`MAX_FRAME_NBYTES` is refused with ``frame_too_large``, and the
connection is closed, since the stream cannot be resynchronised after it.

Sans-IO: no sockets here.
"""

from __future__ import annotations

import struct

from pd_transfer.errors import Reason
from pd_transfer.protocol.worker_api import WorkerApiError
from pd_transfer.wire.limits import MAX_WORKER_REQUEST_NBYTES

HEADER = struct.Struct("<I")
MAX_FRAME_NBYTES = MAX_WORKER_REQUEST_NBYTES
UNIX_SCHEME = "unix://"


def pack(frame: bytes) -> bytes:
    """``frame`` with its length header, ready to write."""
    if len(frame) > MAX_FRAME_NBYTES:
        raise WorkerApiError(
            f"frame of {len(frame)} bytes exceeds {MAX_FRAME_NBYTES}", code=Reason.FRAME_TOO_LARGE
        )
    return HEADER.pack(len(frame)) + frame


def frame_length(header: bytes) -> int:
    """The length a header announces; WorkerApiError ``frame_too_large`` over the bound."""
    nbytes: int
    (nbytes,) = HEADER.unpack(header)
    if nbytes > MAX_FRAME_NBYTES:
        raise WorkerApiError(
            f"a frame header announces {nbytes} bytes, more than the "
            f"{MAX_FRAME_NBYTES} a worker frame may have; closing the connection",
            code=Reason.FRAME_TOO_LARGE,
        )
    return nbytes


def unix_path(endpoint: str) -> str | None:
    """The socket path of a ``unix://PATH`` endpoint (None for any other scheme).

    ValueError for an empty path or one longer than a Unix socket address
    holds (107 bytes on Linux), naming the endpoint.
    """
    if not endpoint.startswith(UNIX_SCHEME):
        return None
    path = endpoint[len(UNIX_SCHEME) :]
    if not path:
        raise ValueError(f"{endpoint!r}: a unix:// endpoint needs a path, e.g. unix:///run/pd/worker.sock")
    if len(path.encode()) > 107:
        raise ValueError(
            f"{endpoint!r}: the socket path is {len(path.encode())} bytes, more than the "
            f"107 a Unix socket address holds; use a shorter directory"
        )
    return path
