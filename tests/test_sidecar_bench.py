"""The sidecar bench's paced 1-page room (``benchmarks/sidecar_bench.py``): the prefill
worker sends once decode's request has reached its sidecar, as an engine paces a room,
and the pacing ends with a reason instead of waiting forever."""

from __future__ import annotations

import pytest

from benchmarks import sidecar_bench
from pd_transfer.client import RoomStatus


@pytest.fixture
def deployment(tmp_path):
    deployment = sidecar_bench.Deployment(tmp_path, 1, 1, 8, "shm")
    yield deployment
    deployment.close()


def test_a_paced_room_sends_only_once_decodes_request_is_in(deployment):
    prefill, decode = (deployment.clients[g.rank_id] for g in (*deployment.prefill, *deployment.decode))
    decode.expect(7, deployment.bootstrap, [3], aux_row=0)
    deployment.until_requested(7)
    assert prefill.poll(7).status is RoomStatus.WAITING_FOR_INPUT
    decode.abort(7)

    seconds = deployment.room(8, [0], [5], waiting=True, paced=True)
    assert 0 < seconds < 30


def test_pacing_gives_up_with_a_reason(deployment):
    with pytest.raises(RuntimeError, match="did not reach"):
        deployment.until_requested(99, timeout_s=0.3)  # decode never asked for it

    decode = deployment.clients[deployment.decode[0].rank_id]
    decode.expect(9, deployment.bootstrap, [2], aux_row=0)
    deployment.until_requested(9)
    decode.abort(9)  # the room ends on prefill too, before any send
    with pytest.raises(RuntimeError, match="ended before its send"):
        deployment.until_requested(9, timeout_s=5)
