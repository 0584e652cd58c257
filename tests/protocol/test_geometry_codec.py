"""RankGeometry <-> plain data: a lossless round trip for every preset shape."""

from functools import cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import KV_LAYOUTS, Layout
from pd_transfer.protocol import Register, decode, encode, geometry_from_data, geometry_to_data

PRESETS = ("llama-3.1-8b", "qwen3-next-80b-a3b", "deepseek-v3")
# MLA latent pools have no page_head host layout
LAYOUTS = {
    name: [lay for lay in KV_LAYOUTS if not (name == "deepseek-v3" and lay is Layout.PAGE_HEAD)]
    for name in PRESETS
}


@cache
def _instance(name, role, tp_size, pp_size, kv_layout, num_pages, page_size):
    return tuple(
        build_instance(
            load_preset(name),
            role,
            tp_size,
            pp_size,
            page_size=page_size,
            kv_layout=kv_layout,
            num_pages=num_pages,
            num_slots=3,
        )
    )


@st.composite
def rank_geometries(draw):
    name = draw(st.sampled_from(PRESETS))
    ranks = _instance(
        name,
        draw(st.sampled_from(list(Role))),
        draw(st.sampled_from([1, 2, 4, 8])),
        draw(st.sampled_from([1, 2])),
        draw(st.sampled_from(LAYOUTS[name])),
        draw(st.integers(1, 5)),
        draw(st.sampled_from([1, 16, 64])),
    )
    return draw(st.sampled_from(ranks))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rank_geometries())
def test_geometry_round_trips_through_plain_data(geometry):
    assert geometry_from_data(geometry_to_data(geometry)) == geometry


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rank_geometries(), st.text(min_size=1, max_size=20))
def test_register_round_trips_through_a_frame(geometry, host_id):
    message = Register(agent_id="a", host_id=host_id, geometry=geometry)
    back = decode(encode(message))
    assert back == message
    assert back.geometry.rank_id == geometry.rank_id
    assert [v.key for v in back.geometry.views] == [v.key for v in geometry.views]


def test_decoded_geometry_is_made_of_tuples_and_enums():
    geometry = _instance("qwen3-next-80b-a3b", Role.DECODE, 2, 1, Layout.NHD, 2, 16)[1]
    back = geometry_from_data(geometry_to_data(geometry))
    conv = next(v for v in back.views if v.name == "conv")
    assert isinstance(conv.shape, tuple) and isinstance(conv.shard.ranges[0], tuple)
    assert conv.shard.declared_groups is True
    assert hash(conv) == hash(next(v for v in geometry.views if v.name == "conv"))
