"""SGLang's device KV buffers as tensor views: per-head K and V, or the MLA latent.

Each view is cross-checked against SGLang's own bytes per item
(:func:`check_item`), and a per-head view's head count against the model's
KV heads split over the attention TP size: a disagreement is a
:class:`~pd_transfer.errors.GeometryError` naming the buffer and both values.

Pure translation: no sockets, no sidecar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.integrations.sglang.memory import PoolTensor
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, ShardSpec, TensorView

if TYPE_CHECKING:
    from pd_transfer.integrations.sglang.facts import EngineFacts

_DTYPE_NAMES = {"uint64": "int64", "bool": "uint8"}  # same bytes; the planner only moves bytes


def kv_view(
    entry: PoolTensor,
    offset: int,
    layer_id: int,
    pool: Pool,
    page_size: int,
    tp_rank: int,
    facts: EngineFacts,
    item_nbytes: int,
    local_heads: int | None,
) -> TensorView:
    """The view of one device K, V or MLA latent buffer, cross-checked against ``item_nbytes``."""
    tensor = entry.tensor
    prefix = "draft_" if entry.kind.startswith("draft_") else ""  # the speculative draft model's
    name = entry.kind.removeprefix("swa_").removeprefix("draft_")
    path = f"{pool.value}.layer[{layer_id}].{prefix}{'latent' if name == 'kv' else name}"
    if tensor.dim() != 3:
        raise GeometryError(
            f"{path}: expected a (tokens, heads, dim) pool tensor, got shape {tuple(tensor.shape)}",
            code=Reason.BAD_VIEW,
        )
    rows, heads, dim = tensor.shape
    dtype = dtype_name(tensor)
    isz = tensor.element_size()
    check_item(path, "kv_item_lens", item_nbytes, page_size * heads * dim * isz)
    if rows % page_size:
        raise GeometryError(
            f"{path}: {rows} token rows are not whole pages of {page_size}", code=Reason.BAD_VIEW
        )
    row_stride, head_stride, elem_stride = (s * isz for s in tensor.stride())
    page_axis, token_axis = Axis("page", AxisRole.INDEX), Axis("token", AxisRole.TOKEN)
    if name == "kv":  # MLA latent: one replicated "head"
        return TensorView(
            pool=pool,
            layer_id=layer_id,
            name=prefix + "latent",
            region=entry.region,
            offset_nbytes=offset,
            dtype=dtype,
            shape=(rows // page_size, page_size, dim),
            strides_nbytes=(row_stride * page_size, row_stride, elem_stride),
            axes=(page_axis, token_axis, Axis("latent_dim", AxisRole.INNER)),
            shard=None,
            layout=Layout.NHD,
        )
    shard = _head_shard(path, heads, local_heads, facts, tp_rank)
    return TensorView(
        pool=pool,
        layer_id=layer_id,
        name=prefix + name,
        region=entry.region,
        offset_nbytes=offset,
        dtype=dtype,
        shape=(rows // page_size, page_size, heads, dim),
        strides_nbytes=(row_stride * page_size, row_stride, head_stride, elem_stride),
        axes=(page_axis, token_axis, Axis("head", AxisRole.SHARD), Axis("head_dim", AxisRole.INNER)),
        shard=shard,
        layout=Layout.NHD,
    )


def _head_shard(
    path: str, heads: int, local_heads: int | None, facts: EngineFacts, tp_rank: int
) -> ShardSpec:
    """This rank's share of the model's KV heads, checked against the ``heads`` its pool holds."""
    if local_heads is not None and local_heads and local_heads != heads:
        raise GeometryError(
            f"{path}: kv_args.kv_head_num is {local_heads} but the pool tensor holds {heads} heads",
            code=Reason.BAD_VIEW,
        )
    return head_shard(path, facts, tp_rank, heads, holder="its pool tensor")


def head_shard(path: str, facts: Any, tp_rank: int, heads: int, *, holder: str) -> ShardSpec:
    """Rank ``tp_rank``'s share of the model's KV heads, checked against the ``heads``
    that ``holder`` (a device pool tensor, a host buffer) holds."""
    if facts.total_kv_heads is None:
        raise GeometryError(
            f"{path}: the model's total KV head count is not known",
            code=Reason.BAD_VIEW,
            hint="pass total_kv_heads from SGLang's model config",
        )
    shard = ShardSpec.for_rank(facts.total_kv_heads, facts.attn_tp_size, tp_rank)
    if shard.local_extent != heads:
        raise GeometryError(
            f"{path}: {facts.total_kv_heads} KV heads over attn_tp_size {facts.attn_tp_size} give rank "
            f"{tp_rank} {shard.local_extent} heads, but {holder} holds {heads}",
            code=Reason.BAD_VIEW,
        )
    return shard


def check_item(path: str, field: str, sglang_nbytes: int, view_nbytes: int) -> None:
    """Raise unless SGLang's bytes per item (``field``) agree with the view's."""
    if int(sglang_nbytes) != view_nbytes:
        raise GeometryError(
            f"{path}: SGLang's {field} says {sglang_nbytes} bytes per item, the pool "
            f"tensor gives {view_nbytes}",
            code=Reason.BAD_VIEW,
        )


def dtype_name(tensor: Any) -> str:
    """The dtype name the planner uses for ``tensor`` (same bytes, one name)."""
    name = str(tensor.dtype).removeprefix("torch.")
    return _DTYPE_NAMES.get(name, name)
