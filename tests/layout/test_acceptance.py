"""Rejecting is not a way out: every case here must be accepted and move byte-exact."""

import itertools

import pytest
from transfer_check import instance, transfer_and_verify

from pd_transfer.layout.geometry import Role
from pd_transfer.layout.reconcile import Mode, reconcile
from pd_transfer.layout.views import HOST_LAYOUTS, KV_LAYOUTS, Layout, Pool

TP_SIZES = (1, 2, 4, 8)
TP_PAIRS = list(itertools.product(TP_SIZES, TP_SIZES))


@pytest.mark.parametrize(
    "src_layout,dst_layout", list(itertools.product(KV_LAYOUTS, KV_LAYOUTS)), ids=lambda layout: layout.value
)
def test_identical_geometry_is_accepted_in_every_layout_pair(src_layout, dst_layout):
    prefill = instance("gqa", Role.PREFILL, 2, layout=src_layout)
    decode = instance("gqa", Role.DECODE, 2, layout=dst_layout)
    assert transfer_and_verify(prefill, decode) == []


@pytest.mark.parametrize(
    "src_layout,dst_layout", list(itertools.product(KV_LAYOUTS, KV_LAYOUTS)), ids=lambda layout: layout.value
)
def test_asymmetric_kv_head_dims_move_in_every_layout_pair(src_layout, dst_layout):
    prefill = instance("asym", Role.PREFILL, 1, layout=src_layout)
    decode = instance("asym", Role.DECODE, 2, layout=dst_layout)
    assert transfer_and_verify(prefill, decode) == []


@pytest.mark.parametrize("tp_src,tp_dst", TP_PAIRS)
@pytest.mark.parametrize("kind", ["gqa", "gqa2"])
def test_gqa_is_accepted_for_every_tp_pair_including_fewer_kv_heads_than_ranks(kind, tp_src, tp_dst):
    prefill = instance(kind, Role.PREFILL, tp_src)
    decode = instance(kind, Role.DECODE, tp_dst, layout=Layout.HND)
    assert transfer_and_verify(prefill, decode, seed=tp_src * 10 + tp_dst) == []


@pytest.mark.parametrize("tp_src,tp_dst", TP_PAIRS)
def test_mla_is_accepted_for_every_tp_pair_with_one_writer(tp_src, tp_dst):
    prefill = instance("mla", Role.PREFILL, tp_src)
    decode = instance("mla", Role.DECODE, tp_dst, layout=Layout.PAGE_FIRST)
    recon = reconcile(prefill, decode)
    expected = Mode.REPLICATED if tp_src != tp_dst else Mode.CONVERTED
    assert {v.mode for v in recon.verdicts if v.key[0] is Pool.KV} == {expected}
    for dst in decode:  # exactly one prefill rank writes each decode rank's latent
        assert len(recon.sources_for(dst)) == 1
    assert transfer_and_verify(prefill, decode) == []


@pytest.mark.parametrize("tp_src,tp_dst", TP_PAIRS)
@pytest.mark.parametrize("kind", ["gdn", "mamba2", "kda", "side"])
def test_linear_attention_state_is_accepted_for_every_tp_pair(kind, tp_src, tp_dst):
    prefill = instance(kind, Role.PREFILL, tp_src)
    decode = instance(kind, Role.DECODE, tp_dst)
    assert transfer_and_verify(prefill, decode, seed=tp_src + tp_dst) == []


@pytest.mark.parametrize("tp_src,tp_dst", [(1, 1), (2, 4), (4, 2), (8, 1)])
def test_swa_window_pages_move_beside_full_attention(tp_src, tp_dst):
    prefill = instance("swa", Role.PREFILL, tp_src, num_swa_pages=4)
    decode = instance("swa", Role.DECODE, tp_dst, layout=Layout.PAGE_FIRST_DIRECT, num_swa_pages=3)
    assert {v.key[0] for v in reconcile(prefill, decode).verdicts} >= {Pool.SWA, Pool.KV}
    assert transfer_and_verify(prefill, decode) == []


@pytest.mark.parametrize("pp_src,pp_dst,tp_src,tp_dst", [(2, 1, 2, 4), (1, 2, 2, 2), (2, 2, 4, 1)])
@pytest.mark.parametrize("kind", ["gqa", "gdn"])
def test_pipeline_spans_pair_by_layer_id(kind, pp_src, pp_dst, tp_src, tp_dst):
    layout = HOST_LAYOUTS[(pp_src + tp_dst) % len(HOST_LAYOUTS)]
    prefill = instance(kind, Role.PREFILL, tp_src, pp=pp_src)
    decode = instance(kind, Role.DECODE, tp_dst, pp=pp_dst, layout=layout)
    assert transfer_and_verify(prefill, decode) == []


def test_aux_rows_have_one_writer_per_decode_rank():
    prefill = instance("gqa", Role.PREFILL, 4)
    decode = instance("gqa", Role.DECODE, 2)
    recon = reconcile(prefill, decode)
    for dst in decode:
        writers = [
            src
            for src in recon.sources_for(dst)
            if recon.pieces(next(v.key for v in dst.views if v.pool is Pool.AUX), dst).get(src)
        ]
        assert len(writers) == 1
    assert transfer_and_verify(prefill, decode) == []
