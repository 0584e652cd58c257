"""A bug in a prefill write (an exception that is no PdTransferError) fails its room at
once with the reason, and the sidecar goes on serving: the write task never ends
silently, leaving the room to time out in transferring."""

import os
import textwrap
import time

import numpy as np
from cluster import random_requests, small_instances

from pd_transfer.client import RoomStatus
from pd_transfer.errors import Reason

BUGGY_ROOM = 13

# Loaded by every Python process started with this directory first on its path: the
# sidecars. It plants a bug in the shm writer for one room only.
SITECUSTOMIZE = textwrap.dedent(f"""
    from pd_transfer.transport import shm

    _write = shm.ShmTransport.write

    async def write(self, link, plan, src_regions, *, room=0, generation=0):
        if room == {BUGGY_ROOM}:
            raise KeyError("a bug planted by the test")
        return await _write(self, link, plan, src_regions, room=room, generation=generation)

    shm.ShmTransport.write = write
""")


def test_a_bug_in_a_write_fails_the_room_at_once_and_the_sidecar_serves_on(
    cluster_factory, tmp_path, monkeypatch
):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join(
            [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    prefill, decode = small_instances("llama-3.1-8b", 1, 1)
    # the transfer timeout is long: a room failed within seconds did not wait for it
    cluster = cluster_factory(prefill, decode, config={"transfer_timeout_s": 60.0})
    rng = np.random.default_rng(5)

    requests = random_requests(prefill, decode, rng, pages=2)
    cluster.expect(BUGGY_ROOM, requests)
    started = time.monotonic()
    cluster.send(BUGGY_ROOM, requests)
    (state,) = cluster.wait_decode(BUGGY_ROOM, timeout_s=30).values()
    assert time.monotonic() - started < 10
    assert state.status is RoomStatus.FAILED
    assert state.code is Reason.TRANSPORT_FAILED
    assert "internal error in the prefill sidecar" in state.reason
    assert "a bug planted by the test" in state.reason
    prefill_state = cluster.clients[prefill[0].rank_id].poll(BUGGY_ROOM)
    assert prefill_state.status is RoomStatus.FAILED
    assert "Traceback" in cluster.logs() and "internal error" in cluster.logs()

    requests = random_requests(prefill, decode, rng, pages=3)
    cluster.expect(BUGGY_ROOM + 1, requests)
    cluster.send(BUGGY_ROOM + 1, requests)
    (state,) = cluster.wait_decode(BUGGY_ROOM + 1).values()
    assert state.status is RoomStatus.SUCCESS
    assert cluster.verify(requests) == []
