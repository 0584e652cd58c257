"""Host KV views match torch tensors of the SGLang HiCache host pool shapes.

Each test allocates the documented buffer, takes SGLang's per-layer view of
it (``kv[0][l]``, ``k_buffer.transpose(0, 1)[l]``, ...), reshapes it to
``(page, token, head, dim)`` and compares offset and byte strides with the
builder's view. The layer ids are global (5, 9, 13) while positions are 0-2.
"""

from __future__ import annotations

import pytest
import torch
from view_bytes import storage_nbytes, torch_layout, view_layout

from pd_transfer.errors import ConfigError, Reason
from pd_transfer.layout.pools import AttentionSpec, KvPoolShape, MlaSpec, build_kv_pool, build_mla_pool
from pd_transfer.layout.views import Layout

P, PS, H, D = 3, 4, 2, 8  # pages, tokens per page, local heads, head dim
S = P * PS
LAYER_IDS = (5, 9, 13)
L = len(LAYER_IDS)


def _paged_layer(buf: torch.Tensor, layout: Layout, layer: int) -> torch.Tensor:
    """One layer of one K/V buffer (no leading 2) as (page, token, head, dim)."""
    if layout is Layout.LAYER_FIRST:  # (L, S, H, D)
        return buf[layer].unflatten(0, (P, PS))
    if layout is Layout.PAGE_FIRST:  # (S, L, H, D)
        return buf.transpose(0, 1)[layer].unflatten(0, (P, PS))
    if layout is Layout.PAGE_FIRST_DIRECT:  # (P, L, ps, H, D)
        return buf[:, layer]
    return buf[:, :, :, layer].permute(0, 2, 1, 3)  # PAGE_HEAD (P, H, ps, L, D)


def _buffer_shape(layout: Layout, dim: int) -> tuple[int, ...]:
    return {
        Layout.LAYER_FIRST: (L, S, H, dim),
        Layout.PAGE_FIRST: (S, L, H, dim),
        Layout.PAGE_FIRST_DIRECT: (P, L, PS, H, dim),
        Layout.PAGE_HEAD: (P, H, PS, L, dim),
    }[layout]


HOST_LAYOUTS = [Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT, Layout.PAGE_HEAD]


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_host_kv_views_match_shared_kv_buffer(layout):
    kv = torch.empty((2,) + _buffer_shape(layout, D), dtype=torch.bfloat16)
    pv = build_kv_pool(
        AttentionSpec(num_kv_heads=4, head_dim=D),
        LAYER_IDS,
        KvPoolShape(P, PS, layout, "bfloat16"),
        tp_size=2,
        tp_rank=1,
    )
    assert [(r.id, r.nbytes) for r in pv.regions] == [("kv_host", storage_nbytes(kv))]
    views = {(v.layer_id, v.name): v for v in pv.views}
    for position, layer_id in enumerate(LAYER_IDS):
        for kv_index, name in enumerate("kv"):
            expected = _paged_layer(kv[kv_index], layout, position)
            assert view_layout(views[(layer_id, name)]) == torch_layout(expected), (layer_id, name)


def test_host_v_starts_after_all_of_k():
    pv = build_kv_pool(
        AttentionSpec(2, D),
        LAYER_IDS,
        KvPoolShape(P, PS, Layout.LAYER_FIRST, "float32"),
        tp_size=1,
        tp_rank=0,
    )
    v0 = next(v for v in pv.views if v.name == "v" and v.layer_id == LAYER_IDS[0])
    assert v0.offset_nbytes == L * S * 2 * D * 4  # L*S*H*D*isz


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_asymmetric_host_kv_uses_one_buffer_per_tensor(layout):
    pv = build_kv_pool(
        AttentionSpec(num_kv_heads=2, head_dim=12, v_head_dim=D),
        LAYER_IDS,
        KvPoolShape(P, PS, layout, "bfloat16"),
        tp_size=1,
        tp_rank=0,
    )
    regions = {r.id: r.nbytes for r in pv.regions}
    assert set(regions) == {"kv_host.k", "kv_host.v"}
    for name, dim in (("k", 12), ("v", D)):
        buf = torch.empty(_buffer_shape(layout, dim), dtype=torch.bfloat16)
        assert regions[f"kv_host.{name}"] == storage_nbytes(buf)
        for position, layer_id in enumerate(LAYER_IDS):
            view = next(v for v in pv.views if (v.layer_id, v.name) == (layer_id, name))
            assert view.region == f"kv_host.{name}"
            assert view_layout(view) == torch_layout(_paged_layer(buf, layout, position))


@pytest.mark.parametrize(
    "layout,shape",
    [
        (Layout.LAYER_FIRST, (L, S, 1, 576)),
        (Layout.PAGE_FIRST, (S, L, 1, 576)),
        (Layout.PAGE_FIRST_DIRECT, (P, L, PS, 1, 576)),
    ],
)
def test_host_mla_views_match_sglang_mla_host_buffer(layout, shape):
    buf = torch.empty(shape, dtype=torch.bfloat16)
    pv = build_mla_pool(MlaSpec(512, 64), LAYER_IDS, KvPoolShape(P, PS, layout, "bfloat16"))
    assert [(r.id, r.nbytes) for r in pv.regions] == [("kv_host", storage_nbytes(buf))]
    per_layer = buf.squeeze(-2)
    for position, layer_id in enumerate(LAYER_IDS):
        if layout is Layout.LAYER_FIRST:
            expected = per_layer[position].unflatten(0, (P, PS))
        elif layout is Layout.PAGE_FIRST:
            expected = per_layer.transpose(0, 1)[position].unflatten(0, (P, PS))
        else:
            expected = per_layer[:, position]
        view = next(v for v in pv.views if v.layer_id == layer_id)
        assert view_layout(view) == torch_layout(expected)


def test_host_mla_refuses_page_head():
    with pytest.raises(ConfigError, match="page_head") as info:
        build_mla_pool(MlaSpec(512, 64), [0], KvPoolShape(P, PS, Layout.PAGE_HEAD, "bfloat16"))
    assert info.value.code is Reason.LAYOUT_UNSUPPORTED
    assert "page_first_direct" in str(info.value)
