"""The mock transport runs the real engine in-process and plays scripted faults."""

from __future__ import annotations

import asyncio
import time

import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport import Fault, FaultKind, MockTransport, PeerEndpoint

pytestmark = pytest.mark.asyncio


async def _setup(sc, *faults):
    transport = MockTransport(sc.world.decode_buffers, faults=faults)
    links = {
        rank: await transport.connect(PeerEndpoint.from_maps(rank, {r: b.size for r, b in regions.items()}))
        for rank, regions in sc.world.decode_buffers.items()
    }
    return transport, links


async def test_mock_write_lands_exactly_the_oracle_bytes(scenario):
    sc = scenario("llama", 2, 4)
    transport, links = await _setup(sc)
    for plan in sc.plans:
        assert (
            await transport.write(links[plan.dst_rank], plan, sc.src(plan), room=1, generation=2)
            == plan.total_nbytes
        )
    assert sc.world.verify(sc.requests) == []
    assert [(w.room, w.generation, w.faults) for w in transport.writes] == [(1, 2, ())] * len(sc.plans)


async def test_nth_write_fails_with_the_scripted_reason_and_writes_nothing(scenario):
    sc = scenario("llama", 2, 2)
    transport, links = await _setup(sc, Fault.fail(on_write=2, reason=Reason.PEER_LOST))
    first, second = sc.plans
    await transport.write(links[first.dst_rank], first, sc.src(first))
    with pytest.raises(TransportError) as info:
        await transport.write(links[second.dst_rank], second, sc.src(second))
    assert info.value.code is Reason.PEER_LOST
    assert transport.writes[1].nbytes == 0 and transport.writes[1].faults == (FaultKind.FAIL,)
    untouched = sc.world.verify(sc.requests)
    assert untouched and not any(first.dst_rank in line for line in untouched)


async def test_partial_write_lands_a_prefix_then_raises(scenario):
    sc = scenario("llama", 2, 2)
    plan = sc.plans[0]
    transport, links = await _setup(
        sc, Fault.partial(on_write=1, prefix_nbytes=20000, reason=Reason.TRANSPORT_FAILED)
    )
    dst = sc.dst(plan)
    before = {r: b.copy() for r, b in dst.items()}
    with pytest.raises(TransportError) as info:
        await transport.write(links[plan.dst_rank], plan, sc.src(plan))
    assert info.value.code is Reason.TRANSPORT_FAILED and "20000 of" in str(info.value)
    changed = sum(int((dst[r] != before[r]).sum()) for r in dst)
    assert 0 < changed <= 20000


async def test_corrupt_write_reports_success_with_one_byte_wrong(scenario):
    sc = scenario("llama", 2, 2)
    transport, links = await _setup(sc, Fault.corrupt(on_write=1, byte_index=100))
    for plan in sc.plans:
        await transport.write(links[plan.dst_rank], plan, sc.src(plan))
    problems = sc.world.verify(sc.requests)
    assert len(problems) == 1 and "1/" in problems[0]


async def test_delay_then_success(scenario):
    sc = scenario("gdn", 2, 2)
    plan = sc.plans[0]
    transport, links = await _setup(sc, Fault.delay(on_write=1, delay_s=0.2))
    started = time.monotonic()
    assert await transport.write(links[plan.dst_rank], plan, sc.src(plan)) == plan.total_nbytes
    assert time.monotonic() - started >= 0.2


async def test_dropped_write_never_returns_so_the_callers_timeout_fires(scenario):
    sc = scenario("gdn", 2, 2)
    plan = sc.plans[0]
    transport, links = await _setup(sc, Fault.drop(on_write=1))
    before = {r: b.copy() for r, b in sc.dst(plan).items()}
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(transport.write(links[plan.dst_rank], plan, sc.src(plan)), 0.2)
    assert all((sc.dst(plan)[r] == before[r]).all() for r in before)
    await transport.close()  # drains the dropped write without hanging


async def test_faults_can_count_writes_of_one_peer(scenario):
    sc = scenario("llama", 2, 2)
    first, second = sc.plans
    transport, links = await _setup(
        sc, Fault.fail(on_write=1, peer_id=second.dst_rank, reason=Reason.TIMEOUT)
    )
    await transport.write(links[first.dst_rank], first, sc.src(first))  # other peer: no fault
    with pytest.raises(TransportError) as info:
        await transport.write(links[second.dst_rank], second, sc.src(second))
    assert info.value.code is Reason.TIMEOUT


async def test_connect_refuses_an_unregistered_peer():
    with pytest.raises(TransportError) as info:
        await MockTransport().connect(PeerEndpoint("nobody"))
    assert info.value.code is Reason.NOT_REGISTERED


async def test_drain_waits_for_a_write_whose_caller_gave_up(scenario):
    # an abort must not tell decode its pages are free while a late write can still land
    sc = scenario("gdn", 2, 2)
    plan = sc.plans[0]
    transport, links = await _setup(sc, Fault.delay(on_write=1, delay_s=0.3))
    link = links[plan.dst_rank]
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(transport.write(link, plan, sc.src(plan)), 0.05)
    untouched = {r: b.copy() for r, b in sc.dst(plan).items()}
    await link.drain()
    assert any((sc.dst(plan)[r] != untouched[r]).any() for r in untouched)  # it did land, later
