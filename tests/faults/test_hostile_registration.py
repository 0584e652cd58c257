"""A registration is untrusted input: refused with a reason code and the field at fault.

The checks live in :mod:`pd_transfer.layout.geometry` (``registration_problems``,
``handle_problems``); a worker's ``register`` and a peer's Register both run
them. ``test_worker_process.py`` shows a live sidecar refusing such
registrations and serving on.
"""

import dataclasses

import pytest
from fault_tools import tiny_ranks

from pd_transfer.errors import GeometryError, ProtocolError, Reason
from pd_transfer.layout.geometry import (
    MAX_REGION_NBYTES,
    Region,
    Role,
    check_geometry,
    handle_problems,
    registration_problems,
)
from pd_transfer.protocol import Register, decode, encode, geometry_from_data
from pd_transfer.protocol.geometry_codec import geometry_to_data


def _rank():
    return tiny_ranks(Role.DECODE, 1)[0]


def _handles(rank, segment=None):
    return {r.id: segment or f"pdt-seg-{i}" for i, r in enumerate(rank.regions)}


def _codes(problems):
    return {(p.code, p.subject) for p in problems}


# -- the checks ----------------------------------------------------------------------


def test_two_regions_on_one_segment_are_refused_as_overlapping():
    rank = _rank()
    handles = _handles(rank)
    first, second = rank.regions[0].id, rank.regions[1].id
    handles[second] = handles[first]
    problems = handle_problems(rank, handles)
    assert _codes(problems) == {(Reason.REGION_INVALID, f"handles[{second!r}]")}
    assert f"regions {first!r} and {second!r} both map segment 'pdt-seg-0'" in problems[0].detail
    assert "overlap in [0, " in problems[0].detail
    with pytest.raises(GeometryError) as err:
        check_geometry(rank, handles)
    assert err.value.code is Reason.REGION_INVALID


def test_handles_must_name_exactly_the_regions():
    rank = _rank()
    handles = _handles(rank)
    missing = rank.regions[-1].id
    del handles[missing]
    handles["stranger"] = "pdt-stranger"
    assert _codes(handle_problems(rank, handles)) == {
        (Reason.BAD_FIELD, f"handles[{missing!r}]"),
        (Reason.UNKNOWN_REGION, "handles['stranger']"),
    }


def test_absurd_region_size_is_refused_with_its_field():
    rank = _rank()
    regions = (Region(rank.regions[0].id, MAX_REGION_NBYTES + 1),) + rank.regions[1:]
    problems = registration_problems(dataclasses.replace(rank, regions=regions))
    assert (Reason.LIMIT_EXCEEDED, "regions[0].nbytes") in _codes(problems)
    assert "more than the 70368744177664 (2**46)" in " ".join(p.detail for p in problems)


@pytest.mark.parametrize("nbytes", [0, -4096])
def test_empty_or_negative_region_is_refused(nbytes):
    rank = _rank()
    regions = rank.regions[:1] + (Region(rank.regions[1].id, nbytes),) + rank.regions[2:]
    problems = registration_problems(dataclasses.replace(rank, regions=regions))
    assert (Reason.REGION_INVALID, "regions[1].nbytes") in _codes(problems)


def test_repeated_region_id_names_both_positions():
    rank = _rank()
    regions = rank.regions + (rank.regions[0],)
    problems = registration_problems(dataclasses.replace(rank, regions=regions))
    repeated = [p for p in problems if p.subject == f"regions[{len(rank.regions)}].id"]
    assert repeated and "is also regions[0]" in repeated[0].detail


def test_absurd_view_count_is_refused_without_checking_each_view():
    rank = _rank()
    flood = dataclasses.replace(rank, views=rank.views[:1] * 100_001)
    assert _codes(registration_problems(flood)) == {(Reason.LIMIT_EXCEEDED, "views")}


def test_view_outside_its_region_is_refused_through_the_wire_codec():
    rank = _rank()
    view = rank.views[0]
    shrunk = tuple(Region(r.id, r.nbytes - 1) if r.id == view.region else r for r in rank.regions)
    raw = geometry_to_data(dataclasses.replace(rank, regions=shrunk))
    with pytest.raises(ProtocolError) as err:
        geometry_from_data(raw, "$.register.geometry")
    assert err.value.code is Reason.VIEW_OUT_OF_REGION
    assert view.path in str(err.value)


def test_peer_register_with_an_absurd_region_is_refused_at_its_field():
    rank = _rank()
    regions = (Region(rank.regions[0].id, 2**47),) + rank.regions[1:]
    frame = encode(Register(agent_id="d", host_id="h", geometry=dataclasses.replace(rank, regions=regions)))
    with pytest.raises(ProtocolError) as err:
        decode(frame)
    assert err.value.code is Reason.LIMIT_EXCEEDED
    assert "regions[0].nbytes" in str(err.value)
