"""Pipelined instances through real sidecars: each stage registers only its layers.

Every case moves a room byte-exact (checked by the oracle, World), with PP on
either side or both, splits that differ and TP that differs at the same time;
a decode instance whose stages leave a layer unregistered is rejected, live,
with the lines ``pd-transfer check`` prints for the same pair.
"""

import dataclasses

import numpy as np
import pytest
from cluster import random_requests

from pd_transfer.client import Refused, RoomStatus
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.instance_reconcile import reconcile_instances
from pd_transfer.layout.model_spec import LayerKind
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout

SMALL = dict(page_size=16, num_pages=6, num_slots=2, num_aux_rows=2)

CASES = [  # model, prefill (pp, tp), decode (pp, tp), decode layout
    ("llama-3.1-8b", (1, 2), (2, 2), Layout.NHD),  # the reproduction
    ("llama-3.1-8b", (2, 2), (4, 1), Layout.HND),  # PP 2 -> 4, TP 2 -> 1
    ("llama-3.1-8b", (3, 1), (2, 2), Layout.NHD),  # uneven: 11/11/10 layers -> 16/16
    ("qwen3-next-80b-a3b", (1, 2), (2, 1), Layout.NHD),  # GDN state + attention + aux
    ("kimi-linear-48b-a3b", (2, 1), (3, 2), Layout.NHD),  # KDA state, 14/13 -> 9/9/9 layers
    ("deepseek-v3", (2, 2), (3, 1), Layout.NHD),  # MLA, 31/30 -> 21/20/20 layers
    ("gpt-oss-20b", (1, 2), (2, 1), Layout.HND),  # sliding window + full attention
]


def _instances(model, prefill_shape, decode_shape, layout):
    spec = load_preset(model)
    (pp_src, tp_src), (pp_dst, tp_dst) = prefill_shape, decode_shape
    return (
        build_instance(spec, Role.PREFILL, tp_src, pp_src, kv_layout=Layout.NHD, **SMALL),
        build_instance(spec, Role.DECODE, tp_dst, pp_dst, kv_layout=layout, **SMALL),
    )


def _case_id(case):
    model, (a, b), (c, d), layout = case
    return f"{model}-pp{a}tp{b}-to-pp{c}tp{d}-{layout.value}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_pipelined_instances_move_a_room_byte_exact(cluster_factory, case):
    prefill, decode = _instances(*case)
    assert reconcile_instances(prefill, decode).ok
    cluster = cluster_factory(prefill, decode)
    requests = random_requests(
        prefill, decode, np.random.default_rng(len(prefill) * 5 + len(decode)), pages=4
    )
    cluster.expect(21, requests)
    cluster.send(21, requests, chunk_pages=2)
    states = cluster.wait_decode(21)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []
    for geometry in prefill:  # prefill finishes only once every decode stage has its bytes
        assert cluster.clients[geometry.rank_id].wait(21, 5).status is RoomStatus.SUCCESS


def _kinds(preset: str, name: str, kinds) -> object:
    """``preset``'s geometry with its own layer kinds: where each pool's layers sit."""
    return dataclasses.replace(load_preset(preset), name=name, layer_kinds=tuple(kinds))


A, G, W = LayerKind.ATTENTION, LayerKind.GDN, LayerKind.SLIDING_ATTENTION
K, M = LayerKind.KDA, LayerKind.MLA
SPLITS = {  # model, prefill (pp, tp[, pp_layers]), decode (pp, tp[, pp_layers])
    # the state layers all on decode stage 2, which holds no kv layer; stages 0-1 hold no state
    "state-on-decode-stage-2": (_kinds("qwen3-next-80b-a3b", "gdn-tail", [A] * 4 + [G] * 2), (2, 1), (3, 1)),
    # PP 2 -> PP 1: prefill stage 0 holds kv only, stage 1 the state only
    "state-on-one-prefill-stage": (
        _kinds("qwen3-next-80b-a3b", "gdn-back", [A] * 3 + [G] * 3),
        (2, 2),
        (1, 1),
    ),
    # a decode stage of sliding-window layers only, the other of full attention only
    "swa-only-decode-stage": (_kinds("gpt-oss-20b", "swa-tail", [A] * 2 + [W] * 2), (1, 2), (2, 1)),
    # uneven splits: 2 + 10 layers -> 7 + 1 + 4, decode stage 1 holds one MLA layer and no state
    "uneven-kv-only-decode-stage": (
        _kinds("kimi-linear-48b-a3b", "kda-12", [K, K, K, M] * 3),
        (2, 1, (2, 10)),
        (3, 1, (7, 1, 4)),
    ),
}


def _split(split, decode_page_size=16):
    spec, prefill_shape, decode_shape = SPLITS[split]
    sides = []
    for role, (pp, tp, *layers), page_size in (
        (Role.PREFILL, prefill_shape, 16),
        (Role.DECODE, decode_shape, decode_page_size),
    ):
        shape = {**SMALL, "page_size": page_size, "pp_layers": layers[0] if layers else None}
        sides.append(build_instance(spec, role, tp, pp, kv_layout=Layout.NHD, **shape))
    return sides


@pytest.mark.parametrize(
    "split,transport", [(split, "shm") for split in sorted(SPLITS)] + [("state-on-decode-stage-2", "tcp")]
)
def test_a_stage_without_a_pool_moves_a_room_byte_exact(cluster_factory, split, transport):
    prefill, decode = _split(split)
    assert any(g.pools() != decode[0].pools() for g in prefill + decode)  # a stage lacks a pool
    assert reconcile_instances(prefill, decode).ok
    # tcp: the decode receiver admits only the pools each stage expects, and checks the sums
    config = {"integrity": True} if transport == "tcp" else {}
    cluster = cluster_factory(prefill, decode, transport=transport, config=config)
    requests = random_requests(prefill, decode, np.random.default_rng(7), pages=4)
    cluster.expect(8, requests)  # each worker names only the pools its stage registers
    cluster.send(8, requests, chunk_pages=2)
    states = cluster.wait_decode(8)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []
    for geometry in prefill:
        assert cluster.clients[geometry.rank_id].wait(8, 5).status is RoomStatus.SUCCESS


def test_a_stage_naming_a_pool_it_holds_no_layer_of_is_told_so(cluster_factory):
    prefill, decode = _split("state-on-decode-stage-2")
    cluster = cluster_factory(prefill, decode)
    stage0 = cluster.clients[decode[0].rank_id]  # kv layers only: the model's state is on stage 2
    with pytest.raises(Refused) as refused:
        stage0.expect(3, cluster.bootstrap, [0, 1], state_slots=[0], aux_row=0)
    assert refused.value.code is Reason.INDEX_OUT_OF_RANGE
    assert "decode[pp0,tp0] registered no mamba pool (it holds no layer of it)" in str(refused.value)
    assert "leave state_slots empty in decode[pp0,tp0]'s calls" in str(refused.value)
    assert "for this model" not in str(refused.value)  # the model has state, on stage 2
    with pytest.raises(Refused) as refused:  # and a prefill stage the same
        cluster.clients[prefill[0].rank_id].send(3, [0, 1], state_slots=[0], aux_row=0)
    assert "prefill[pp0,tp0] registered no mamba pool" in str(refused.value)


def test_a_swa_only_stage_between_page_sizes_is_rejected_live_as_check_rejects_it(cluster_factory):
    prefill, decode = _split("swa-only-decode-stage", decode_page_size=64)  # 16 -> 64 tokens a page
    expected = reconcile_instances(prefill, decode)
    line = (
        "swa.window_pages: prefill=pages of 16 tokens decode=stages pp1 hold sliding-window "
        "layers but no kv layer; pages of 64 tokens  [page_size_mismatch]"
    )
    assert f"  - {line}" in str(expected.error()).splitlines()
    cluster = cluster_factory(prefill, decode)
    for geometry in decode:
        cluster.clients[geometry.rank_id].expect(5, cluster.bootstrap, [], aux_row=0)
    for geometry in decode:  # every stage is told, with the lines check prints
        state = cluster.clients[geometry.rank_id].wait(5, timeout_s=10)
        assert state.status is RoomStatus.FAILED and state.code_text == "peer_rejected", state
        for printed in str(expected.error()).splitlines()[1:]:
            assert printed.strip() in state.reason, (printed, state.reason)


def _without_layers(geometry, layers):
    views = tuple(v for v in geometry.views if v.layer_id not in layers)
    return dataclasses.replace(geometry, views=views)


DAMAGES = {  # a decode PP 2 whose stage 1 leaves layers 20-22 out, or takes stage 0's layers
    "hole": (
        lambda stages: [stages[0], _without_layers(stages[1], {20, 21, 22})],
        "kv.layer[20-22].k: prefill=registered (nhd) decode=<missing>  [layer_missing]",
    ),
    "overlap": (
        lambda stages: [stages[0], dataclasses.replace(stages[0], pp_rank=1)],
        "kv.layer[0-15].k: prefill=- decode=registered by stages pp0, pp1  [tensor_duplicate]",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_decode_coverage_fault_is_rejected_live_as_check_rejects_it(cluster_factory, damage):
    prefill, decode = _instances("llama-3.1-8b", (1, 1), (2, 1), Layout.NHD)
    damaged, line = DAMAGES[damage]
    decode = damaged(decode)
    expected = reconcile_instances(prefill, decode)
    assert line in str(expected.error())
    cluster = cluster_factory(prefill, decode)
    for geometry in decode:  # each stage registers with prefill when a room first asks
        cluster.clients[geometry.rank_id].expect(5, cluster.bootstrap, [0, 1], aux_row=0)
    for geometry in decode:  # every stage is told, with the lines check prints
        state = cluster.clients[geometry.rank_id].wait(5, timeout_s=10)
        assert state.status is RoomStatus.FAILED and state.code_text == "peer_rejected", state
        for printed in str(expected.error()).splitlines()[1:]:
            assert printed.strip() in state.reason, (printed, state.reason)
