"""vLLM's KV-cache tensors described as pd-transfer views: one region per backing storage.

vLLM hands ``register_kv_caches`` one tensor per attention layer, and several
layers share ONE backing allocation (a ``KVCacheTensor``): on the CPU backend
layer 1 of a two-layer model starts 512 MiB into a 1 GiB storage. So a region
here is a storage, and each layer is a ``k`` and a ``v`` view into it, with
offsets and byte strides read from the tensor itself (``storage_offset``,
``stride``), never from a layout name. The shapes recognised (logical order,
whatever the memory order):

    [blocks, heads, block_size, 2 * head_size]  CPU backend: K | V on the last axis
    [2, blocks, block_size, heads, head_size]   FlashAttention family
    [blocks, 2, block_size, heads, head_size]   FlashInfer family
    [blocks, block_size, latent]                MLA (one replicated latent)

A page is a vLLM block. Heads are the TP-sharded axis, given as this rank's
canonical range of the model's KV heads; MLA latents are replicated. What the
two sides' TP sizes make of that is the sidecars' verdict, not this module's.

A hybrid model's groups share the storage (vLLM overlays them: a block id
belongs to one group at a time). Full-attention layers are ``Pool.KV``
pages, sliding-window layers ``Pool.SWA`` pages, and linear-attention layers
(Mamba/GDN, a :class:`~.states.StateSpec`) ``Pool.MAMBA`` slots, described by
:mod:`.states`.

Imports torch and the layout layer; never vLLM (the connector reads vLLM's
config and passes plain :class:`LayerSpec` records here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pd_transfer.errors import ConfigError
from pd_transfer.integrations.vllm.states import StateSpec, state_views
from pd_transfer.layout.geometry import RankGeometry, Region, Role
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, ShardSpec, TensorView

PAGE_AXIS = Axis("page", AxisRole.INDEX)
TOKEN_AXIS = Axis("token", AxisRole.TOKEN)
HEAD_AXIS = Axis("head", AxisRole.SHARD)
HEAD_DIM_AXIS = Axis("head_dim", AxisRole.INNER)
LATENT_DIM_AXIS = Axis("latent_dim", AxisRole.INNER)

_DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.uint8: "uint8",
    torch.int8: "int8",
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _name


@dataclass(frozen=True)
class LayerSpec:
    """What vLLM's KV-cache spec says of one layer (local to this rank)."""

    block_size: int
    num_kv_heads: int  # on this rank; ignored for MLA
    head_size: int
    mla: bool = False
    pool: Pool = Pool.KV  # Pool.SWA for a sliding-window layer


@dataclass(frozen=True)
class LayerCache:
    """One layer's vLLM tensor, the region it lives in, its block (page) axis and its pool."""

    name: str
    layer_id: int
    tensor: torch.Tensor
    region: str
    page_axis: int
    pool: Pool = Pool.KV


@dataclass(frozen=True)
class KvMemory:
    """A rank's registration plus what the connector needs to stage and copy pages."""

    geometry: RankGeometry
    layers: tuple[LayerCache, ...]
    storages: dict[str, torch.Tensor]  # region id -> the whole storage as a flat uint8 tensor


def layer_index(layer_name: str) -> int:
    """The model layer id in a vLLM layer name: ``model.layers.3.self_attn.attn`` -> 3."""
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ConfigError(
            f"vLLM layer {layer_name!r}: expected exactly one layer number in the name, "
            f"found {numbers}; pd-transfer pairs prefill and decode tensors by layer id"
        )
    return numbers[0]


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    specs: Mapping[str, LayerSpec | StateSpec],
    *,
    role: Role,
    tp_size: int,
    tp_rank: int,
    total_kv_heads: int,
    model: str = "",
) -> KvMemory:
    """The geometry of ``kv_caches`` (vLLM's ``register_kv_caches`` argument) on one rank.

    ``specs`` maps every layer name to its :class:`LayerSpec` (or
    :class:`StateSpec`); the page size is the attention layers'. A tensor
    whose shape matches none of the module docstring's raises
    :class:`ConfigError` naming the layer, its shape and what was expected.
    """
    storages: dict[int, str] = {}
    flat: dict[str, torch.Tensor] = {}
    views: list[TensorView] = []
    layers: list[LayerCache] = []
    block_size = None
    for name in sorted(kv_caches, key=layer_index):
        tensor, spec = kv_caches[name], specs.get(name)
        if spec is None:
            raise ConfigError(f"vLLM layer {name!r} has a KV-cache tensor but no KV-cache spec")
        storage = tensor.untyped_storage()
        region = storages.setdefault(storage.data_ptr(), f"kv{len(storages)}")
        if region not in flat:
            flat[region] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        if isinstance(spec, StateSpec):
            views += state_views(name, layer_index(name), tensor, spec, region, tp_size, tp_rank, _DTYPES)
            layers.append(LayerCache(name, layer_index(name), tensor, region, 0, Pool.MAMBA))
            continue
        if block_size is not None and spec.block_size != block_size:
            raise ConfigError(
                f"vLLM layer {name!r}: block size {spec.block_size}, other layers "
                f"{block_size}; one page size per rank is supported"
            )
        block_size = spec.block_size
        layer_views, page_axis = _layer_views(name, tensor, spec, region, tp_size, tp_rank, total_kv_heads)
        views += layer_views
        layers.append(LayerCache(name, layer_index(name), tensor, region, page_axis, spec.pool))
    if block_size is None:
        raise ConfigError(
            "register_kv_caches got no attention KV-cache tensors (a model of Mamba "
            "layers only is not supported by the pd-transfer connector)"
        )
    regions = tuple(Region(rid, int(t.numel())) for rid, t in flat.items())
    geometry = RankGeometry(
        role=role,
        tp_size=tp_size,
        tp_rank=tp_rank,
        page_size=block_size,
        views=tuple(views),
        regions=regions,
        model=model,
    )
    return KvMemory(geometry, tuple(layers), flat)


def _layer_views(
    name: str,
    tensor: torch.Tensor,
    spec: LayerSpec,
    region: str,
    tp_size: int,
    tp_rank: int,
    total_kv_heads: int,
) -> tuple[list[TensorView], int]:
    """``k``/``v`` (or ``latent``) views of one layer, and its page axis in ``tensor``."""
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise ConfigError(f"vLLM layer {name!r}: KV dtype {tensor.dtype} is not supported")
    isz = tensor.element_size()
    base = tensor.data_ptr() - tensor.untyped_storage().data_ptr()
    stride = [s * isz for s in tensor.stride()]
    shape = tuple(tensor.shape)
    layer_id = layer_index(name)
    bs, heads, dim = spec.block_size, spec.num_kv_heads, spec.head_size

    def view(view_name, offset, axes_dims):  # axes_dims: (axis, tensor dim) in logical order
        axes = tuple(a for a, _ in axes_dims)
        return TensorView(
            pool=spec.pool,
            layer_id=layer_id,
            name=view_name,
            region=region,
            offset_nbytes=base + offset,
            dtype=dtype,
            shape=tuple(shape[d] for _, d in axes_dims),
            strides_nbytes=tuple(stride[d] for _, d in axes_dims),
            axes=axes,
            shard=None if spec.mla else shard,
            layout=layout,
        )

    if spec.mla:
        if len(shape) != 3 or shape[1] != bs or shape[2] != dim:
            raise _bad_shape(name, shape, f"[blocks, {bs}, {dim}] (MLA latent)")
        layout = Layout.NHD
        return [view("latent", 0, ((PAGE_AXIS, 0), (TOKEN_AXIS, 1), (LATENT_DIM_AXIS, 2)))], 0
    shard = ShardSpec.for_rank(total_kv_heads, tp_size, tp_rank)
    if shard.local_extent != heads:
        raise ConfigError(
            f"vLLM layer {name!r}: {heads} KV heads on tp rank {tp_rank} of {tp_size}, "
            f"but {total_kv_heads} model KV heads split into {shard.local_extent}"
        )
    page, token, head, kv_axis, kv_step = _kv_axes(name, shape, stride, bs, heads, dim)
    layout = Layout.HND if stride[head] > stride[token] else Layout.NHD
    inner = len(shape) - 1
    axes_dims = ((PAGE_AXIS, page), (TOKEN_AXIS, token), (HEAD_AXIS, head), (HEAD_DIM_AXIS, inner))
    if kv_axis == inner:  # K | V side by side on the last axis: V starts head_size elements in
        shape = shape[:inner] + (dim,)
    return [view("k", 0, axes_dims), view("v", kv_step, axes_dims)], page


def _kv_axes(
    name: str, shape: tuple, stride: list[int], bs: int, heads: int, dim: int
) -> tuple[int, int, int, int, int]:
    """Which tensor dims are page, token, head and K/V in one of vLLM's KV shapes, and
    the bytes from K to V."""
    if len(shape) == 4 and shape[1:] == (heads, bs, 2 * dim):
        return 0, 2, 1, 3, dim * stride[3]
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, heads, dim):
        return 1, 2, 3, 0, stride[0]
    if len(shape) == 5 and shape[1] == 2 and shape[2:] == (bs, heads, dim):
        return 0, 2, 3, 1, stride[1]
    raise _bad_shape(
        name,
        shape,
        f"[blocks, {heads}, {bs}, {2 * dim}], "
        f"[2, blocks, {bs}, {heads}, {dim}] or [blocks, 2, {bs}, {heads}, {dim}]",
    )


def _bad_shape(name: str, shape: tuple, expected: str) -> ConfigError:
    return ConfigError(
        f"vLLM layer {name!r}: KV-cache tensor of shape {list(shape)}; expected {expected}. "
        f"This attention backend's layout is not supported by the pd-transfer connector"
    )
