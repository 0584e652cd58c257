"""How the generated docs describe the wire's field kinds: one phrase per kind
(``int in [0, 2^64-1]``, ``list (at most 4096) of str``), one table per record.

Used by :mod:`pd_transfer.docgen.generate`; reads the kinds themselves
(:mod:`pd_transfer.wire.fields`, :mod:`pd_transfer.wire.packed`), never a copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from pd_transfer.docgen.markdown import github_anchor, markdown_table, readable_number
from pd_transfer.wire import fields as kinds
from pd_transfer.wire import packed


def describe_kind(kind: kinds.FieldKind) -> str:
    """A field kind with its bounds, for a field table."""
    if isinstance(kind, kinds.Int):
        return f"int in [{readable_number(kind.lo)}, {readable_number(kind.hi)}]"
    if isinstance(kind, kinds.Float):
        return f"float >= {kind.lo:g}, finite"
    if isinstance(kind, kinds.Str):
        low = f"{kind.min_len}-" if kind.min_len else "up to "
        return f"str, {low}{kind.max_len} chars"
    if isinstance(kind, kinds.EnumOf):
        return "one of " + ", ".join(f"`{m.value}`" for m in kind.cls)
    if isinstance(kind, kinds.ReasonCode):
        return "[reason code](errors.md#reason-codes) str"
    if isinstance(kind, kinds.Optional):
        return f"{describe_kind(kind.inner)}, or nil"
    if isinstance(kind, kinds.ListOf):
        return f"list (at most {readable_number(kind.max_len)}) of {describe_kind(kind.item)}"
    if isinstance(kind, kinds.TupleOf):
        return "[" + "; ".join(describe_kind(k) for k in kind.items) + "]"
    if isinstance(kind, packed.Indices):
        return (
            f"indices in [0, {readable_number(kind.hi)}], at most {readable_number(kind.max_len)}: packed "
            "little-endian int64 bytes, or a list of int"
        )
    if isinstance(kind, kinds.Record):
        name = kind.cls.__name__
        return f"map [{name}](#{github_anchor(name)})"
    return kind.description


def _default(field: kinds.Field) -> str:
    if field.default is kinds.MISSING:
        return "required"
    if field.default is None:
        return "`nil`"
    try:
        return "`" + json.dumps(field.kind.encode(field.default)) + "`"
    except (TypeError, ValueError):
        return f"`{field.default!r}`"


def nested_records(kind: kinds.FieldKind) -> Iterator[kinds.Record]:
    """Records reachable from ``kind`` (a list of views, an optional shard, ...)."""
    if isinstance(kind, kinds.Record):
        yield kind
    elif isinstance(kind, kinds.Optional):
        yield from nested_records(kind.inner)
    elif isinstance(kind, kinds.ListOf):
        yield from nested_records(kind.item)
    elif isinstance(kind, kinds.TupleOf):
        for item in kind.items:
            yield from nested_records(item)


def field_table(record: kinds.Record) -> str:
    rows = [(f"`{f.name}`", describe_kind(f.kind), _default(f)) for f in record.fields]
    return markdown_table(("Field", "Kind", "Default"), rows)
