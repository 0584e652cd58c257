"""The invariants every transport keeps (pd_transfer.transport.base), checked once for each.

(a) the aux row (the plan's last, small run) lands last, after every other byte;
(b) no byte outside a registered region is written: guard bytes around each
    destination stay untouched, and a plan running out of bounds is refused
    before any byte moves;
(c) a fenced room takes no late byte: after ``fence``, a write of that room
    changes nothing and is refused.

Every transport runs against the same destination: a ``kv`` region and an
``aux`` region, each with guard bytes around it in the memory that backs it.
The expected bytes come from plain numpy indexing over runs built here
(never from the planner or the copy engines). Transports whose engines are
not installed are skipped with the reason; (c) applies to the transports with
a receiver (the others write in place: an abort waits for ``Link.drain``).
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import numpy as np
import pytest
import pytest_asyncio
import zmq
from engine_harness import FAST, ReceiverProcess, direct_transport

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.memory.segments import create_segment
from pd_transfer.transport import MockTransport, PeerEndpoint, ShmTransport, TcpReceiver, TcpTransport
from pd_transfer.transport.engines.registry import engine_unusable
from pd_transfer.transport.fault_injection import CorruptingTransport, CorruptNth
from pd_transfer.transport.zmq.receiver import ZmqTcpReceiver
from pd_transfer.transport.zmq.transport import ZmqTcpTransport

pytestmark = pytest.mark.asyncio

RUN_NBYTES = 4096
NUM_RUNS = 1024  # 4 MiB of kv, scattered over twice as many slots
KV_NBYTES = 2 * NUM_RUNS * RUN_NBYTES
AUX_NBYTES = 256
GUARD_NBYTES = 4096
GUARD_BYTE = 0xA5
KINDS = ["mock", "shm", "tcp", "zmq-curve", "device", "mooncake", "nixl", "wrapped-shm"]
RECEIVING = {"tcp", "zmq-curve"}


class Rig:
    """One transport connected to one destination rank; ``backing[region]`` is the memory
    behind each destination region, ``GUARD_NBYTES`` of guard on each side (engines and
    shm: after it only, a segment's tail beyond the size the peer registered)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.transport = None
        self.link = None
        self.receiver = None
        self.backing: dict[str, np.ndarray] = {}
        self.lead = GUARD_NBYTES  # guard bytes before each region
        self._cleanup: list = []

    def dst(self, region: str) -> np.ndarray:
        nbytes = KV_NBYTES if region == "kv" else AUX_NBYTES
        return self.backing[region][self.lead : self.lead + nbytes]

    def guards_intact(self) -> bool:
        return all(
            (b[: self.lead] == GUARD_BYTE).all()
            and (b[self.lead + (KV_NBYTES if r == "kv" else AUX_NBYTES) :] == GUARD_BYTE).all()
            for r, b in self.backing.items()
        )

    async def close(self) -> None:
        if self.transport is not None:
            await self.transport.close()
        for step in reversed(self._cleanup):
            result = step()
            if asyncio.iscoroutine(result):
                await result


def _guarded(nbytes: int, lead: int) -> np.ndarray:
    return np.full(lead + nbytes + GUARD_NBYTES, GUARD_BYTE, np.uint8)


def _sizes() -> dict[str, int]:
    return {"kv": KV_NBYTES, "aux": AUX_NBYTES}


def _in_memory_backing(rig: Rig) -> dict[str, np.ndarray]:
    rig.backing = {r: _guarded(n, rig.lead) for r, n in _sizes().items()}
    for r in _sizes():
        rig.dst(r)[:] = 0
    return {r: rig.dst(r) for r in rig.backing}


def _segment_backing(rig: Rig) -> dict:
    """Shared-memory segments holding each region and a guard after it."""
    rig.lead = 0
    tag = uuid.uuid4().hex[:8]
    segments = {}
    for region, nbytes in _sizes().items():
        segment = create_segment(f"pdt-inv-{tag}-{region}", nbytes + GUARD_NBYTES)
        segment.array[:] = GUARD_BYTE
        segment.array[:nbytes] = 0
        segments[region] = segment
        rig.backing[region] = segment.array
        rig._cleanup.append(segment.unlink)
        rig._cleanup.append(segment.close)
    return segments


def _curve_options():
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()

    def server(socket: zmq.Socket) -> None:
        socket.curve_server = True
        socket.curve_publickey, socket.curve_secretkey = server_public, server_secret

    def client(socket: zmq.Socket) -> None:
        socket.curve_serverkey = server_public
        socket.curve_publickey, socket.curve_secretkey = client_public, client_secret

    return server, client


async def _rig(kind: str) -> Rig:
    rig = Rig(kind)
    if kind in ("mooncake", "nixl"):
        segments = _segment_backing(rig)
        process = await ReceiverProcess(kind, {"d0": segments}).start()
        rig._cleanup.append(process.stop)
        rig.transport = direct_transport(kind, recovery=FAST)
        rig.link = await rig.transport.connect(process.endpoint("d0", _sizes()))
        return rig
    if kind in ("shm", "wrapped-shm"):
        segments = _segment_backing(rig)
        # the test-only fault wrapper, its fault never due: it adds nothing to what it wraps
        rig.transport = (
            ShmTransport() if kind == "shm" else CorruptingTransport(ShmTransport(), CorruptNth(0))
        )
        handles = {r: s.name for r, s in segments.items()}
        rig.link = await rig.transport.connect(PeerEndpoint.from_maps("d0", _sizes(), handles))
        return rig
    regions = _in_memory_backing(rig)
    if kind == "mock":
        rig.transport = MockTransport({"d0": regions})
    elif kind == "device":
        torch = pytest.importorskip("torch", reason="the device transport copies with torch")
        from pd_transfer.transport.device import DeviceTransport

        # torch CPU tensors over the same memory stand in for CUDA IPC handles
        rig.transport = DeviceTransport(lambda handle, nbytes: torch.from_numpy(regions[handle]))
        return await _connect(rig, PeerEndpoint.from_maps("d0", _sizes(), {r: r for r in regions}))
    elif kind == "tcp":
        rig.receiver = TcpReceiver("127.0.0.1", regions)
        rig.transport = TcpTransport()
    else:
        server, client = _curve_options()
        rig.receiver = ZmqTcpReceiver("127.0.0.1", regions, socket_options=server)
        rig.transport = ZmqTcpTransport(socket_options=client)
    address = ""
    if rig.receiver is not None:
        address = await rig.receiver.start()
        rig._cleanup.append(rig.receiver.stop)
    return await _connect(rig, PeerEndpoint.from_maps("d0", _sizes(), data_address=address))


async def _connect(rig: Rig, peer: PeerEndpoint) -> Rig:
    rig.link = await rig.transport.connect(peer)
    return rig


@pytest_asyncio.fixture(params=KINDS)
async def rig(request):
    kind = request.param
    if kind in ("mooncake", "nixl") and engine_unusable(kind):
        pytest.skip(engine_unusable(kind))
    made = await _rig(kind)
    yield made
    await made.close()


def _batch(src_region: str, dst_region: str, src: np.ndarray, dst: np.ndarray, nbytes: int) -> RunBatch:
    n = len(src)
    return RunBatch(
        src_region,
        dst_region,
        np.asarray(src, np.int64),
        np.asarray(dst, np.int64),
        np.full(n, nbytes, np.int64),
        np.ones(n, np.int64),
        0,
        0,
    )


def _room_plan(seed: int) -> tuple[TransferPlan, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A room: NUM_RUNS kv runs to scattered slots, then one aux row. Returns the plan,
    its sources and the oracle's expected destination (numpy indexing, run by run)."""
    rng = np.random.default_rng(seed)
    slots = rng.permutation(2 * NUM_RUNS)[:NUM_RUNS]
    src_kv = np.arange(NUM_RUNS) * RUN_NBYTES
    sources = {
        "kv": rng.integers(1, 256, NUM_RUNS * RUN_NBYTES, np.uint8),
        "aux": rng.integers(1, 256, AUX_NBYTES, np.uint8),
    }
    expected = {"kv": np.zeros(KV_NBYTES, np.uint8), "aux": sources["aux"].copy()}
    for s, d in zip(src_kv.tolist(), (slots * RUN_NBYTES).tolist()):
        expected["kv"][d : d + RUN_NBYTES] = sources["kv"][s : s + RUN_NBYTES]
    plan = TransferPlan(
        "p0",
        "d0",
        (
            _batch("kv", "kv", src_kv, slots * RUN_NBYTES, RUN_NBYTES),
            _batch("aux", "aux", [0], [0], AUX_NBYTES),
        ),
    )
    return plan, sources, expected


def _watch_aux(rig: Rig, aux: np.ndarray, stop: threading.Event, seen: list) -> None:
    """The moment the aux row is complete, copy what kv holds."""
    dst_aux, dst_kv = rig.dst("aux"), rig.dst("kv")
    while not stop.is_set():
        if np.array_equal(dst_aux, aux):
            seen.append(dst_kv.copy())
            return


async def test_the_aux_row_lands_after_every_other_byte(rig):
    plan, sources, expected = _room_plan(seed=1)
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_watch_aux, args=(rig, sources["aux"], stop, seen), daemon=True)
    watcher.start()
    try:
        assert await rig.transport.write(rig.link, plan, sources, room=1) == plan.total_nbytes
    finally:
        await asyncio.sleep(0.05)
        stop.set()
        watcher.join()
    assert seen, "the aux row never landed"
    assert np.array_equal(seen[0], expected["kv"]), "the aux row landed before all of kv"
    assert np.array_equal(rig.dst("kv"), expected["kv"]) and np.array_equal(rig.dst("aux"), expected["aux"])


async def test_no_byte_lands_outside_the_registered_regions(rig):
    plan, sources, expected = _room_plan(seed=2)
    assert await rig.transport.write(rig.link, plan, sources, room=2) == plan.total_nbytes
    assert np.array_equal(rig.dst("kv"), expected["kv"]) and rig.guards_intact()


async def test_a_plan_out_of_bounds_is_refused_before_any_byte_moves(rig):
    plan, sources, _ = _room_plan(seed=3)
    # every run in bounds but the last kv run, which ends 16 bytes past the region
    past = _batch("kv", "kv", [0], [KV_NBYTES - RUN_NBYTES + 16], RUN_NBYTES)
    bad = TransferPlan("p0", "d0", (plan.batches[0], past, plan.batches[1]))
    before = {r: rig.dst(r).copy() for r in ("kv", "aux")}
    with pytest.raises(TransportError) as info:
        await rig.transport.write(rig.link, bad, sources, room=3)
    assert info.value.code is Reason.RUN_OUT_OF_REGION, info.value
    for region, was in before.items():
        assert np.array_equal(rig.dst(region), was), f"{region} changed"
    assert rig.guards_intact()


async def test_a_fenced_room_takes_no_late_byte(rig):
    if rig.kind not in RECEIVING:
        pytest.skip(f"{rig.kind} writes in place with no receiver: an abort waits for Link.drain")
    plan, sources, expected = _room_plan(seed=4)
    assert await rig.transport.write(rig.link, plan, sources, room=4, generation=1) == plan.total_nbytes
    landed = {r: rig.dst(r).copy() for r in ("kv", "aux")}
    await rig.receiver.fence(5, 2)
    late, late_sources, _ = _room_plan(seed=5)
    for generation in (1, 2):
        with pytest.raises(TransportError) as info:
            await rig.transport.write(rig.link, late, late_sources, room=5, generation=generation)
        assert info.value.code is Reason.STALE_GENERATION, info.value
    for region, was in landed.items():
        assert np.array_equal(rig.dst(region), was), f"a fenced write changed {region}"
    assert np.array_equal(rig.dst("kv"), expected["kv"]) and rig.guards_intact()
    # a later generation of the room is not fenced
    assert await rig.transport.write(rig.link, late, late_sources, room=5, generation=3) > 0
