"""Mamba / linear-attention state views match torch buffers of SGLang shapes.

Device: one ``(Lm, num_slots, *shape)`` buffer per tensor name (MambaPool);
host ``page_first``: ``(num_slots, Lm, *shape)`` (MambaPoolHost).
"""

from __future__ import annotations

import pytest
import torch
from view_bytes import storage_nbytes, torch_layout, view_layout

from pd_transfer.errors import ConfigError, Reason
from pd_transfer.layout.pools import GdnSpec, KdaSpec, Mamba2Spec, SideStateSpec, build_state_pool
from pd_transfer.layout.views import AxisRole, Layout, Pool

SLOTS = 3
LAYER_IDS = (0, 2, 5, 9)
QWEN3_NEXT_GDN = GdnSpec(
    num_key_heads=16, key_head_dim=128, num_value_heads=32, value_head_dim=128, conv_kernel=4
)
NEMOTRON_MAMBA2 = Mamba2Spec(num_heads=112, head_dim=64, state_size=128, n_groups=8, conv_kernel=4)
KIMI_KDA = KdaSpec(num_heads=32, head_dim=128, conv_kernel=4)


def _check_against_torch(tensors, layout: Layout) -> None:
    pv = build_state_pool(tensors, LAYER_IDS, num_slots=SLOTS, layout=layout)
    regions = {r.id: r.nbytes for r in pv.regions}
    lm = len(LAYER_IDS)
    for tensor in tensors:
        dtype = getattr(torch, tensor.dtype)
        if layout is Layout.PAGE_FIRST:
            buf = torch.empty((SLOTS, lm) + tensor.shape, dtype=dtype)
        else:
            buf = torch.empty((lm, SLOTS) + tensor.shape, dtype=dtype)
        region_id = ("mamba." if layout is Layout.SLOT else "mamba_host.") + tensor.name
        assert regions[region_id] == storage_nbytes(buf)
        for position, layer_id in enumerate(LAYER_IDS):
            expected = buf[:, position] if layout is Layout.PAGE_FIRST else buf[position]
            view = next(v for v in pv.views if (v.layer_id, v.name) == (layer_id, tensor.name))
            assert view.pool is Pool.MAMBA and view.region == region_id
            assert view_layout(view) == torch_layout(expected), (layer_id, tensor.name)


@pytest.mark.parametrize("layout", [Layout.SLOT, Layout.LAYER_FIRST, Layout.PAGE_FIRST])
@pytest.mark.parametrize("spec", [QWEN3_NEXT_GDN, NEMOTRON_MAMBA2, KIMI_KDA], ids=["gdn", "mamba2", "kda"])
def test_state_views_match_torch_buffers(spec, layout):
    tensors = spec.state_tensors(tp_size=4, tp_rank=2) + (SideStateSpec("side0", 5, "int32").state_tensor(),)
    _check_against_torch(tensors, layout)


def test_gdn_conv_shards_each_group_like_the_reference_example():
    # Qwen3-Next, tp=4 rank 1: q [512,1024) of 2048, k [512,1024) of 2048, v [1024,2048) of 4096
    conv, temporal = QWEN3_NEXT_GDN.state_tensors(tp_size=4, tp_rank=1)
    assert conv.shard.groups == (2048, 2048, 4096)
    assert conv.shard.ranges == ((512, 1024), (512, 1024), (1024, 2048))
    assert conv.shard.declared_groups
    assert conv.shape == (2048, 3) and conv.dtype == "bfloat16"
    assert temporal.shape == (8, 128, 128) and temporal.dtype == "float32"
    assert temporal.shard.ranges == ((8, 16),)
    assert [a.name for a in temporal.axes] == ["head", "value_dim", "key_dim"]


def test_mamba2_state_shapes_and_groups():
    conv, ssm = NEMOTRON_MAMBA2.state_tensors(tp_size=2, tp_rank=0)
    assert NEMOTRON_MAMBA2.conv_dim == 7168 + 2 * 8 * 128
    assert conv.shard.groups == (7168, 1024, 1024)
    assert conv.shape == (9216 // 2, 3)
    assert [(a.name, a.role) for a in conv.axes] == [("channel", AxisRole.SHARD), ("tap", AxisRole.INNER)]
    assert ssm.shape == (56, 64, 128) and ssm.dtype == "float32"
    assert [a.name for a in ssm.axes] == ["head", "head_dim", "state"]


def test_kda_conv_keeps_taps_in_front_of_channels():
    conv, temporal = KIMI_KDA.state_tensors(tp_size=4, tp_rank=3)
    assert [(a.name, a.role) for a in conv.axes] == [("tap", AxisRole.OUTER), ("channel", AxisRole.SHARD)]
    assert conv.shape == (3, 3 * 4096 // 4)
    assert conv.shard.ranges == ((3072, 4096),) * 3
    assert temporal.shape == (8, 128, 128)


def test_side_state_is_replicated_without_shard_axis():
    side = SideStateSpec("side0", 7, "float32").state_tensor()
    pv = build_state_pool((side,), [4], num_slots=2)
    (view,) = pv.views
    assert view.shard is None and not view.is_sharded
    assert [a.name for a in view.axes] == ["slot", "elem"]


def test_state_pool_refuses_heads_not_divisible_by_tp():
    with pytest.raises(ConfigError, match="gdn.num_key_heads 16 is not divisible by attn_tp_size 3") as info:
        QWEN3_NEXT_GDN.state_tensors(tp_size=3, tp_rank=0)
    assert info.value.code is Reason.SHARD_NOT_DIVISIBLE


def test_mamba2_refuses_tp_that_splits_a_group():
    with pytest.raises(ConfigError, match="mamba2.n_groups 8 is not divisible by attn_tp_size 16"):
        NEMOTRON_MAMBA2.state_tensors(tp_size=16, tp_rank=0)


def test_state_pool_refuses_page_head_layout():
    with pytest.raises(ConfigError, match="state_layout 'page_head'"):
        build_state_pool(KIMI_KDA.state_tensors(1, 0), [0], num_slots=1, layout=Layout.PAGE_HEAD)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"conv_kernel": 1}, "gdn.conv_kernel"),
        ({"num_value_heads": 0}, "gdn.num_value_heads"),
        ({"temporal_dtype": "float99"}, "gdn.temporal_dtype"),
    ],
)
def test_state_spec_names_the_bad_field(kwargs, field):
    values = (
        dict(num_key_heads=16, key_head_dim=128, num_value_heads=32, value_head_dim=128, conv_kernel=4)
        | kwargs
    )
    with pytest.raises(ConfigError, match=field):
        GdnSpec(**values)
