"""The shm transport maps the peer's segments and writes the planned bytes straight in."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport import PeerEndpoint, ShmTransport

pytestmark = pytest.mark.asyncio
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm_writer_child.py")


def _endpoint(rank: str, segs: dict, sizes: dict | None = None) -> PeerEndpoint:
    sizes = sizes or {r: s.nbytes for r, s in segs.items()}
    return PeerEndpoint.from_maps(rank, sizes, {r: s.name for r, s in segs.items()})


def _copy_back(sc, placed: dict) -> None:
    for rank, segs in placed.items():
        for region_id, segment in segs.items():
            sc.world.decode_buffers[rank][region_id][:] = segment.array


@pytest.mark.parametrize(
    "case", [("llama", 2, 2), ("llama", 2, 4), ("gdn", 4, 2)], ids=["direct", "sliced", "gdn"]
)
async def test_shm_write_lands_exactly_the_oracle_bytes(scenario, segments, case):
    sc = scenario(*case)
    placed = {rank: segments(regions) for rank, regions in sc.world.decode_buffers.items()}
    transport = ShmTransport()
    links = {rank: await transport.connect(_endpoint(rank, segs)) for rank, segs in placed.items()}
    for plan in sc.plans:
        assert await transport.write(links[plan.dst_rank], plan, sc.src(plan), room=1) == plan.total_nbytes
    await transport.close()
    assert all(link.closed for link in links.values())
    _copy_back(sc, placed)
    assert sc.world.verify(sc.requests) == []


async def test_torch_copies_land_through_the_links_tensor_views(scenario, segments):
    """A CUDA prefill writing into host pools copies with torch into ``link.tensors``
    (here from CPU tensors): views of the mapped segments, made on first use, same memory
    as the numpy ``regions`` the host copies use."""
    import torch

    from pd_transfer.transport.copy.device import execute_on_device

    sc = scenario("llama", 2, 4)
    placed = {rank: segments(regions) for rank, regions in sc.world.decode_buffers.items()}
    transport = ShmTransport()
    links = {rank: await transport.connect(_endpoint(rank, segs)) for rank, segs in placed.items()}
    for plan in sc.plans:
        link = links[plan.dst_rank]
        assert all(isinstance(r, np.ndarray) for r in link.regions.values())
        src = {r: torch.from_numpy(a.copy()) for r, a in sc.src(plan).items()}
        assert execute_on_device(plan, src, link.tensors) == plan.total_nbytes
        assert all(t.data_ptr() == link.regions[r].ctypes.data for r, t in link.tensors.items())
    await transport.close()
    _copy_back(sc, placed)
    assert sc.world.verify(sc.requests) == []


@pytest.mark.gpu
async def test_shm_write_from_cuda_sources_lands_the_oracle_bytes(scenario, segments):
    """A CUDA prefill writing into host pools goes through the transport's own write:
    torch copies from the device into the mapped segments, byte-exact, counted, drained."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    sc = scenario("llama", 2, 4)
    placed = {rank: segments(regions) for rank, regions in sc.world.decode_buffers.items()}
    transport = ShmTransport()
    links = {rank: await transport.connect(_endpoint(rank, segs)) for rank, segs in placed.items()}
    for plan in sc.plans:
        src = {r: torch.from_numpy(a.copy()).cuda() for r, a in sc.src(plan).items()}
        assert await transport.write(links[plan.dst_rank], plan, src, room=1) == plan.total_nbytes
    assert sum(link.nbytes_written for link in links.values()) == sum(p.total_nbytes for p in sc.plans)
    await transport.close()
    _copy_back(sc, placed)
    assert sc.world.verify(sc.requests) == []


async def test_shm_write_from_another_process(scenario, segments):
    args = {"kind": "llama", "prefill_tp": 2, "decode_tp": 4, "seed": 3}
    sc = scenario(**args)
    placed = {rank: segments(regions) for rank, regions in sc.world.decode_buffers.items()}
    names = {rank: {r: s.name for r, s in segs.items()} for rank, segs in placed.items()}
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        CHILD,
        json.dumps({"scenario": args, "segments": names}),
        env=env,
        stderr=subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    _copy_back(sc, placed)
    assert sc.world.verify(sc.requests) == []


async def test_connect_refuses_a_segment_smaller_than_the_region(segments):
    segs = segments({"kv": np.zeros(4096, np.uint8)})
    with pytest.raises(TransportError) as info:
        await ShmTransport().connect(_endpoint("d0", segs, {"kv": 8192}))
    assert info.value.code is Reason.SEGMENT_TOO_SMALL and "region 'kv'" in str(info.value)


async def test_connect_refuses_a_peer_without_segments():
    with pytest.raises(TransportError) as info:
        await ShmTransport().connect(PeerEndpoint.from_maps("d0", {"kv": 64}))
    assert info.value.code is Reason.TRANSPORT_UNSUPPORTED


async def test_plan_outside_the_mapped_region_writes_nothing(scenario, segments):
    sc = scenario("llama", 2, 2)
    plan = sc.plans[0]
    # the peer registered (and mapped) regions half the size the plan assumes
    halves = {r: b[: b.size // 2] for r, b in sc.dst(plan).items()}
    segs = segments(halves)
    transport = ShmTransport()
    link = await transport.connect(_endpoint(plan.dst_rank, segs))
    with pytest.raises(TransportError) as info:
        await transport.write(link, plan, sc.src(plan))
    assert info.value.code is Reason.RUN_OUT_OF_REGION
    assert all(np.array_equal(segs[r].array, halves[r]) for r in segs)
    await transport.close()


async def test_write_on_a_closed_link_is_refused(segments):
    segs = segments({"kv": np.zeros(64, np.uint8)})
    transport = ShmTransport()
    link = await transport.connect(_endpoint("d0", segs))
    await link.close()
    with pytest.raises(TransportError) as info:
        await transport.write(link, None, {})
    assert info.value.code is Reason.LINK_CLOSED
