"""The docs say what the code does: generated tables are current, every reason
code and metric is documented, worked examples match the planner, links resolve."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from pd_transfer.docgen import generate as docgen
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.planner import plan_pair
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import WorkerShape, build_instance, build_rank
from pd_transfer.layout.reconcile import Mode, reconcile
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.observability.metrics import METRIC_NAMES

DOCS = Path(__file__).resolve().parents[2] / "docs"
SHAPE = {"page_size": 16, "kv_layout": Layout.NHD, "num_pages": 64, "num_slots": 8}
RUNBOOK_ANCHORS = ("transfer-failures", "peer-lost", "not-ready", "rejected-peer", "timeouts", "bad-frames")


def _doc(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _flat(name: str) -> str:
    """The doc with every run of whitespace as one space (line breaks are not content)."""
    return " ".join(_doc(name).split())


def _without_generated(text: str) -> str:
    return docgen._BLOCK.sub("", text)


def _pair(preset: str, prefill_tp: int, decode_tp: int, **shape):
    spec = load_preset(preset)
    shape = {**SHAPE, **shape}
    prefill = build_instance(spec, Role.PREFILL, prefill_tp, **shape)
    decode = build_instance(spec, Role.DECODE, decode_tp, **shape)
    return prefill, decode, reconcile(prefill, decode)


def _rank(ranks, rank_id: str):
    return next(g for g in ranks if g.rank_id == rank_id)


# -- generated tables ---------------------------------------------------------------


def test_generated_tables_match_the_code():
    diff = docgen.check(DOCS)
    assert diff == "", f"docs are stale; run `python -m pd_transfer.docgen.generate`:\n{diff[:4000]}"


def test_docgen_check_reports_a_stale_table_and_exits_1(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    path = docs / "protocol.md"
    path.write_text(
        path.read_text().replace(
            "| `idle` | decode | `hello` | `greeting` |", "| `idle` | prefill | `hello` | `greeting` |"
        )
    )
    assert "-| `idle` | prefill | `hello` | `greeting` |" in docgen.check(docs)
    assert docgen.main(["--check", "--docs", str(docs)]) == 1
    assert docgen.main(["--docs", str(docs)]) == 0  # rewrites the block
    assert docgen.check(docs) == ""


def test_docgen_refuses_a_doc_that_lost_a_generated_block():
    with pytest.raises(ValueError, match=r"missing \['transitions'\]"):
        docgen.fill("no markers here", {"transitions": docgen.render_transitions}, "x.md")


def test_transition_table_lists_every_transition_of_the_code():
    rows = set(re.findall(r"^\| `(\w+)` \| (\w+) \| `(\w+)` \| `(\w+)` \|$", _doc("protocol.md"), re.M))
    expanded = set()
    for state, sender, trigger, next_state in rows:
        for role in (Role.PREFILL, Role.DECODE) if sender == "either" else (Role(sender),):
            expanded.add((state, role.value, trigger, next_state))
    from pd_transfer.protocol import TRANSITIONS

    code = {(s.value, r.value, t.value, n.value) for (s, r, t), n in TRANSITIONS.items()}
    assert expanded == code


# -- catalogs -----------------------------------------------------------------------


def test_every_reason_code_has_a_catalog_entry_with_a_fix():
    text = _without_generated(_doc("errors.md"))
    sections = dict(re.findall(r"^### `(\w+)`\n(.*?)(?=^#{2,3} |\Z)", text, re.M | re.S))
    missing = [r.value for r in Reason if r.value not in sections]
    assert missing == [], f"errors.md lacks entries for {missing}"
    no_fix = [code for code, body in sections.items() if "**Fix:**" not in body]
    assert no_fix == []
    unknown = sorted(set(sections) - {r.value for r in Reason})
    assert unknown == [], f"errors.md documents codes the code does not have: {unknown}"


def test_every_metric_is_documented_in_the_runbook():
    text = _doc("operations.md")
    assert [name for name in METRIC_NAMES if f"`{name}`" not in text] == []
    documented = set(re.findall(r"^\| `(pd_transfer_\w+)` \|", docgen.render_metrics(), re.M))
    assert documented == set(METRIC_NAMES)


def test_runbook_has_the_anchors_alert_rules_link_to():
    anchors = _anchors(_doc("operations.md"))
    assert [a for a in RUNBOOK_ANCHORS if a not in anchors] == []


def test_docs_state_the_default_http_port():
    from pd_transfer.config.sidecar import SidecarConfig

    port = SidecarConfig(role=Role.DECODE).http_port
    assert f"default port {port}" in _doc("architecture.md")
    assert f"(default {port})" in _doc("operations.md")


# -- worked examples in layouts.md ----------------------------------------------------


def _piece_rows(recon, decode, key, *, with_shard: bool) -> list[str]:
    rows = []
    for geometry in decode:
        ((writer, pieces),) = recon.pieces(key, geometry).items()
        cells = [f"`{geometry.rank_id}`"]
        if with_shard:
            cells.append(f"`{geometry.view(key).shard.describe()}`")
        cells.append(f"`{writer}`")
        cells += [f"`{piece!r}`" for piece in pieces]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def test_layouts_gqa_tp2_to_tp4_example_matches_the_planner():
    text = _flat("layouts.md")
    prefill, decode, recon = _pair("llama-3.1-8b", 2, 4)
    for row in _piece_rows(recon, decode, (Pool.KV, 0, "k"), with_shard=True):
        assert row in text
    modes = recon.modes_by_pool()
    assert set(modes[Pool.KV]) == {Mode.SLICED}
    assert f"{modes[Pool.KV][Mode.SLICED]} `kv` tensors `sliced`" in text
    from pd_transfer.layout.fanout import decode_ranks_fed

    for rank in prefill:
        assert f"{decode_ranks_fed(recon, rank.rank_id, decode[0])}" in text
    src, dst = _rank(prefill, "prefill[pp0,tp1]"), _rank(decode, "decode[pp0,tp3]")
    plan = plan_pair(recon, src, dst, {Pool.KV: ([3], [5])})
    batch = plan.batches[0]
    assert (
        f"**{plan.num_descriptors} descriptors, {plan.num_runs} runs, {plan.total_nbytes} bytes**"
    ) in text
    assert f"`count` {batch.count[0]}" in text
    assert f"each piece {batch.nbytes[0]} bytes" in text
    assert f"source stride {batch.src_stride}, destination stride {batch.dst_stride}" in text
    merged = plan_pair(recon, src, dst, {Pool.KV: ([3, 4], [5, 6])})
    assert (
        f"{merged.num_descriptors} descriptors of count {merged.batches[0].count[0]} "
        f"({merged.num_runs} runs)" in text
    )
    scattered = plan_pair(recon, src, dst, {Pool.KV: ([3, 9], [5, 6])})
    assert f"give {scattered.num_descriptors} descriptors" in text


def test_layouts_hnd_and_replicated_head_notes_match_the_planner():
    text = _flat("layouts.md")
    spec = load_preset("llama-3.1-8b")
    prefill = build_instance(spec, Role.PREFILL, 2, **SHAPE)
    decode = build_instance(spec, Role.DECODE, 2, **{**SHAPE, "kv_layout": Layout.HND})
    recon = reconcile(prefill, decode)
    assert {v.mode.value for v in recon.verdicts if v.key[0] is Pool.KV} == {"converted"}
    plan = plan_pair(recon, prefill[0], decode[0], {Pool.KV: ([3], [5])})
    assert (
        f"{plan.num_descriptors} descriptors of {plan.batches[0].count[0]} pieces of "
        f"{plan.batches[0].nbytes[0]} bytes" in text
    )
    _, q_decode, q_recon = _pair("qwen3-next-80b-a3b", 2, 4)
    key = next(v.key for v in q_decode[0].views if v.pool is Pool.KV)
    assert {w for g in q_decode[:2] for w in q_recon.pieces(key, g)} == {"prefill[pp0,tp0]"}
    assert f"`{q_decode[0].view(key).shard.describe()}`" in text


def test_layouts_mla_tp4_to_tp2_example_matches_the_planner():
    text = _doc("layouts.md")
    flat = _flat("layouts.md")
    prefill, decode, recon = _pair("deepseek-v3", 4, 2)
    key = (Pool.KV, 0, "latent")
    for geometry in decode:
        (writer,) = recon.pieces(key, geometry)
        assert re.search(rf"^\| `{re.escape(geometry.rank_id)}` \|.*\| `{re.escape(writer)}`", text, re.M)
    modes = recon.modes_by_pool()
    assert set(modes[Pool.KV]) == set(modes[Pool.AUX]) == {Mode.REPLICATED}
    assert (
        f"{modes[Pool.KV][Mode.REPLICATED]} `kv` tensors and "
        f"{modes[Pool.AUX][Mode.REPLICATED]} `aux` tensors `replicated`" in flat
    )
    plan = plan_pair(recon, prefill[0], decode[0], {Pool.KV: ([3], [5])})
    assert f"**{plan.num_descriptors} descriptors, {plan.num_runs} runs, {plan.total_nbytes} bytes**" in flat
    assert f"one contiguous run of {plan.batches[0].nbytes[0]} bytes" in flat


def test_layouts_gdn_conv_groups_example_matches_the_planner():
    text = _flat("layouts.md")
    prefill, decode, recon = _pair("qwen3-next-80b-a3b", 2, 4)
    conv = (Pool.MAMBA, 0, "conv")
    for row in _piece_rows(recon, decode, conv, with_shard=False):
        assert row in text
    for geometry in (prefill[0], decode[1]):
        assert f"`{geometry.view(conv).shard.describe()}`" in text
    view = decode[1].view(conv)
    channel_nbytes = view.item_nbytes // view.shape[1]
    pieces = recon.pieces(conv, decode[1])["prefill[pp0,tp0]"]
    assert f"512 channels = {pieces[0].length * channel_nbytes} bytes" in text
    assert f"1024 channels = {pieces[2].length * channel_nbytes} bytes" in text
    temporal = (Pool.MAMBA, 0, "temporal")
    (piece,) = recon.pieces(temporal, decode[1])["prefill[pp0,tp0]"]
    head_nbytes = decode[1].view(temporal).item_nbytes // decode[1].view(temporal).shape[1]
    assert (
        f"`{piece!r}` of `prefill[pp0,tp0]`, that is {piece.length} heads = "
        f"{piece.length * head_nbytes} bytes" in text
    )
    plan = plan_pair(recon, prefill[0], decode[1], {Pool.MAMBA: ([2], [5])})
    assert f"**{plan.num_descriptors} descriptors, {plan.total_nbytes} bytes**" in text


@pytest.mark.parametrize(
    "layout",
    [
        Layout.NHD,
        Layout.HND,
        Layout.LAYER_FIRST,
        Layout.PAGE_FIRST,
        Layout.PAGE_FIRST_DIRECT,
        Layout.PAGE_HEAD,
    ],
)
def test_layouts_stride_table_matches_the_pool_builders(layout):
    geometry = build_rank(
        load_preset("llama-3.1-8b"),
        WorkerShape(role=Role.PREFILL, tp_size=2, tp_rank=0, page_size=16, kv_layout=layout, num_pages=1024),
    )
    k0, k1, v0 = (geometry.view((Pool.KV, layer, name)) for layer, name in ((0, "k"), (1, "k"), (0, "v")))
    row = f"| `{layout.value}` | `{k0.region}` | `{tuple(k0.strides_nbytes)}` |"
    if layout.is_host:
        row += f" {k1.offset_nbytes} | {v0.offset_nbytes} |"
    else:
        row += f" region `{k1.region}`, offset {k1.offset_nbytes} | region `{v0.region}`, offset {v0.offset_nbytes} |"
    assert row in _doc("layouts.md")


def test_integration_example_views_equal_the_pool_builders():
    block = next(
        b
        for b in re.findall(r"```python\n(.*?)```", _doc("integration.md"), re.S)
        if "def nhd_kv_geometry" in b
    )
    namespace: dict = {}
    exec(compile(block, "integration.md", "exec"), namespace)
    built = build_rank(
        load_preset("llama-3.1-8b"),
        WorkerShape(
            role=Role.PREFILL, tp_size=2, tp_rank=1, page_size=16, kv_layout=Layout.NHD, num_pages=1024
        ),
    )
    mine = namespace["nhd_kv_geometry"](Role.PREFILL, 2, 1)
    assert mine.views == tuple(v for v in built.views if v.pool is Pool.KV)


# -- links ---------------------------------------------------------------------------


def _anchors(text: str) -> set[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        anchor = docgen.github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def test_relative_links_between_docs_resolve():
    broken = []
    for path in sorted(DOCS.glob("*.md")):
        text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert broken == []


def test_docs_index_lists_every_page():
    index = _doc("README.md")
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    assert [p for p in pages if f"]({p})" not in index] == []


def test_worked_example_plans_are_vectorised_not_truncated():
    # guard for the examples above: the request sizes used in layouts.md plan exactly
    prefill, decode, recon = _pair("llama-3.1-8b", 2, 4)
    plan = plan_pair(recon, prefill[1], decode[3], {Pool.KV: (np.array([3, 9]), np.array([5, 6]))})
    assert (
        plan.total_nbytes == 2 * plan_pair(recon, prefill[1], decode[3], {Pool.KV: ([3], [5])}).total_nbytes
    )
