"""Decoding limits: how big a frame from a peer may be, in every dimension.

A peer is untrusted. Before a frame is turned into objects, its size is
checked; while msgpack unpacks it, string, binary, list and map lengths are
capped by msgpack's own ``max_*_len`` options; after unpacking, the nesting
depth is measured. Field-level bounds (a region may not exceed 2**48 bytes, a
registration may not list more than 8192 tensor views) sit next to the fields
that use them, in :mod:`fields` and :mod:`geometry_codec`.

Pure; imports only the standard library and ``pd_transfer.errors``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_transfer.errors import ProtocolError, Reason


@dataclass(frozen=True)
class Limits:
    """Caps enforced while decoding one frame.

    The defaults fit the largest message we expect: a DeepSeek-V3 registration
    is about 30 KB, and a transfer request for 64k pages is 512 KB packed.
    Index lists travel as packed int64 bytes, so ``max_list_len`` can stay
    small while a request still addresses millions of pages.
    """

    max_frame_nbytes: int = 16 * 1024 * 1024
    max_list_len: int = 65536
    max_map_len: int = 256
    max_str_len: int = 8192
    max_depth: int = 16

    def unpack_options(self) -> dict[str, Any]:
        """Keyword arguments for ``msgpack.unpackb``."""
        return {
            "raw": False,  # str -> str; invalid UTF-8 is an error
            "strict_map_key": True,  # map keys must be str or bytes
            "use_list": True,
            "max_str_len": self.max_str_len,
            "max_bin_len": self.max_frame_nbytes,
            "max_array_len": self.max_list_len,
            "max_map_len": self.max_map_len,
            "max_ext_len": 0,  # no msgpack extension types on our wire
        }


DEFAULT_LIMITS = Limits()

#: integrity checksums in one Done, per pool: one per destination index (as
#: many as a request may name) and one per tensor piece
MAX_CHECKSUM_ITEMS = 1 << 22
MAX_CHECKSUM_TENSORS = 1 << 16


def check_depth(value: Any, max_depth: int) -> None:
    """Raise ``limit_exceeded`` if ``value`` nests lists/maps deeper than ``max_depth``.

    The top-level map is depth 1: ``{"t": "hello", "x": [[1]]}`` has depth 3.
    Iterative, so a hostile frame cannot exhaust the Python stack.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise ProtocolError(
                f"frame nests deeper than {max_depth} levels", code=Reason.LIMIT_EXCEEDED, path="$"
            )
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
