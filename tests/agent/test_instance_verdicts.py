"""``pd-transfer check`` and a live prefill sidecar reach the same verdict on any pair.

Both call :func:`pd_transfer.layout.instance_reconcile.reconcile_instances`; this
property test drives generated instance pairs (any model preset kind, and
models whose layer kinds come in runs, so that a pipeline stage may hold no
layer of a pool: state-only, kv-only, SWA-only or aux-only stages; PP and TP
on each side, even and uneven layer splits, layouts, dtypes, page sizes, and
stages that leave layers out or register another stage's layers) through both
entry points: the verdict lines ``check`` prints
(:func:`pd_transfer.commands.reports.verdict_report`) and the Verdict a prefill
sidecar sends a decode rank (:func:`pd_transfer.agent.prefill.acceptance
.instance_verdict` over that rank and one rank of every other stage),
rendered as the decode side reports it. A sample of the generated pairs runs
through real sidecars: a pair check accepts moves a room byte-exact (the
oracle checks it), a pair check rejects is rejected live with check's lines.
"""

import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from cluster import Cluster
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from pd_transfer.agent.prefill.acceptance import instance_verdict
from pd_transfer.client import RoomStatus
from pd_transfer.commands.reports import verdict_report
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.instance_reconcile import reconcile_instances, stage_representatives
from pd_transfer.layout.presets import load_preset, model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import KV_LAYOUTS, Layout

sys.path.insert(0, str(Path(__file__).parents[1] / "layout"))
from transfer_check import SMALL_MODELS, random_requests  # noqa: E402

MODELS = ["llama-3.1-8b", "qwen3-next-80b-a3b", "deepseek-v3", "gpt-oss-20b", "kimi-linear-48b-a3b"]
SMALL = dict(num_pages=4, num_slots=2, num_aux_rows=2)
# the geometry of each layer kind, from the small models of tests/layout/transfer_check.py
GEOMETRY = {
    "attention": SMALL_MODELS["swa"]["attention"],
    "sliding_attention": SMALL_MODELS["swa"]["sliding_attention"],
    "mla": SMALL_MODELS["mla"]["mla"],
    "gdn": SMALL_MODELS["gdn"]["gdn"],
    "kda": SMALL_MODELS["kda"]["kda"],
    "mamba2": SMALL_MODELS["mamba2"]["mamba2"],
}


@st.composite
def layered_models(draw):
    """A model whose layer kinds come in runs (``[attention x2, gdn x3, ...]``): split
    over stages, some stage holds no layer of some pool."""
    full = draw(st.sampled_from(["attention", "mla"]))
    kinds = [full, "none"]
    kinds += [draw(st.sampled_from(["gdn", "kda", "mamba2", None]))]
    kinds = [kind for kind in kinds if kind is not None]
    kinds += ["sliding_attention"] if full == "attention" and draw(st.booleans()) else []
    runs = draw(st.lists(st.tuples(st.sampled_from(kinds), st.integers(1, 3)), min_size=1, max_size=4))
    runs.insert(draw(st.integers(0, len(runs))), (full, draw(st.integers(1, 3))))  # one run at least
    layers = [kind for kind, count in runs for _ in range(count)]
    table = {"name": "runs", "num_layers": len(layers), "layer_kinds": layers}
    table.update({kind: dict(GEOMETRY[kind]) for kind in set(layers) if kind in GEOMETRY})
    return model_from_table(table, "<generated>")


@st.composite
def pp_splits(draw, num_layers: int):
    """``(pp_size, pp_layers)``: an even split (None), or layers per stage cut anywhere."""
    pp_size = draw(st.integers(1, min(4, num_layers)))
    if pp_size == 1 or draw(st.booleans()):
        return pp_size, None
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=pp_size - 1, max_size=pp_size - 1)))
    return pp_size, tuple(b - a for a, b in zip([0, *cuts], [*cuts, num_layers]))


def _damaged(ranks, damage, stage, layers):
    """``ranks`` with one stage leaving ``layers`` out, or registering the stage before's."""
    if damage == "hole":
        return [
            dataclasses.replace(g, views=tuple(v for v in g.views if v.layer_id not in layers))
            if g.pp_rank == stage
            else g
            for g in ranks
        ]
    if damage == "overlap" and stage > 0:
        before = {g.tp_rank: g for g in ranks if g.pp_rank == stage - 1}
        return [
            dataclasses.replace(before[g.tp_rank], pp_rank=stage) if g.pp_rank == stage else g for g in ranks
        ]
    return ranks


@st.composite
def instance_pairs(
    draw,
    tp_sizes=(1, 2, 4),
    damages=("none", "none", "hole", "overlap"),
    dtypes=(None, None, "float8_e4m3fn"),
):
    presets = st.sampled_from(MODELS).map(load_preset)
    spec = draw(st.one_of(presets, layered_models(), layered_models(), layered_models()))
    sides = []
    for role in (Role.PREFILL, Role.DECODE):
        pp_size, pp_layers = draw(pp_splits(spec.num_layers))
        shape = dict(
            kv_layout=draw(st.sampled_from(sorted(KV_LAYOUTS, key=lambda x: x.value)))
            if role is Role.DECODE
            else Layout.NHD,
            page_size=draw(st.sampled_from([16, 64])),
            kv_dtype=draw(st.sampled_from(dtypes)),
            pp_layers=pp_layers,
        )
        try:
            ranks = build_instance(spec, role, draw(st.sampled_from(tp_sizes)), pp_size, **shape, **SMALL)
        except PdTransferError:
            assume(False)
        damage = draw(st.sampled_from(damages))
        stage = draw(st.integers(0, max(g.pp_rank for g in ranks)))
        layers = set(draw(st.lists(st.integers(0, spec.num_layers - 1), max_size=4)))
        sides.append(_damaged(ranks, damage, stage, layers))
    own = draw(st.sampled_from(sides[1]))
    return sides[0], sides[1], own


def _live_lines(prefill, decode, own) -> list[str]:
    """What decode rank ``own`` reports: accepted, or the Verdict's headline and mismatch
    lines, judged as the prefill sidecar judges it (its rank and one of every other stage)."""
    recon, headline, records = instance_verdict(prefill, stage_representatives(decode, own))
    if recon.ok:
        return ["verdict: ACCEPTED"]
    hints = dict.fromkeys(r.hint for r in records if r.hint)
    return (
        ["verdict: REJECTED", headline]
        + [f"  - {r.render()}" for r in records]
        + [f"  hint: {h}" for h in hints]
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instance_pairs())
def test_check_prints_the_verdict_live_reconciliation_reaches(pair):
    prefill, decode, own = pair
    _, printed = verdict_report(prefill, decode)
    printed = "\n".join(printed).splitlines()
    live = _live_lines(prefill, decode, own)
    event(live[0])
    for side, ranks in (("prefill", prefill), ("decode", decode)):
        if len({frozenset(g.pools()) for g in ranks}) > 1:
            event(f"a {side} stage without some pool")
    if live == ["verdict: ACCEPTED"]:
        assert printed == live
        return
    assert printed[0] == "verdict: REJECTED"
    assert printed[1].startswith(live[1] + ": ")  # check adds the count of mismatches
    assert printed[2:] == live[2:]


@settings(
    max_examples=4,
    derandomize=True,  # the same sample every run
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(instance_pairs(tp_sizes=(1, 2), damages=("none",), dtypes=(None,)))
def test_live_sidecars_reach_checks_verdict_on_a_sample_of_the_pairs(pair):
    prefill, decode, _ = pair
    assume(len(prefill) + len(decode) <= 6)  # sidecar processes on a shared machine
    assume(len({frozenset(g.pools()) for g in prefill + decode}) > 1)  # a stage lacks a pool
    recon, printed = verdict_report(prefill, decode)
    event(printed[0])
    workdir = Path(tempfile.mkdtemp(prefix="pdt-"))
    cluster = Cluster(workdir, prefill, decode)
    try:
        if recon.ok:
            _moves_a_room_byte_exact(cluster)
        else:
            _is_rejected_with_checks_lines(cluster, printed)
    finally:
        cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _moves_a_room_byte_exact(cluster: Cluster) -> None:
    requests = random_requests(cluster.prefill, cluster.decode, np.random.default_rng(11))
    cluster.expect(4, requests)  # each worker names only the pools its stage registers
    cluster.send(4, requests, chunk_pages=2)
    states = cluster.wait_decode(4)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []


def _is_rejected_with_checks_lines(cluster: Cluster, printed: list[str]) -> None:
    for geometry in cluster.decode:
        cluster.clients[geometry.rank_id].expect(4, cluster.bootstrap, [], aux_row=0)
    for geometry in cluster.decode:
        state = cluster.clients[geometry.rank_id].wait(4, timeout_s=15)
        assert state.status is RoomStatus.FAILED and state.code_text == "peer_rejected", state
        for line in "\n".join(printed).splitlines()[2:]:
            assert line.strip() in state.reason, (line, state.reason)


def _llama(role, tp, pp):
    return build_instance(
        load_preset("llama-3.1-8b"), role, tp, pp, page_size=16, kv_layout=Layout.NHD, **SMALL
    )


def test_a_layer_two_decode_stages_register_is_named_with_both_stages():
    decode = _damaged(_llama(Role.DECODE, 1, 2), "overlap", 1, set())
    recon = reconcile_instances(_llama(Role.PREFILL, 2, 1), decode)
    text = str(recon.error())
    assert "kv.layer[0-15].k: prefill=- decode=registered by stages pp0, pp1  [tensor_duplicate]" in text
    # stage 1 registers stage 0's layers instead of its own: those are missing too
    assert "kv.layer[16-31].k: prefill=registered (nhd) decode=<missing>  [layer_missing]" in text


def test_aux_rows_go_to_every_decode_stage_that_registers_them():
    prefill, decode = _llama(Role.PREFILL, 2, 1), _llama(Role.DECODE, 2, 2)
    recon = reconcile_instances(prefill, decode)
    assert recon.ok
    aux = [v.key for v in decode[0].views if v.layer_id is None]
    assert aux
    for geometry in decode:  # each stage's ranks are fed the rows, by some prefill rank
        assert all(recon.pieces(key, geometry) for key in aux)


def test_state_layers_stay_with_the_stage_that_owns_the_layer():
    spec = load_preset("qwen3-next-80b-a3b")
    decode = build_instance(spec, Role.DECODE, 1, 3, page_size=16, kv_layout=Layout.NHD, **SMALL)
    prefill = build_instance(spec, Role.PREFILL, 2, 2, page_size=16, kv_layout=Layout.NHD, **SMALL)
    recon = reconcile_instances(prefill, decode)
    assert recon.ok
    by_id = {g.rank_id: g for g in prefill}
    for geometry in decode:
        kv_layers = {v.layer_id for v in geometry.views if v.pool.value == "kv"}
        state_layers = {v.layer_id for v in geometry.views if v.pool.value == "mamba"}
        layers = kv_layers | state_layers
        assert layers and max(layers) - min(layers) + 1 == len(layers)  # one contiguous span
        for view in geometry.views:  # a layer's pieces come only from ranks holding it
            if view.layer_id is not None:
                sources = recon.pieces(view.key, geometry)
                assert sources and all(by_id[s].view(view.key) is not None for s in sources)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_hole_on_either_side_names_the_layers_and_the_side(side):
    prefill, decode = _llama(Role.PREFILL, 1, 3), _llama(Role.DECODE, 2, 2)
    if side == "prefill":
        prefill = _damaged(prefill, "hole", 2, {25, 26})
    else:
        decode = _damaged(decode, "hole", 1, {25, 26})
    recon = reconcile_instances(prefill, decode)
    missing = [m for m in recon.error().mismatches if m.code is Reason.LAYER_MISSING]
    assert {m.path for m in missing} == {"kv.layer[25-26].k", "kv.layer[25-26].v"}
    assert all((m.prefill is None) == (side == "prefill") for m in missing)


def test_prefill_answers_a_decode_stage_once_every_stage_has_a_rank_registered():
    import asyncio

    from pd_transfer.agent.prefill.decode_instances import DecodeInstances, instance_size
    from pd_transfer.protocol import Register

    decode = _llama(Role.DECODE, 2, 2)  # stage major: pp0 tp0, pp0 tp1, pp1 tp0, pp1 tp1

    def register(geometry, pp_size=2):
        return Register(agent_id="d", host_id="h", geometry=geometry, instance="dec", pp_size=pp_size)

    async def scenario():
        book = DecodeInstances()
        assert instance_size(register(decode[0])) == 4
        assert await book.gathered(register(decode[0]), 0.05) is None  # stage 1 silent
        assert book.missing(register(decode[0])) == "decode[pp1,tp0-1]"
        waiting = asyncio.create_task(book.gathered(register(decode[1]), 5))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        book.add(register(decode[3]))
        assert [g.rank_id for g in await waiting] == [decode[1].rank_id, decode[3].rank_id]
        single = _llama(Role.DECODE, 2, 1)[1]  # PP 1: its own stage is the whole instance
        assert await book.gathered(register(single, pp_size=1), 0.05) == [single]

    asyncio.run(scenario())
