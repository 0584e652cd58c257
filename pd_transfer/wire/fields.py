"""Field kinds: how one typed value is written to and read from plain msgpack data.

Each kind knows its wire form (``encode``), how to check and convert a value
a peer sent (``decode``, given the field's path for the error message), and
a short ``description`` used in errors and generated docs. A :class:`Record`
is a map of named :class:`Field` s decoded into a frozen dataclass; messages,
registrations and their parts are all records, so every field of every frame
is checked the same way and every error names its field msgspec-style:

    at $.register.geometry.views[2].strides_nbytes: expected list of int, got str

Decoding is lenient only where the protocol evolves: unknown map keys are
ignored (a newer minor version may add fields, always with defaults), and an
unknown reason code becomes ``unrecognized_reason``. Everything else is
strict: ``True`` is not an int, ``1.5`` is not an int, a missing field
without a default is an error.

Every framing of the project (the protocol, the handshake, the tcp data
plane, the staging channel) reads its fields with these kinds; their caps come
from :mod:`pd_transfer.wire.limits`.

Pure; imports only the standard library and ``pd_transfer.errors``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pd_transfer.errors import PdTransferError, ProtocolError, Reason
from pd_transfer.wire.limits import (
    MAX_ID_LEN,
    MAX_LIST_LEN,
    MAX_REASON_CODE_LEN,
    MAX_TEXT_LEN,
)

MISSING: Any = object()
INT64_MAX = 2**63 - 1

_TYPE_NAMES = {
    type(None): "nil",
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    bytes: "bytes",
    list: "list",
    dict: "map",
}


def type_name(value: Any) -> str:
    """The msgpack name of a decoded value's type (``map``, not ``dict``)."""
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def clip_text(text: str, limit: int = MAX_TEXT_LEN) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    marker = f"... ({len(text) - limit + 40} more characters)"
    return text[: limit - 40] + marker[:40]


def bad_field(path: str, problem: str, code: Reason = Reason.BAD_FIELD) -> ProtocolError:
    return ProtocolError(problem, code=code, path=path)


class FieldKind:
    """Base of all field kinds; subclasses override the three members."""

    description = "value"

    def encode(self, value: Any) -> Any:
        return value

    def decode(self, raw: Any, path: str) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def expected(self, raw: Any, path: str) -> ProtocolError:
        return bad_field(path, f"expected {self.description}, got {type_name(raw)}")


@dataclass(frozen=True)
class Int(FieldKind):
    lo: int = 0
    hi: int = INT64_MAX

    description = "int"

    def decode(self, raw: Any, path: str) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise self.expected(raw, path)
        if not self.lo <= raw <= self.hi:
            raise bad_field(path, f"expected int in [{self.lo}, {self.hi}], got {raw}")
        return raw


@dataclass(frozen=True)
class Float(FieldKind):
    """A finite float >= ``lo``; an int is accepted (other encoders write 0 as int)."""

    lo: float = 0.0

    description = "float"

    def decode(self, raw: Any, path: str) -> float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise self.expected(raw, path)
        value = float(raw)
        if not math.isfinite(value) or value < self.lo:
            raise bad_field(path, f"expected a finite float >= {self.lo}, got {raw!r}")
        return value


@dataclass(frozen=True)
class Bool(FieldKind):
    description = "bool"

    def decode(self, raw: Any, path: str) -> bool:
        if not isinstance(raw, bool):
            raise self.expected(raw, path)
        return raw


@dataclass(frozen=True)
class Str(FieldKind):
    max_len: int = MAX_ID_LEN
    min_len: int = 0

    description = "str"

    def decode(self, raw: Any, path: str) -> str:
        if not isinstance(raw, str):
            raise self.expected(raw, path)
        if not self.min_len <= len(raw) <= self.max_len:
            raise bad_field(
                path, f"expected str of {self.min_len} to {self.max_len} characters, got {len(raw)}"
            )
        return raw


@dataclass(frozen=True)
class EnumOf(FieldKind):
    """An enum member on the wire as its ``.value`` string."""

    cls: type[enum.Enum]

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"{self.cls.__name__} str"

    def encode(self, value: enum.Enum) -> Any:
        return value.value

    def decode(self, raw: Any, path: str) -> enum.Enum:
        if not isinstance(raw, str):
            raise self.expected(raw, path)
        try:
            return self.cls(raw)
        except ValueError:
            known = ", ".join(repr(m.value) for m in self.cls)
            raise bad_field(path, f"expected one of {known}, got {raw[:64]!r}") from None


@dataclass(frozen=True)
class ReasonCode(FieldKind):
    """A :class:`Reason`; a code this version does not know is kept as
    ``unrecognized_reason`` (a newer minor version may add codes)."""

    description = "reason code str"

    def encode(self, value: Reason) -> Any:
        return value.value

    def decode(self, raw: Any, path: str) -> Reason:
        if not isinstance(raw, str) or len(raw) > MAX_REASON_CODE_LEN:
            raise bad_field(
                path,
                f"expected a reason code str of at most {MAX_REASON_CODE_LEN} characters, "
                f"got {type_name(raw)}",
            )
        try:
            return Reason(raw)
        except ValueError:
            return Reason.UNRECOGNIZED_REASON


@dataclass(frozen=True)
class Optional(FieldKind):
    inner: FieldKind

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"{self.inner.description} or nil"

    def encode(self, value: Any) -> Any:
        return None if value is None else self.inner.encode(value)

    def decode(self, raw: Any, path: str) -> Any:
        return None if raw is None else self.inner.decode(raw, path)


@dataclass(frozen=True)
class ListOf(FieldKind):
    """A list decoded into a tuple, at most ``max_len`` items."""

    item: FieldKind
    max_len: int = MAX_LIST_LEN

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"list of {self.item.description}"

    def encode(self, value: Any) -> Any:
        return [self.item.encode(v) for v in value]

    def decode(self, raw: Any, path: str) -> tuple[Any, ...]:
        if not isinstance(raw, list):
            raise self.expected(raw, path)
        if len(raw) > self.max_len:
            raise bad_field(
                path, f"expected at most {self.max_len} items, got {len(raw)}", code=Reason.LIMIT_EXCEEDED
            )
        item = self.item
        if type(item) is Int and all(type(v) is int and item.lo <= v <= item.hi for v in raw):
            return tuple(raw)  # a long index list, checked in one pass; else each item names itself
        return tuple(item.decode(v, f"{path}[{i}]") for i, v in enumerate(raw))


@dataclass(frozen=True)
class Map(FieldKind):
    """A map kept as plain data, for a part that its own codec checks later
    (a worker's geometry, its handles)."""

    description = "map"

    def decode(self, raw: Any, path: str) -> dict[Any, Any]:
        if not isinstance(raw, dict):
            raise self.expected(raw, path)
        return raw


@dataclass(frozen=True)
class TupleOf(FieldKind):
    """A fixed-length list of differently typed items, decoded into a tuple."""

    items: tuple[FieldKind, ...]

    @property
    def description(self) -> str:  # type: ignore[override]
        return "[" + ", ".join(k.description for k in self.items) + "]"

    def encode(self, value: Any) -> Any:
        return [k.encode(v) for k, v in zip(self.items, value)]

    def decode(self, raw: Any, path: str) -> tuple[Any, ...]:
        if not isinstance(raw, list) or len(raw) != len(self.items):
            raise bad_field(path, f"expected {self.description}, got {_shape_of(raw)}")
        return tuple(k.decode(v, f"{path}[{i}]") for i, (k, v) in enumerate(zip(self.items, raw)))


def _shape_of(raw: Any) -> str:
    return f"list of {len(raw)}" if isinstance(raw, list) else type_name(raw)


@dataclass(frozen=True)
class Field:
    name: str
    kind: FieldKind
    default: Any = MISSING


Finish = Callable[[dict[str, Any], dict[str, Any], str], None]


@dataclass(frozen=True)
class Record(FieldKind):
    """A map of named fields decoded into ``cls(**fields)``.

    ``finish(values, raw, path)`` checks invariants across fields (a failed
    Done needs a reason) and may adjust ``values`` before construction;
    ``validate(obj)`` checks the built object as a whole. A
    :class:`PdTransferError` raised by ``cls`` itself (``TensorView`` checks
    its own shape) or by ``validate`` becomes a :class:`ProtocolError` at
    this record's path, keeping its reason code.
    """

    cls: type
    fields: tuple[Field, ...]
    finish: Finish | None = None
    validate: Callable[[Any], None] | None = None

    description = "map"

    def encode(self, value: Any) -> dict[str, Any]:
        return {f.name: f.kind.encode(getattr(value, f.name)) for f in self.fields}

    def decode(self, raw: Any, path: str) -> Any:
        if not isinstance(raw, dict):
            raise self.expected(raw, path)
        values = {f.name: read_field(raw, f, path) for f in self.fields}
        if self.finish is not None:
            self.finish(values, raw, path)
        try:
            built = self.cls(**values)
            if self.validate is not None:
                self.validate(built)
        except PdTransferError as exc:
            raise ProtocolError(exc.message, code=exc.code, path=path) from None
        return built


def read_field(raw: dict[str, Any], field: Field, path: str) -> Any:
    """``field`` of the map ``raw`` at ``path``, decoded; its default when absent."""
    item = raw.get(field.name, MISSING)
    if item is MISSING:
        if field.default is MISSING:
            raise bad_field(f"{path}.{field.name}", "missing required field")
        return field.default
    return field.kind.decode(item, f"{path}.{field.name}")
