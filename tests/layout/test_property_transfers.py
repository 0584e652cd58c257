"""Property: every generated geometry pair either moves byte-exact or is rejected
with a diagnostic. None may do neither (no crash, no silent corruption)."""

import copy

from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from transfer_check import SMALL_MODELS, transfer_and_verify

from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.views import KV_LAYOUTS

KINDS = sorted(SMALL_MODELS)


@st.composite
def model_tables(draw):
    table = copy.deepcopy(SMALL_MODELS[draw(st.sampled_from(KINDS))])
    if "attention" in table and draw(st.booleans()):
        table["attention"]["num_kv_heads"] = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
    return table


def _perturb(draw, table):
    """The decode side's model: usually the same, sometimes subtly different."""
    table = copy.deepcopy(table)
    change = draw(st.sampled_from(["none"] * 6 + ["dtype", "head_dim", "heads", "layers"]))
    event(f"perturbation: {change}")
    if change == "dtype":
        table["kv_dtype"] = "float8_e4m3fn"
    elif change == "head_dim":
        section = next(s for s in ("attention", "mla", "gdn", "mamba2", "kda") if s in table)
        key = next(k for k in ("head_dim", "kv_lora_rank", "key_head_dim") if k in table[section])
        table[section][key] *= 2
    elif change == "heads" and "attention" in table:
        table["attention"]["num_kv_heads"] *= 2
    elif change == "layers":
        table["num_layers"] += 1
    return table, change


def _build(table, role, tp, pp, layout, page_size):
    spec = model_from_table(table, f"<{role.value}>")
    return build_instance(
        spec, role, tp, pp, page_size=page_size, kv_layout=layout, num_pages=5, num_slots=2, num_aux_rows=2
    )


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_geometry_pair_transfers_exactly_or_is_rejected_with_a_diagnostic(data):
    draw = data.draw
    src_table = draw(model_tables())
    dst_table, change = _perturb(draw, src_table)
    tp_src, tp_dst = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    pp_src, pp_dst = draw(st.sampled_from([1, 1, 2])), draw(st.sampled_from([1, 1, 2]))
    layouts = (draw(st.sampled_from(KV_LAYOUTS)), draw(st.sampled_from(KV_LAYOUTS)))
    page_sizes = (4, draw(st.sampled_from([4, 4, 1, 8, 16])))
    note(
        f"{src_table['name']} tp {tp_src}->{tp_dst} pp {pp_src}->{pp_dst} layouts "
        f"{layouts[0].value}->{layouts[1].value} pages {page_sizes}"
    )
    try:
        prefill = _build(src_table, Role.PREFILL, tp_src, pp_src, layouts[0], page_sizes[0])
        decode = _build(dst_table, Role.DECODE, tp_dst, pp_dst, layouts[1], page_sizes[1])
    except PdTransferError as err:
        # refused at registration: must say why, with a stable code
        assert isinstance(err.code, Reason) and str(err).strip()
        event("rejected at registration")
        return
    recon = reconcile(prefill, decode)
    if change == "none":
        # the same model on both sides must never be refused (rejecting is not a way out),
        # whatever the page sizes: token-paged pools convert
        assert recon.ok, str(recon.error())
    if not recon.ok:
        text = str(recon.error())
        for mismatch in recon.mismatches:
            assert isinstance(mismatch.code, Reason)
            assert mismatch.path.split(".layer[")[0] in text
        assert "mismatch" in text
        event("rejected at reconciliation")
        return
    seed = data.draw(st.integers(0, 2**16))
    assert transfer_and_verify(prefill, decode, seed) == []
    event("transferred byte-exact")
