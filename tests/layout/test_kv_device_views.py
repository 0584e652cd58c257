"""Device KV views (NHD, HND, MLA) have the strides of real torch buffers."""

from __future__ import annotations

import pytest
import torch
from view_bytes import storage_nbytes, torch_layout, view_layout

from pd_transfer.errors import ConfigError
from pd_transfer.layout.pools import AttentionSpec, KvPoolShape, MlaSpec, build_kv_pool, build_mla_pool
from pd_transfer.layout.views import AxisRole, Layout, Pool

P, PS = 5, 4  # pages, tokens per page


def _views_by_key(pool_views):
    return {(v.layer_id, v.name): v for v in pool_views.views}


@pytest.mark.parametrize("tp_size,tp_rank", [(1, 0), (2, 1), (4, 3)])
def test_nhd_device_view_matches_token_major_buffer(tp_size, tp_rank):
    attn = AttentionSpec(num_kv_heads=8, head_dim=192, v_head_dim=128)
    grid = KvPoolShape(P, PS, Layout.NHD, "bfloat16")
    pv = build_kv_pool(attn, [3, 7], grid, tp_size=tp_size, tp_rank=tp_rank)
    views = _views_by_key(pv)
    regions = {r.id: r.nbytes for r in pv.regions}
    heads = 8 // tp_size
    for name, dim in (("k", 192), ("v", 128)):
        buf = torch.empty((P * PS, heads, dim), dtype=torch.bfloat16)  # SGLang k_buffer[layer]
        paged = buf.view(P, PS, heads, dim)
        view = views[(7, name)]
        assert view_layout(view) == torch_layout(paged)
        assert view.region == f"kv.{name}.L7"
        assert regions[view.region] == storage_nbytes(buf)
        assert view.shard.ranges == ((tp_rank * heads, (tp_rank + 1) * heads),)


def test_hnd_device_view_matches_head_major_buffer():
    attn = AttentionSpec(num_kv_heads=4, head_dim=64)
    grid = KvPoolShape(P, PS, Layout.HND, "float16")
    pv = build_kv_pool(attn, [0], grid, tp_size=2, tp_rank=0)
    buf = torch.empty((P, 2, PS, 64), dtype=torch.float16)  # [page, head, token, dim]
    logical = buf.permute(0, 2, 1, 3)  # page, token, head, dim
    for view in pv.views:
        assert view_layout(view) == torch_layout(logical)
        assert view.layout is Layout.HND
    assert {r.nbytes for r in pv.regions} == {storage_nbytes(buf)}


def test_kv_view_axes_are_page_token_head_head_dim():
    pv = build_kv_pool(
        AttentionSpec(2, 8), [0], KvPoolShape(2, 2, Layout.NHD, "bfloat16"), tp_size=1, tp_rank=0
    )
    axes = [(a.name, a.role) for a in pv.views[0].axes]
    assert axes == [
        ("page", AxisRole.INDEX),
        ("token", AxisRole.TOKEN),
        ("head", AxisRole.SHARD),
        ("head_dim", AxisRole.INNER),
    ]
    assert [v.name for v in pv.views] == ["k", "v"]


def test_swa_device_pool_uses_swa_pool_and_region_prefix():
    pv = build_kv_pool(
        AttentionSpec(8, 64, window_tokens=128),
        [0, 2],
        KvPoolShape(3, 16, Layout.NHD, "bfloat16"),
        tp_size=1,
        tp_rank=0,
        pool=Pool.SWA,
    )
    assert {v.pool for v in pv.views} == {Pool.SWA}
    assert sorted(r.id for r in pv.regions) == ["swa.k.L0", "swa.k.L2", "swa.v.L0", "swa.v.L2"]


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
def test_mla_device_view_is_replicated_latent_without_head_axis(layout):
    grid = KvPoolShape(P, PS, layout, "bfloat16")
    pv = build_mla_pool(MlaSpec(kv_lora_rank=512, qk_rope_head_dim=64), [0, 60], grid)
    buf = torch.empty((P * PS, 1, 576), dtype=torch.bfloat16)  # SGLang kv_buffer[layer]
    latent = buf.view(P, PS, 576)
    for view in pv.views:
        assert view.name == "latent" and view.shard is None
        assert [a.name for a in view.axes] == ["page", "token", "latent_dim"]
        assert view_layout(view) == torch_layout(latent)
    assert sorted(r.id for r in pv.regions) == ["kv.latent.L0", "kv.latent.L60"]


def test_device_pool_rejects_state_layout():
    with pytest.raises(ConfigError, match="not a device layout"):
        build_kv_pool(
            AttentionSpec(2, 8), [0], KvPoolShape(2, 2, Layout.SLOT, "bfloat16"), tp_size=1, tp_rank=0
        )
