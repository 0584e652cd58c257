"""A rank's geometry as plain data, for the Register message.

:data:`GEOMETRY` is the :class:`~fields.Record` of a
:class:`~pd_transfer.layout.geometry.RankGeometry`: regions, tensor views
(with axes and shard spec), TP/PP position, page size, model name. Decoding a
peer's registration is strict, in three steps, each failing with the path of
the field at fault:

1. types, enum values and size caps per field (no region over 2**48 bytes,
   at most 8192 views, at most 8 axes a view, ...);
2. the dataclasses' own checks (``TensorView.__post_init__`` refuses a view
   whose shape, strides and axes disagree): ``at $.register.geometry.views[4]:
   kv.layer[2].k: needs exactly one index axis``;
3. :func:`~pd_transfer.layout.geometry.check_geometry` on the whole rank
   (every view inside its region, canonical shard ranges).

Encoding is the inverse; ``decode(encode(g)) == g``.

Pure; imports the layout layer and :mod:`fields`.
"""

from __future__ import annotations

from typing import Any

from pd_transfer.layout.dtypes import ITEMSIZE_BY_DTYPE
from pd_transfer.layout.geometry import RankGeometry, Region, Role, check_geometry
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, ShardSpec, TensorView
from pd_transfer.wire.fields import (
    Bool,
    EnumOf,
    Field,
    Int,
    ListOf,
    Optional,
    Record,
    Str,
    TupleOf,
    bad_field,
)
from pd_transfer.wire.limits import (
    MAX_ID_LEN,
    MAX_NDIM,
    MAX_REGIONS,
    MAX_SHARD_GROUPS,
    MAX_SHORT_NAME_LEN,
    MAX_VIEWS,
)

MAX_NBYTES = 2**48  # 256 TiB: larger than any memory a worker registers
MAX_EXTENT = 2**40  # elements along one axis
MAX_TP_SIZE = 4096
MAX_PP_SIZE = 1024
MAX_PAGE_SIZE = 1 << 20
MAX_LAYER_ID = 1 << 20
NAME = Str(max_len=MAX_ID_LEN, min_len=1)


def _check_dtype(values: dict[str, Any], raw: dict[str, Any], path: str) -> None:
    """Name the dtype field itself, rather than the whole view, when it is unknown."""
    if values["dtype"] not in ITEMSIZE_BY_DTYPE:
        known = ", ".join(sorted(ITEMSIZE_BY_DTYPE))
        raise bad_field(f"{path}.dtype", f"expected one of {known}, got {values['dtype']!r}")


def _check_shard_shape(values: dict[str, Any], raw: dict[str, Any], path: str) -> None:
    """One ``[start, end)`` range per group; ShardSpec would silently zip them."""
    if len(values["groups"]) != len(values["ranges"]):
        raise bad_field(
            f"{path}.ranges",
            f"expected one range per group ({len(values['groups'])}), got {len(values['ranges'])}",
        )


AXIS = Record(Axis, (Field("name", NAME), Field("role", EnumOf(AxisRole))))

SHARD = Record(
    ShardSpec,
    (
        Field("groups", ListOf(Int(lo=1, hi=MAX_EXTENT), MAX_SHARD_GROUPS)),
        Field("ranges", ListOf(TupleOf((Int(hi=MAX_EXTENT), Int(hi=MAX_EXTENT))), MAX_SHARD_GROUPS)),
        Field("declared_groups", Bool(), default=False),
    ),
    finish=_check_shard_shape,
)

VIEW = Record(
    TensorView,
    (
        Field("pool", EnumOf(Pool)),
        Field("layer_id", Optional(Int(hi=MAX_LAYER_ID))),
        Field("name", NAME),
        Field("region", NAME),
        Field("offset_nbytes", Int(hi=MAX_NBYTES)),
        Field("dtype", Str(max_len=MAX_SHORT_NAME_LEN)),
        Field("shape", ListOf(Int(lo=1, hi=MAX_EXTENT), MAX_NDIM)),
        Field("strides_nbytes", ListOf(Int(hi=MAX_NBYTES), MAX_NDIM)),
        Field("axes", ListOf(AXIS, MAX_NDIM)),
        Field("shard", Optional(SHARD)),
        Field("layout", EnumOf(Layout)),
    ),
    finish=_check_dtype,
)

REGION = Record(Region, (Field("id", NAME), Field("nbytes", Int(lo=1, hi=MAX_NBYTES))))


GEOMETRY = Record(
    RankGeometry,
    (
        Field("role", EnumOf(Role)),
        Field("tp_size", Int(lo=1, hi=MAX_TP_SIZE)),
        Field("tp_rank", Int(hi=MAX_TP_SIZE)),
        Field("pp_rank", Int(hi=MAX_PP_SIZE), default=0),
        Field("page_size", Int(lo=1, hi=MAX_PAGE_SIZE)),
        Field("model", Str(max_len=MAX_ID_LEN), default=""),
        Field("regions", ListOf(REGION, MAX_REGIONS)),
        Field("views", ListOf(VIEW, MAX_VIEWS)),
    ),
    validate=check_geometry,
)


def geometry_to_data(geometry: RankGeometry) -> dict[str, Any]:
    """Plain msgpack-ready data of ``geometry``."""
    return GEOMETRY.encode(geometry)


def geometry_from_data(raw: Any, path: str = "$") -> RankGeometry:
    """The checked :class:`RankGeometry` of ``raw``, or :class:`ProtocolError` with the path."""
    geometry: RankGeometry = GEOMETRY.decode(raw, path)
    return geometry
