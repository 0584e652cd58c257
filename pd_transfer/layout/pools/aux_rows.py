"""Aux metadata rows: per-request results that ride with the last chunk.

Like SGLang ``MetadataBuffers``: each field is a ``[num_rows, num_elems]``
buffer and a request owns one row index in all of them. Here all fields live
in one region ``aux``, one block after the other; each block starts on a
64-byte boundary so every row of an int64 field is aligned. ``bootstrap_room``
carries the room id and is what the receiver checks to know the row arrived.
Aux views are replicated (no shard) and have no layer.

Pure; imports the layout data modules only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pd_transfer.errors import ConfigError
from pd_transfer.layout.dtypes import itemsize
from pd_transfer.layout.geometry import Region
from pd_transfer.layout.pools.checks import require_dtype, require_positive
from pd_transfer.layout.pools.pool_views import PoolViews
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, TensorView

ROW_AXIS = Axis("row", AxisRole.INDEX)
ELEM_AXIS = Axis("elem", AxisRole.INNER)
BLOCK_ALIGN_NBYTES = 64
AUX_REGION = "aux"


@dataclass(frozen=True)
class AuxField:
    name: str
    dtype: str
    num_elems: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ConfigError(f"aux field name must be an identifier, got {self.name!r}")
        require_dtype(f"aux.{self.name}.dtype", self.dtype)
        require_positive(f"aux.{self.name}.num_elems", self.num_elems)

    @property
    def row_nbytes(self) -> int:
        return self.num_elems * itemsize(self.dtype)


DEFAULT_AUX_FIELDS: tuple[AuxField, ...] = (
    AuxField("output_ids", "int32", 16),
    AuxField("cached_tokens", "int32", 16),
    AuxField("bootstrap_room", "int64", 8),
)


def build_aux_rows(
    num_rows: int, fields: Sequence[AuxField] = DEFAULT_AUX_FIELDS, *, region_id: str = AUX_REGION
) -> PoolViews:
    """One view per field, ``[num_rows, num_elems]`` row-major, in one region."""
    require_positive("num_aux_rows", num_rows)
    names = [f.name for f in fields]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"aux fields must be non-empty and distinct, got {names}")
    views = []
    offset = 0
    for field in fields:
        offset = -(-offset // BLOCK_ALIGN_NBYTES) * BLOCK_ALIGN_NBYTES
        isz = itemsize(field.dtype)
        views.append(
            TensorView(
                pool=Pool.AUX,
                layer_id=None,
                name=field.name,
                region=region_id,
                offset_nbytes=offset,
                dtype=field.dtype,
                shape=(num_rows, field.num_elems),
                strides_nbytes=(field.row_nbytes, isz),
                axes=(ROW_AXIS, ELEM_AXIS),
                shard=None,
                layout=Layout.ROW,
            )
        )
        offset += num_rows * field.row_nbytes
    return PoolViews(tuple(views), (Region(region_id, offset),))
