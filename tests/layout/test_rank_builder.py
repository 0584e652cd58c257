"""Whole-rank registrations: every preset builds, PP keeps global ids, bad shapes are refused."""

from __future__ import annotations

import dataclasses

import pytest

from pd_transfer.errors import ConfigError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import LayerKind, load_preset, preset_names
from pd_transfer.layout.rank_builder import WorkerShape, build_instance, build_rank, pp_layer_span
from pd_transfer.layout.views import Layout, Pool

SMALL = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 3, "num_slots": 2, "num_aux_rows": 2}


def _tp_sizes_for(name: str) -> list[int]:
    spec = load_preset(name)
    sizes = []
    for tp_size in (1, 2, 4, 8):
        try:
            spec.state_tensors(tp_size, 0)
        except ConfigError:
            continue
        sizes.append(tp_size)
    return sizes


@pytest.mark.parametrize("name", sorted(preset_names()))
def test_every_preset_builds_for_tp_1_2_4_8(name):
    assert _tp_sizes_for(name) == [1, 2, 4, 8]
    spec = load_preset(name)
    for tp_size in (1, 2, 4, 8):
        ranks = build_instance(spec, Role.DECODE, tp_size, **SMALL)
        assert [g.tp_rank for g in ranks] == list(range(tp_size))
        for geometry in ranks:
            assert geometry.model == name
            kv_layers = geometry.layer_ids(Pool.KV)
            assert kv_layers == set(spec.layer_ids(LayerKind.ATTENTION, LayerKind.MLA))
            assert geometry.layer_ids(Pool.SWA) == set(spec.layer_ids(LayerKind.SLIDING_ATTENTION))
            assert geometry.layer_ids(Pool.MAMBA) == set(spec.linear_layer_ids)
            assert geometry.view((Pool.AUX, None, "bootstrap_room")) is not None


def test_gqa_with_fewer_kv_heads_than_ranks_replicates_one_head_per_rank():
    # qwen3-next: 2 KV heads over tp 8: ranks 0-3 hold head 0, ranks 4-7 head 1
    ranks = build_instance(load_preset("qwen3-next-80b-a3b"), Role.PREFILL, 8, **SMALL)
    ranges = [g.view((Pool.KV, 3, "k")).shard.ranges for g in ranks]
    assert ranges == [((0, 1),)] * 4 + [((1, 2),)] * 4
    assert all(g.view((Pool.KV, 3, "v")).shape[2] == 1 for g in ranks)


def test_mla_latent_is_full_on_every_rank():
    for geometry in build_instance(load_preset("deepseek-v3"), Role.PREFILL, 4, **SMALL):
        latent = geometry.view((Pool.KV, 60, "latent"))
        assert latent.shard is None and latent.shape == (3, 4, 576)


def test_pp_spans_give_the_first_stages_the_extra_layers():
    spans = [pp_layer_span(61, 4, r) for r in range(4)]
    assert [(s.start, s.stop) for s in spans] == [(0, 16), (16, 31), (31, 46), (46, 61)]


def test_an_explicit_partition_splits_the_layers_unevenly():
    spans = [pp_layer_span(61, 3, r, (10, 40, 11)) for r in range(3)]
    assert [(s.start, s.stop) for s in spans] == [(0, 10), (10, 50), (50, 61)]
    ranks = build_instance(load_preset("qwen3-next-80b-a3b"), Role.DECODE, 1, 2, pp_layers=(45, 3), **SMALL)
    assert ranks[1].layer_ids(Pool.KV) == {47} and ranks[1].layer_ids(Pool.MAMBA) == {45, 46}


@pytest.mark.parametrize("pp_layers", [(30, 1), (16, 16, 0), (20, 13), (16.0, 16)])
def test_a_partition_that_does_not_cover_the_layers_once_is_refused(pp_layers):
    pp_size = len(pp_layers)
    with pytest.raises(
        ConfigError, match=r"pp_layers .* must be \d positive layer counts .* add up to the model's 32"
    ):
        build_instance(load_preset("llama-3.1-8b"), Role.PREFILL, 1, pp_size, pp_layers=pp_layers, **SMALL)


def test_a_stage_without_a_pools_layers_registers_none_of_it():
    spec = dataclasses.replace(
        load_preset("qwen3-next-80b-a3b"), layer_kinds=(LayerKind.ATTENTION,) * 4 + (LayerKind.GDN,) * 2
    )
    stages = build_instance(spec, Role.DECODE, 1, 3, **SMALL)
    assert [g.pools() for g in stages] == [{Pool.KV, Pool.AUX}, {Pool.KV, Pool.AUX}, {Pool.MAMBA, Pool.AUX}]
    assert not any(r.id.startswith("mamba") for r in stages[0].regions)  # no empty state region


def test_pp_ranks_register_only_their_span_with_global_layer_ids():
    spec = load_preset("nemotron-h-4b")
    ranks = build_instance(spec, Role.PREFILL, 2, pp_size=2, **SMALL)
    assert [(g.pp_rank, g.tp_rank) for g in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    stage1 = ranks[2]
    assert stage1.layer_ids(Pool.KV) == {29, 40}
    assert stage1.layer_ids(Pool.MAMBA) == {i for i in spec.linear_layer_ids if i >= 26}
    # the first mamba layer of stage 1 sits at position 0 of the stage's buffer
    first = min(stage1.layer_ids(Pool.MAMBA))
    assert stage1.view((Pool.MAMBA, first, "conv")).offset_nbytes == 0


def test_pp_stages_together_cover_every_layer_once():
    spec = load_preset("deepseek-v3")
    ranks = build_instance(spec, Role.DECODE, 1, pp_size=4, **SMALL)
    seen = [lid for g in ranks for lid in sorted(g.layer_ids(Pool.KV))]
    assert seen == list(range(61))


def test_swa_pool_uses_num_swa_pages_and_kv_dtype_override_spares_state():
    spec = load_preset("gpt-oss-20b")
    shape = WorkerShape(
        role=Role.DECODE,
        tp_size=2,
        tp_rank=0,
        page_size=16,
        kv_layout=Layout.NHD,
        num_pages=20,
        num_swa_pages=9,
        kv_dtype="float8_e4m3fn",
    )
    geometry = build_rank(spec, shape)
    assert geometry.view((Pool.SWA, 0, "k")).index_count == 9
    assert geometry.view((Pool.KV, 1, "k")).index_count == 20
    assert geometry.view((Pool.KV, 1, "k")).dtype == "float8_e4m3fn"
    hybrid = build_rank(load_preset("qwen3-next-80b-a3b"), dataclasses.replace(shape, num_slots=4))
    assert hybrid.view((Pool.MAMBA, 0, "temporal")).dtype == "float32"


def test_host_kv_and_state_layouts_build_shared_regions():
    shape = dict(SMALL, kv_layout=Layout.PAGE_FIRST_DIRECT, state_layout=Layout.PAGE_FIRST)
    geometry = build_rank(
        load_preset("qwen3-next-80b-a3b"), WorkerShape(role=Role.DECODE, tp_size=4, tp_rank=1, **shape)
    )
    assert sorted(r.id for r in geometry.regions) == [
        "aux",
        "kv_host",
        "mamba_host.conv",
        "mamba_host.temporal",
    ]


def test_heads_not_divisible_by_tp_name_num_kv_heads_and_attn_tp_size():
    with pytest.raises(
        ConfigError, match="attention.num_kv_heads 8 is not divisible by attn_tp_size 3"
    ) as info:
        build_instance(load_preset("llama-3.1-8b"), Role.PREFILL, 3, **SMALL)
    assert info.value.code is Reason.SHARD_NOT_DIVISIBLE


def test_tp_not_a_multiple_of_few_kv_heads_is_refused():
    # 2 KV heads cannot be replicated evenly over 3 ranks
    with pytest.raises(ConfigError, match="attn_tp_size 3 is not a multiple of attention.num_kv_heads 2"):
        build_rank(
            load_preset("qwen3-next-80b-a3b"), WorkerShape(role=Role.DECODE, tp_size=3, tp_rank=0, **SMALL)
        )


def test_hybrid_model_needs_num_slots():
    shape = dict(SMALL, num_slots=None)
    with pytest.raises(ConfigError, match="shape.num_slots is required"):
        build_rank(load_preset("nemotron-h-4b"), WorkerShape(role=Role.DECODE, tp_size=1, tp_rank=0, **shape))


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"tp_rank": 2}, "shape.tp_rank"),
        ({"page_size": 0}, "shape.page_size"),
        ({"kv_layout": Layout.SLOT}, "shape.kv_layout"),
        ({"state_layout": Layout.PAGE_HEAD}, "shape.state_layout"),
        ({"kv_dtype": "fp8"}, "shape.kv_dtype"),
        ({"pp_size": 2, "pp_rank": 2}, "shape.pp_rank"),
    ],
)
def test_worker_shape_names_the_bad_field(changes, field):
    values = dict(SMALL, role=Role.PREFILL, tp_size=2, tp_rank=0) | changes
    with pytest.raises(ConfigError, match=field):
        WorkerShape(**values)


def test_more_pp_stages_than_layers_is_refused():
    with pytest.raises(ConfigError, match="pp_size 40 is larger than the model's 32 layers"):
        build_instance(load_preset("llama-3.1-8b"), Role.PREFILL, 1, pp_size=40, **SMALL)
