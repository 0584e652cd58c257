"""A host (HiCache) KV pool of SGLang's as decode's KV destination.

SGLang's host pools keep every layer of a rank in one buffer per K and V
(``MHATokenToKVPoolHost``: one ``(2, ...)`` buffer; ``AsymmetricMHATokenToKVPoolHost``,
head_dim != v_head_dim: a K buffer and a V buffer), in the layout of
``--hicache-mem-layout``. Per layer ``l`` (position in the pool, model layer
``start_layer + l``), with ``S`` tokens in ``P`` pages of ``ps``:

    layer_first        (L, S, H, D)
    page_first         (S, L, H, D)
    page_first_direct  (P, L, ps, H, D)
    page_head          (P, H, ps, L, D)

Each layer becomes one ``(page, token, head, dim)`` view whose strides and
offset are read from the buffer itself (a layout SGLang adds later is refused
by name, never guessed), and its head count is checked against the model's
sharding like a device pool's.

Pure translation: no sockets, no sidecar.
"""

from __future__ import annotations

from typing import Any

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.integrations.sglang.kv_views import head_shard
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, TensorView

# per layout: (axis of the layer, axis of pages or None, axis of tokens, axis of heads, axis of dims)
_AXES = {
    "layer_first": (0, None, 1, 2, 3),
    "page_first": (1, None, 0, 2, 3),
    "page_first_direct": (1, 0, 2, 3, 4),
    "page_head": (3, 0, 2, 1, 4),
}
_HOST_KINDS = {"host_kv": ("k", "v"), "host_k": ("k",), "host_v": ("v",)}


def host_kv_views(memory: Any, facts: Any, page_size: int, tp_rank: int) -> list[TensorView]:
    """The K and V views of every layer of ``memory.host`` (see the module docstring)."""
    host = memory.host
    if host.layout not in _AXES:
        raise GeometryError(
            f"host.kv: SGLang's host pool layout {host.layout!r} is not one pd-transfer can address",
            code=Reason.LAYOUT_UNSUPPORTED,
            hint=f"start decode with --hicache-mem-layout one of {sorted(_AXES)}",
        )
    if host.page_size != page_size:
        raise GeometryError(
            f"host.kv: the host pool's page_size is {host.page_size}, kv_args.page_size is {page_size}",
            code=Reason.BAD_VIEW,
        )
    views = []
    for entry in memory.tensors:
        for which, name in enumerate(_HOST_KINDS.get(entry.kind, ())):
            for position in range(host.layer_num):
                views.append(
                    _layer_view(
                        entry,
                        which if entry.kind == "host_kv" else None,
                        name,
                        position,
                        host,
                        facts,
                        tp_rank,
                    )
                )
    return views


def _layer_view(
    entry: Any, which: int | None, name: str, position: int, host: Any, facts: Any, tp_rank: int
) -> TensorView:
    tensor = entry.tensor
    isz = tensor.element_size()
    shape, strides = list(tensor.shape), list(tensor.stride())
    offset = tensor.storage_offset()
    if which is not None:  # (2, ...): K then V
        offset += which * strides[0]
        shape, strides = shape[1:], strides[1:]
    layer_id = facts.start_layer + position
    path = f"kv.layer[{layer_id}].{name} (host {host.layout})"
    layer_ax, page_ax, token_ax, head_ax, dim_ax = _AXES[host.layout]
    if len(shape) != len(_AXES[host.layout]) - (page_ax is None):
        raise GeometryError(
            f"{path}: expected a {host.layout} buffer, got shape {tuple(shape)}", code=Reason.BAD_VIEW
        )
    if shape[layer_ax] != host.layer_num:
        raise GeometryError(
            f"{path}: the buffer holds {shape[layer_ax]} layers, the pool says {host.layer_num}",
            code=Reason.BAD_VIEW,
        )
    ps = host.page_size
    if page_ax is None:  # tokens of consecutive pages follow each other
        if shape[token_ax] % ps:
            raise GeometryError(
                f"{path}: {shape[token_ax]} tokens are not whole pages of {ps}", code=Reason.BAD_VIEW
            )
        pages, page_stride = shape[token_ax] // ps, strides[token_ax] * ps
    else:
        pages, page_stride = shape[page_ax], strides[page_ax]
    heads, dim = shape[head_ax], shape[dim_ax]
    shard = head_shard(path, facts, tp_rank, heads, holder="the host buffer")
    return TensorView(
        pool=Pool.KV,
        layer_id=layer_id,
        name=name,
        region=entry.region,
        offset_nbytes=(offset + position * strides[layer_ax]) * isz,
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=(pages, ps, heads, dim),
        strides_nbytes=(
            page_stride * isz,
            strides[token_ax] * isz,
            strides[head_ax] * isz,
            strides[dim_ax] * isz,
        ),
        axes=(
            Axis("page", AxisRole.INDEX),
            Axis("token", AxisRole.TOKEN),
            Axis("head", AxisRole.SHARD),
            Axis("head_dim", AxisRole.INNER),
        ),
        shard=shard,
        layout=Layout(host.layout),
    )
