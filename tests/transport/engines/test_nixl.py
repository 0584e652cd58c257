"""The nixl transport writes into a receiver in another process, byte-exact.

Runs only where NIXL is installed
(``pip install 'pd-transfer[nixl]'``); skipped with that reason elsewhere.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

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
from pd_transfer.transport.engines.nixl import MAX_PREPARED_LISTS

pytestmark = engine_marks("nixl")
receivers = receivers_fixture("nixl")


def _transport(**kwargs):
    return direct_transport("nixl", **kwargs)


@ORACLE_CASES
async def test_nixl_write_lands_exactly_the_oracle_bytes(scenario, segments, receivers, case):
    await write_and_verify(_transport(), scenario, segments, receivers, case)


@pytest.mark.parametrize("max_prepared_rows", [1 << 21, 16], ids=["prepared", "direct"])
async def test_many_scattered_runs_land_and_prepared_rows_are_reused(segments, receivers, max_prepared_rows):
    # 20,000 scattered 2 KiB runs, twice: the second write reuses the rows the first
    # prepared (or, with too many rows to prepare, describes its runs directly)
    plan = scattered_plan("kv", 20000, 2048)
    src = np.random.default_rng(1).integers(0, 256, 2 * 20000 * 2048, np.uint8)
    before = np.random.default_rng(2).integers(0, 256, 4 * 20000 * 2048, np.uint8)
    segs = segments({"kv": before})
    peer = await receivers({"d0": segs})
    transport = _transport(max_prepared_rows=max_prepared_rows)
    link = await transport.connect(peer.endpoint("d0"))
    assert await transport.write(link, plan, {"kv": src}) == 20000 * 2048
    prepared = dict(link.prepared)
    assert await transport.write(link, plan, {"kv": src}) == 20000 * 2048
    assert link.prepared == prepared and link.num_batches == 2
    assert (list(prepared.values())[0] is None) == (max_prepared_rows == 16)
    assert np.array_equal(segs["kv"].array, expected_scatter(plan, src, before))
    await transport.close()


async def test_prepared_lists_are_kept_per_row_and_source_pools_up_to_a_bound(segments, receivers):
    # six row sizes, then the source pool at another address: every write lands
    # byte-exact; the link keeps the most recent MAX_PREPARED_LISTS lists of each side,
    # and the moved source pool gets a list of its own
    rng = np.random.default_rng(11)
    before = rng.integers(0, 256, 4 * 64 * 16384, np.uint8)
    src = rng.integers(0, 256, 2 * 64 * 16384, np.uint8)
    segs = segments({"kv": before})
    peer = await receivers({"d0": segs})
    transport = _transport()
    link = await transport.connect(peer.endpoint("d0"))
    expected = before
    rows = [512 << i for i in range(6)]
    for run in rows:
        plan = scattered_plan("kv", 64, run, seed=run)
        assert await transport.write(link, plan, {"kv": src}) == 64 * run
        expected = expected_scatter(plan, src, expected)
    assert list(link.prepared) == rows[-MAX_PREPARED_LISTS:]
    assert [row for row, _ in link.local] == rows[-MAX_PREPARED_LISTS:]
    moved = rng.integers(0, 256, src.size, np.uint8)
    plan = scattered_plan("kv", 64, rows[-1], seed=1)
    assert await transport.write(link, plan, {"kv": moved}) == 64 * rows[-1]
    expected = expected_scatter(plan, moved, expected)
    (row, pools), (row_again, moved_pools) = list(link.local)[-2:]
    assert row == row_again == rows[-1] and dict(pools)["kv"][0] == src.ctypes.data
    assert dict(moved_pools)["kv"][0] == moved.ctypes.data
    assert len(link.local) == MAX_PREPARED_LISTS
    assert np.array_equal(segs["kv"].array, expected)
    await transport.close()
    assert not link.prepared and not link.local


async def test_a_run_out_of_bounds_is_refused_before_submission(scenario, segments, receivers):
    await overrun_refused_before_submission(_transport(), scenario, segments, receivers)


async def test_connect_refuses_a_peer_whose_engine_holds_less_than_its_geometry(segments, receivers):
    await short_engine_region_refused_at_connect(_transport(), segments, receivers)


async def test_connect_refuses_a_peer_without_a_nixl_address():
    await missing_engine_address_refused_at_connect(_transport())


async def test_probes_land_in_process_memory_and_close_drops_both_agents(segments, receivers):
    transport = _transport()
    await probe_lands_and_close_drops_the_engine(
        transport, segments, receivers, lambda t: [t.engine().agent, t.receiving_engine().agent]
    )


async def test_a_request_nixl_refuses_fails_the_write_and_the_link_stays_usable(segments, receivers):
    plan_a, plan_b = scattered_plan("a", 64, 512), scattered_plan("b", 64, 512)
    src = np.random.default_rng(3).integers(0, 256, 2 * 64 * 512, np.uint8)
    segs = segments({"a": np.zeros(4 * 64 * 512, np.uint8), "b": np.zeros(4 * 64 * 512, np.uint8)})
    peer = await receivers({"d0": segs})
    transport = _transport(recovery=FAST)
    link = await transport.connect(peer.endpoint("d0"))
    # past our own bounds check (the published base of b moved by 1 GiB): NIXL's check
    # against the peer's registered memory is the second line, and refuses
    address, nbytes = link.dst_bases["b"]
    link.dst_bases["b"] = (address + (1 << 30), nbytes)
    with pytest.raises(TransportError) as info:
        await transport.write(link, plan_b, {"b": src})
    assert info.value.code is Reason.TRANSPORT_FAILED and "nixl refused" in str(info.value)
    link.dst_bases["b"] = (address, nbytes)
    assert await transport.write(link, plan_a, {"a": src}) == 64 * 512
    assert np.array_equal(segs["a"].array, expected_scatter(plan_a, src, np.zeros_like(segs["a"].array)))
    assert not segs["b"].array.any()
    await transport.close()


async def test_close_destroys_both_native_agents_at_once_after_a_refused_write(segments, receivers):
    # the refused write's traceback keeps frames of NIXL's wrapper and of the request with
    # its prepared lists; close still destroys both native agents on the closing call, with
    # the garbage collector off (left to a collection, they went at any later moment)
    plan = scattered_plan("kv", 64, 512)
    src = np.random.default_rng(8).integers(0, 256, 2 * 64 * 512, np.uint8)
    peer = await receivers({"d0": segments({"kv": np.zeros(4 * 64 * 512, np.uint8)})})
    transport = _transport(recovery=FAST)
    link = await transport.connect(peer.endpoint("d0"))
    assert await transport.write(link, plan, {"kv": src}) == 64 * 512  # lists prepared
    address, nbytes = link.dst_bases["kv"]
    link.dst_bases["kv"] = (address + (1 << 30), nbytes)
    natives = [
        weakref.ref(transport.engine().agent.agent),
        weakref.ref(transport.receiving_engine().agent.agent),
    ]
    gc.disable()
    try:
        with pytest.raises(TransportError) as info:
            await transport.write(link, scattered_plan("kv", 32, 1024), {"kv": src})
        assert "nixl refused" in str(info.value)
        await transport.close()
        assert [native() for native in natives] == [None, None]
    finally:
        gc.enable()


async def test_a_dead_peer_fails_the_write_and_the_link_is_then_refused(segments, receivers):
    await dead_peer_fails_then_refuses(
        _transport(recovery=FAST), receivers, segments, lambda spawn, segs: spawn(segs), seed=4
    )


IDLE_AGENT = """
import os, time
from pd_transfer.transport.engines.nixl_agent import NixlEngine
engine = NixlEngine("recv")
time.sleep(0.3)
before, start = os.times(), time.monotonic()
time.sleep(1.5)
after = os.times()
print((after.user + after.system - before.user - before.system) / (time.monotonic() - start))
"""


async def test_an_idle_agent_leaves_the_cpu_alone():
    # NIXL's wrapper would start the agent's progress thread with no pause between
    # polls: a whole core per idle agent, which starved sidecars' event loops in CI
    root = str(Path(__file__).resolve().parents[3])
    out = subprocess.run(
        [sys.executable, "-c", IDLE_AGENT],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert out.returncode == 0, out.stderr
    share = float(out.stdout.strip().splitlines()[-1])
    assert share < 0.3, f"an idle NIXL agent used {share:.2f} of a CPU"


def _pages(seed: int):
    """2,048 scattered 16 KiB runs (32 MiB: more than loopback buffers hold), their source
    bytes and a zeroed destination."""
    plan = scattered_plan("kv", 2048, 16384, seed=seed)
    src = np.random.default_rng(seed).integers(0, 256, 2 * 2048 * 16384, np.uint8)
    return plan, src, {"kv": np.zeros(4 * 2048 * 16384, np.uint8)}


@pytest.mark.parametrize("agent", ["own", "shared"])
async def test_a_writer_without_a_progress_thread_fills_a_passive_receiver_over_tcp(
    segments, receivers, monkeypatch, agent
):
    # the writing agent has no progress thread (its polls of the transfer progress it);
    # the receiver's agent, its own or its process's transport's as in a decode sidecar,
    # is progressed by its thread while the receiver process only waits on stdin
    monkeypatch.setenv("UCX_TLS", "tcp")
    plan, src, before = _pages(5)
    segs = segments(before)
    peer = await receivers({"d0": segs}, agent)
    transport = _transport()
    link = await transport.connect(peer.endpoint("d0"))
    assert transport.engine().progress_thread is False
    assert transport.receiving_engine().progress_thread is True
    assert await transport.write(link, plan, {"kv": src}) == 2048 * 16384
    assert np.array_equal(segs["kv"].array, expected_scatter(plan, src, before["kv"]))
    await transport.close()


@pytest.mark.parametrize("tls", ["shm", "tcp"])
async def test_a_writer_with_four_ucx_threads_lands_pages_byte_exact(segments, receivers, monkeypatch, tls):
    # NIXL's num_threads 4 on the writing agent (nixl_ucx_threads): the 2,048 descriptors
    # of one write split among four UCX workers; the default agent has none of its own
    monkeypatch.setenv("UCX_TLS", tls)
    plan, src, before = _pages(6)
    segs = segments(before)
    peer = await receivers({"d0": segs})
    transport = _transport(ucx_threads=4)
    link = await transport.connect(peer.endpoint("d0"))
    assert transport.engine().agent.get_backend_params("UCX")["num_threads"] == "4"
    assert "num_threads" not in transport.receiving_engine().agent.get_backend_params("UCX")
    for _ in range(2):
        assert await transport.write(link, plan, {"kv": src}) == 2048 * 16384
    assert np.array_equal(segs["kv"].array, expected_scatter(plan, src, before["kv"]))
    await transport.close()


async def test_a_stopped_receiver_ends_the_write_at_its_deadline(segments, receivers, monkeypatch):
    # the receiver process stopped after connect: the writer, polling the transfer's
    # state itself (no progress thread), gives up at its deadline; the link is then refused
    monkeypatch.setenv("UCX_TLS", "tcp")
    plan, src, before = _pages(6)
    peer = await receivers({"d0": segments(before)})
    transport = _transport(timeout_s=2.0, recovery=FAST)
    link = await transport.connect(peer.endpoint("d0"))
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(TransportError) as info:
            await transport.write(link, plan, {"kv": src})
        assert info.value.code is Reason.TIMEOUT, info.value
        assert 2.0 <= time.monotonic() - start < 15.0
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    with pytest.raises(TransportError) as again:
        await transport.write(link, plan, {"kv": src})
    assert again.value.code is Reason.PEER_LOST and "failed earlier" in str(again.value)
    await transport.close()


async def test_a_receiving_agent_nothing_progresses_is_refused_at_connect(segments, receivers, monkeypatch):
    # the negative control of the receivers' progress thread: over tcp, an agent without
    # one does not even answer the connect probe
    monkeypatch.setenv("UCX_TLS", "tcp")
    _, _, before = _pages(7)
    peer = await receivers({"d0": segments(before)}, "unprogressed")
    transport = _transport()
    with pytest.raises(TransportError) as info:
        await transport.connect(peer.endpoint("d0"))
    assert info.value.code is Reason.TRANSPORT_FAILED and "does not answer" in str(info.value)
    await transport.close()
