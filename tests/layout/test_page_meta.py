"""Zero-copy page metadata and the page-granular check, against torch buffers.

Each range test allocates the SGLang HiCache host buffer (reference/sglang.md
5.2, 5.3, 5.5) with torch, fills it with distinct bytes, and checks that every
``(offset, nbytes)`` the metadata returns is exactly the bytes of that page of
that buffer: ``kv[0, page * ps]`` starts it and ``L * ps * H * D * itemsize``
bytes follow, contiguous.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pd_transfer.errors import LayoutError, Reason
from pd_transfer.layout.page_meta import page_buffer_meta, require_page_granular
from pd_transfer.layout.pools import (
    AttentionSpec,
    GdnSpec,
    KvPoolShape,
    SideStateSpec,
    build_kv_pool,
    build_state_pool,
)
from pd_transfer.layout.views import AxisRole, Layout

P, PS, H, D = 5, 4, 2, 8  # pages, page size, local KV heads, head dim
S = P * PS
LAYER_IDS = (3, 7, 11)  # global ids; positions 0-2 in the host buffer
L = len(LAYER_IDS)
PAGES = [3, 0, 4]  # deliberately out of order
MIMO_K, MIMO_V = 192, 128  # MiMo-V2 head_dim / v_head_dim
TINY_GDN = GdnSpec(num_key_heads=2, key_head_dim=4, num_value_heads=4, value_head_dim=4, conv_kernel=4)


def _tokens(pages, page_size: int = PS) -> np.ndarray:
    return np.concatenate([np.arange(p * page_size, (p + 1) * page_size) for p in pages])


def _kv_views(layout: Layout, head_dim: int = D, v_head_dim: int | None = None):
    # 4 global KV heads over tp 2: rank 1 holds heads [2, 4), H = 2 local heads
    attn = AttentionSpec(num_kv_heads=4, head_dim=head_dim, v_head_dim=v_head_dim)
    return build_kv_pool(attn, LAYER_IDS, KvPoolShape(P, PS, layout, "bfloat16"), tp_size=2, tp_rank=1).views


def _filled(shape, dtype=torch.bfloat16) -> torch.Tensor:
    """A buffer whose bytes follow a pattern, so misplaced ranges compare unequal."""
    buf = torch.empty(shape, dtype=dtype)
    raw = buf.view(torch.uint8).view(-1)
    raw.copy_(torch.arange(raw.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
    return buf


def _assert_ranges_are_pages(meta, pages, sources) -> None:
    """Group ``g``'s range for page ``p`` is exactly the bytes of ``page_of(buf, p)``,
    where ``sources[g] = (buf, page_of)``."""
    assert [m.group for m in meta] == list(sources)
    for group in meta:
        buf, page_of = sources[group.group]
        raw = buf.view(torch.uint8).view(-1)
        assert len(group.offsets) == len(pages), group.group
        for page, offset in zip(pages, group.offsets.tolist()):
            page_tensor = page_of(buf, page)
            isz = page_tensor.element_size()
            assert page_tensor.is_contiguous()
            assert offset == page_tensor.storage_offset() * isz, (group.group, page)
            assert group.nbytes == page_tensor.numel() * isz
            expected = page_tensor.view(torch.uint8).view(-1)
            assert torch.equal(raw[offset : offset + group.nbytes], expected), (group.group, page)


def test_page_first_gives_one_range_per_page_per_k_and_v_of_the_shared_buffer():
    kv = _filled((2, S, L, H, D))
    meta = page_buffer_meta(_kv_views(Layout.PAGE_FIRST), _tokens(PAGES), PS)
    assert [(m.region, m.nbytes) for m in meta] == [("kv_host", L * PS * H * D * 2)] * 2
    _assert_ranges_are_pages(
        meta,
        PAGES,
        {
            "k": (kv, lambda buf, p: buf[0, p * PS : (p + 1) * PS]),
            "v": (kv, lambda buf, p: buf[1, p * PS : (p + 1) * PS]),
        },
    )


def test_page_first_direct_gives_one_range_per_page_per_k_and_v_of_the_shared_buffer():
    kv = _filled((2, P, L, PS, H, D))
    meta = page_buffer_meta(_kv_views(Layout.PAGE_FIRST_DIRECT), _tokens(PAGES), PS)
    assert [(m.region, m.nbytes) for m in meta] == [("kv_host", L * PS * H * D * 2)] * 2
    _assert_ranges_are_pages(
        meta, PAGES, {"k": (kv, lambda buf, p: buf[0, p]), "v": (kv, lambda buf, p: buf[1, p])}
    )


@pytest.mark.parametrize(
    "layout,k_shape,v_shape,page_of",
    [
        (Layout.PAGE_FIRST, (S, L, H, MIMO_K), (S, L, H, MIMO_V), lambda buf, p: buf[p * PS : (p + 1) * PS]),
        (Layout.PAGE_FIRST_DIRECT, (P, L, PS, H, MIMO_K), (P, L, PS, H, MIMO_V), lambda buf, p: buf[p]),
    ],
    ids=["page_first", "page_first_direct"],
)
def test_asymmetric_kv_gives_k_and_v_ranges_of_their_own_buffers(layout, k_shape, v_shape, page_of):
    meta = page_buffer_meta(_kv_views(layout, head_dim=MIMO_K, v_head_dim=MIMO_V), _tokens(PAGES), PS)
    assert [(m.region, m.nbytes) for m in meta] == [
        ("kv_host.k", L * PS * H * MIMO_K * 2),
        ("kv_host.v", L * PS * H * MIMO_V * 2),
    ]
    _assert_ranges_are_pages(
        meta, PAGES, {"k": (_filled(k_shape), page_of), "v": (_filled(v_shape), page_of)}
    )


@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT])
def test_mamba_host_state_gives_one_range_per_slot_per_tensor(layout):
    slots, picked = 6, [5, 1, 2]
    tensors = TINY_GDN.state_tensors(tp_size=2, tp_rank=1)  # conv, temporal
    views = build_state_pool(tensors, LAYER_IDS, num_slots=slots, layout=layout).views
    meta = page_buffer_meta(views, np.array(picked), 1)  # a host state page is one slot
    assert [m.region for m in meta] == ["mamba_host.conv", "mamba_host.temporal"]
    # MambaPoolHost: (S, Lm, *shape) per tensor; slot s is buf[s], all Lm layers
    _assert_ranges_are_pages(
        meta,
        picked,
        {
            t.name: (_filled((slots, L) + t.shape, getattr(torch, t.dtype)), lambda buf, s: buf[s])
            for t in tensors
        },
    )


@pytest.mark.parametrize("layout", [Layout.LAYER_FIRST, Layout.PAGE_HEAD, Layout.NHD])
def test_page_meta_refuses_layouts_whose_pages_are_not_one_range(layout):
    with pytest.raises(LayoutError) as info:
        page_buffer_meta(_kv_views(layout), _tokens(PAGES), PS)
    text = str(info.value)
    assert info.value.code is Reason.LAYOUT_UNSUPPORTED
    assert f"is {layout.value}," in text
    assert "page_first, page_first_direct" in text


@pytest.mark.parametrize("layout", [Layout.LAYER_FIRST, Layout.NHD])
def test_page_meta_for_asymmetric_kv_outside_page_layouts_names_the_head_dims(layout):
    views = _kv_views(layout, head_dim=MIMO_K, v_head_dim=MIMO_V)
    with pytest.raises(LayoutError) as info:
        page_buffer_meta(views, _tokens(PAGES), PS)
    assert info.value.code is Reason.LAYOUT_UNSUPPORTED
    assert str(info.value).startswith(
        "zero-copy page metadata for models with head_dim != v_head_dim needs a page layout "
        f"(page_first, page_first_direct); kv.layer[3].k is {layout.value}"
    )


def test_page_meta_refuses_mamba_pools_with_side_states():
    tensors = TINY_GDN.state_tensors(tp_size=1, tp_rank=0) + (
        SideStateSpec("side0", 3, "int32").state_tensor(),
    )
    views = build_state_pool(tensors, LAYER_IDS, num_slots=4, layout=Layout.PAGE_FIRST).views
    with pytest.raises(LayoutError) as info:
        page_buffer_meta(views, np.array([0, 2]), 1)
    assert info.value.code is Reason.LAYOUT_UNSUPPORTED
    assert str(info.value).startswith(
        "mamba.layer[3].side0: zero-copy page metadata does not cover registered per-slot side states"
    )


@pytest.mark.parametrize(
    "tokens,problem",
    [
        (np.arange(6), "index list of 6 tokens is not a multiple of page_size 4"),
        (np.arange(1, 5), "token indices do not form whole, aligned pages"),
        (np.array([4, 5, 7, 6]), "token indices do not form whole, aligned pages"),
    ],
    ids=["partial-page", "unaligned", "out-of-order"],
)
def test_page_meta_refuses_token_lists_that_are_not_whole_aligned_pages(tokens, problem):
    with pytest.raises(LayoutError, match=problem) as info:
        page_buffer_meta(_kv_views(Layout.PAGE_FIRST), tokens, PS)
    assert info.value.code is Reason.INDEX_NOT_PAGE_ALIGNED


@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST_DIRECT, Layout.NHD, Layout.HND, Layout.LAYER_FIRST])
@pytest.mark.parametrize("v_head_dim", [None, MIMO_V], ids=["symmetric", "asymmetric"])
def test_page_granular_copy_accepts_pools_whose_layer_pages_are_contiguous(layout, v_head_dim):
    head_dim = D if v_head_dim is None else MIMO_K
    views = _kv_views(layout, head_dim=head_dim, v_head_dim=v_head_dim)
    assert require_page_granular(views) is None
    for view in views:  # by enumeration: the bytes of one layer's page tile one range
        index = view.axis_index(AxisRole.INDEX)
        shape = [1 if i == index else n for i, n in enumerate(view.shape)]
        starts = sum(axis.ravel() * stride for axis, stride in zip(np.indices(shape), view.strides_nbytes))
        assert np.array_equal(np.sort(starts), np.arange(len(starts)) * view.itemsize), view.path


def test_page_granular_copy_refuses_page_first_and_suggests_page_first_direct():
    with pytest.raises(LayoutError) as info:
        require_page_granular(_kv_views(Layout.PAGE_FIRST))
    assert info.value.code is Reason.LAYOUT_UNSUPPORTED
    assert str(info.value) == (
        "kv.layer[3].k (page_first): a page of one layer is not one contiguous range, so a "
        "page-granular (direct, no gather) copy is impossible\n"
        "  hint: allocate the pool as page_first_direct, or use the gathering (kernel) path"
    )


def test_page_granular_copy_of_asymmetric_kv_says_it_must_be_page_first_direct():
    with pytest.raises(LayoutError) as info:
        require_page_granular(_kv_views(Layout.PAGE_FIRST, head_dim=MIMO_K, v_head_dim=MIMO_V))
    assert info.value.code is Reason.LAYOUT_UNSUPPORTED
    assert "models with head_dim != v_head_dim must use page_first_direct for direct copies" in str(
        info.value
    )


def test_page_granular_copy_refuses_page_head():
    with pytest.raises(LayoutError, match=r"kv.layer\[3\].k \(page_head\)") as info:
        require_page_granular(_kv_views(Layout.PAGE_HEAD))
    assert info.value.code is Reason.LAYOUT_UNSUPPORTED
