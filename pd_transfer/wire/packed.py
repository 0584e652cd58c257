"""Byte-valued field kinds: packed integer tables and fixed or capped blobs.

Index lists and checksums travel as packed little-endian bytes (8 or 4 bytes
a value, no per-item msgpack header); nonces and proofs as exact-size blobs;
a data-plane chunk's runs as a table of int64 rows. Errors name the field
path like every kind of :mod:`pd_transfer.wire.fields`.

Pure; imports only the standard library and ``pd_transfer.errors``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from pd_transfer.errors import Reason
from pd_transfer.wire.fields import INT64_MAX, FieldKind, Int, ListOf, bad_field
from pd_transfer.wire.limits import MAX_CHECKSUM_TENSORS, MAX_INDICES


@dataclass(frozen=True)
class Indices(FieldKind):
    """Page, slot or row indices: a tuple of ints in ``[0, hi]``.

    Encoded as packed little-endian int64 bytes (8 bytes an index, no per-item
    msgpack header, so 64k pages are 512 KB). A list of ints is accepted too,
    up to ``max_list_len`` items, for peers that cannot pack.
    """

    max_len: int = MAX_INDICES
    hi: int = 2**40

    description = "list of int or packed int64 bytes"

    def encode(self, value: Any) -> Any:
        return struct.pack(f"<{len(value)}q", *value)

    def decode(self, raw: Any, path: str) -> tuple[int, ...]:
        if isinstance(raw, bytes):
            if len(raw) % 8:
                raise bad_field(
                    path, f"expected packed int64 bytes, got {len(raw)} bytes (not a multiple of 8)"
                )
            values = struct.unpack(f"<{len(raw) // 8}q", raw)
        elif isinstance(raw, list):
            values = ListOf(Int(lo=-INT64_MAX - 1), self.max_len).decode(raw, path)
        else:
            raise self.expected(raw, path)
        if len(values) > self.max_len:
            raise bad_field(
                path,
                f"expected at most {self.max_len} indices, got {len(values)}",
                code=Reason.LIMIT_EXCEEDED,
            )
        if values and not 0 <= min(values) <= max(values) <= self.hi:
            bad = next(i for i, v in enumerate(values) if not 0 <= v <= self.hi)
            raise bad_field(f"{path}[{bad}]", f"expected an index in [0, {self.hi}], got {values[bad]}")
        return values


@dataclass(frozen=True)
class Checksums(FieldKind):
    """CRC32 values: a tuple of ints in ``[0, 2**32)``, packed little-endian
    uint32 bytes on the wire (4 bytes each), at most ``max_len``."""

    max_len: int = MAX_CHECKSUM_TENSORS

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"packed little-endian uint32 bytes, at most {self.max_len} values"

    def encode(self, value: Any) -> Any:
        return struct.pack(f"<{len(value)}I", *value)

    def decode(self, raw: Any, path: str) -> tuple[int, ...]:
        if not isinstance(raw, bytes):
            raise self.expected(raw, path)
        if len(raw) % 4:
            raise bad_field(path, f"expected packed uint32 bytes, got {len(raw)} bytes (not a multiple of 4)")
        if len(raw) // 4 > self.max_len:
            raise bad_field(
                path,
                f"expected at most {self.max_len} checksums, got {len(raw) // 4}",
                code=Reason.LIMIT_EXCEEDED,
            )
        return struct.unpack(f"<{len(raw) // 4}I", raw)


@dataclass(frozen=True)
class Bytes(FieldKind):
    """At most ``max_len`` bytes, a multiple of ``multiple_of`` (24 for a table
    of three int64 columns)."""

    max_len: int
    multiple_of: int = 1

    description = "bytes"

    def decode(self, raw: Any, path: str) -> bytes:
        if not isinstance(raw, bytes):
            raise self.expected(raw, path)
        if len(raw) > self.max_len:
            raise bad_field(
                path, f"expected at most {self.max_len} bytes, got {len(raw)}", code=Reason.LIMIT_EXCEEDED
            )
        if len(raw) % self.multiple_of:
            raise bad_field(path, f"expected a multiple of {self.multiple_of} bytes, got {len(raw)}")
        return raw


@dataclass(frozen=True)
class Blob(FieldKind):
    """Exactly ``nbytes`` bytes (a nonce, an HMAC)."""

    nbytes: int

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"{self.nbytes} bytes"

    def decode(self, raw: Any, path: str) -> bytes:
        if not isinstance(raw, bytes):
            raise self.expected(raw, path)
        if len(raw) != self.nbytes:
            raise bad_field(path, f"expected {self.nbytes} bytes, got {len(raw)}")
        return raw
