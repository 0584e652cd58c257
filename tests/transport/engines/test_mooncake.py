"""The mooncake transport writes into a receiver in another process, byte-exact.

Runs only where Mooncake's transfer engine is installed
(``pip install 'pd-transfer[mooncake]'``); skipped with that reason elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_harness import (
    FAST,
    ORACLE_CASES,
    dead_peer_fails_then_refuses,
    direct_transport,
    engine_marks,
    expected_scatter,
    missing_engine_address_refused_at_connect,
    overrun_refused_before_submission,
    probe_lands_and_close_drops_the_engine,
    receivers_fixture,
    scattered_plan,
    short_engine_region_refused_at_connect,
    write_and_verify,
)

from pd_transfer.errors import Reason, TransportError

pytestmark = engine_marks("mooncake")
receivers = receivers_fixture("mooncake")


def _transport(**kwargs):
    return direct_transport("mooncake", **kwargs)


@ORACLE_CASES
async def test_mooncake_write_lands_exactly_the_oracle_bytes(scenario, segments, receivers, case):
    await write_and_verify(_transport(), scenario, segments, receivers, case)


async def test_a_plan_larger_than_the_engine_queue_goes_in_capped_batches(segments, receivers):
    # 5,000 scattered 2 KiB runs: one batch this size overflows the engine's
    # per-peer queue (~2,048) and leaves the peer refusing; capped batches do not
    plan = scattered_plan("kv", 5000, 2048)
    src = np.random.default_rng(1).integers(0, 256, 2 * 5000 * 2048, np.uint8)
    before = np.random.default_rng(2).integers(0, 256, 4 * 5000 * 2048, np.uint8)
    segs = segments({"kv": before})
    peer = await receivers({"d0": segs})
    transport = _transport(max_batch_descriptors=1024)
    link = await transport.connect(peer.endpoint("d0"))
    for _ in range(2):  # and the peer still takes the next write
        assert await transport.write(link, plan, {"kv": src}) == 5000 * 2048
    assert link.num_batches == 10 and link.max_batch_descriptors == 1024
    assert np.array_equal(segs["kv"].array, expected_scatter(plan, src, before))
    await transport.close()


async def test_batches_above_half_the_engine_queue_are_refused_at_construction():
    with pytest.raises(TransportError) as info:
        _transport(max_batch_descriptors=4096)
    assert info.value.code is Reason.INVALID_CONFIG and "2048" in str(info.value)


async def test_a_run_out_of_bounds_is_refused_before_submission(scenario, segments, receivers):
    await overrun_refused_before_submission(_transport(), scenario, segments, receivers)


async def test_connect_refuses_a_peer_whose_engine_holds_less_than_its_geometry(segments, receivers):
    await short_engine_region_refused_at_connect(_transport(), segments, receivers)


async def test_probes_land_in_process_memory_and_close_drops_the_engine(segments, receivers):
    transport = _transport()
    engine = await transport.engine()
    await probe_lands_and_close_drops_the_engine(transport, segments, receivers, lambda t: [engine.engine])


async def test_connect_refuses_a_peer_without_a_mooncake_address():
    await missing_engine_address_refused_at_connect(_transport())


async def test_an_engine_error_fails_the_write_and_the_link_stays_usable(segments, receivers):
    plan_a, plan_b = scattered_plan("a", 64, 512), scattered_plan("b", 64, 512)
    src = np.random.default_rng(3).integers(0, 256, 2 * 64 * 512, np.uint8)
    segs = segments({"a": np.zeros(4 * 64 * 512, np.uint8), "b": np.zeros(4 * 64 * 512, np.uint8)})
    peer = await receivers({"d0": segs})
    transport = _transport(recovery=FAST)
    link = await transport.connect(peer.endpoint("d0"))
    await peer.unregister("d0", "b")  # the peer's engine now refuses writes into b
    with pytest.raises(TransportError) as info:
        await transport.write(link, plan_b, {"b": src})
    assert info.value.code is Reason.TRANSPORT_FAILED and "stays usable" in str(info.value)
    assert await transport.write(link, plan_a, {"a": src}) == 64 * 512
    assert np.array_equal(segs["a"].array, expected_scatter(plan_a, src, np.zeros_like(segs["a"].array)))
    await transport.close()


async def test_a_dead_peer_fails_the_write_and_the_link_is_then_refused(segments, receivers):
    await dead_peer_fails_then_refuses(
        _transport(recovery=FAST), receivers, segments, lambda spawn, segs: spawn(segs), seed=4
    )
