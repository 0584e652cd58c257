"""An address where nothing listens is told from one that is slow to answer.

:func:`fetch_table` with ``refused_after_s`` fails as soon as every connection
to the address was refused that long (a tcp port nobody binds, an ``ipc://``
path with no socket), naming the address, while a listener that accepts and
never answers (a starved or stopped process, whose kernel still accepts) is
waited for until the deadline, as before. A decode sidecar whose room names
a prefill bootstrap address where nothing listens fails the room then, not
after ``bootstrap_timeout_s``.
"""

import asyncio
import socket
import tempfile
from pathlib import Path

import pytest
import zmq.asyncio
from cluster import Cluster, small_instances

from pd_transfer.agent.bootstrap import fetch_table
from pd_transfer.client import RoomStatus
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.processes.ports import spare_port

PATIENCE_S = 600.0  # the request's own deadline: far beyond every wait below


def _fetch(address: str, timeout_s: float, refused_after_s: float) -> PdTransferError:
    async def main():
        context = zmq.asyncio.Context()
        try:  # bounded here: without the refusal the fetch would wait its whole deadline
            await asyncio.wait_for(
                fetch_table(context, address, "decode-x", timeout_s, refused_after_s=refused_after_s), 60
            )
        finally:
            context.destroy(linger=0)

    with pytest.raises(PdTransferError) as raised:
        asyncio.run(main())
    return raised.value


def test_a_tcp_port_nobody_binds_is_refused_by_name_long_before_the_deadline():
    address = f"tcp://127.0.0.1:{spare_port()}"
    err = _fetch(address, PATIENCE_S, refused_after_s=0.5)
    assert err.code is Reason.BOOTSTRAP_FAILED
    assert f"bootstrap {address}: nothing listens there" in err.message, err.message


def test_an_ipc_path_with_no_socket_is_refused_by_name():
    address = f"ipc://{tempfile.mkdtemp(prefix='pdt-')}/nobody.sock"
    err = _fetch(address, PATIENCE_S, refused_after_s=0.5)
    assert "nothing listens there" in err.message, err.message


def test_a_listener_that_accepts_and_never_answers_is_waited_for_until_the_deadline():
    with socket.socket() as listener:  # the kernel completes connections into its backlog
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        err = _fetch(address, 3.0, refused_after_s=0.5)
    assert "nothing listens" not in err.message, err.message
    assert "rank table incomplete after 3.0 s" in err.message, err.message


def test_a_decode_room_whose_prefill_is_not_running_fails_by_the_refusal(tmp_path: Path):
    _, decode = small_instances("llama-3.1-8b", 1, 1)
    slow = {"bootstrap_timeout_s": PATIENCE_S, "waiting_timeout_s": PATIENCE_S}
    cluster = Cluster(tmp_path, [], decode, config=slow)
    try:
        client = cluster.clients[decode[0].rank_id]
        nobody = f"tcp://127.0.0.1:{spare_port()}"
        client.expect(1, nobody, [0, 1])
        state = client.wait(1, timeout_s=60)
        assert state.status is RoomStatus.FAILED, (state, cluster.logs())
        assert state.code_text == "bootstrap_failed", state.reason
        assert f"{nobody}: nothing listens there" in state.reason, state.reason
    finally:
        cluster.close()
