"""The client library's handshake: it survives a sidecar that comes up late (no stale
handshake frame derails the retry), and a worker API refusal is reported as such."""

import asyncio
import shutil
import tempfile
import threading

import pytest
import zmq

from pd_transfer.client import AsyncClient, Client, ReplyTimeout, RoomStatus
from pd_transfer.protocol import worker_api
from pd_transfer.security import Decision, Gate, parse_secret

SECRET = "c0ffee" * 6


class GatedSidecar:
    """A ROUTER thread behind a real Gate that answers every admitted poll with success."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)
        self.gate = Gate(parse_secret(SECRET.encode(), "test"), "fake-sidecar")
        self.decisions: list[Decision] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(50):
                continue
            identity, frame = self.socket.recv_multipart()
            admission = self.gate.admit(identity, frame)
            self.decisions.append(admission.decision)
            if admission.decision is Decision.PASS:
                _, request = worker_api.decode_request(frame)
                self.socket.send_multipart([identity, worker_api.ok_reply(request["id"], status="success")])
            elif admission.reply is not None:
                self.socket.send_multipart([identity, admission.reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
def endpoint():
    directory = tempfile.mkdtemp(prefix="pdt-")
    yield f"ipc://{directory}/late.sock"
    shutil.rmtree(directory, ignore_errors=True)


def test_sync_client_retries_the_handshake_on_a_fresh_connection(endpoint):
    with Client(endpoint, "worker-0", timeout_s=0.3, secret=SECRET) as client:
        with pytest.raises(ReplyTimeout):
            client.poll(1)  # nobody listens yet: the hello waits in the socket
        sidecar = GatedSidecar(endpoint)
        try:
            assert client.poll(1).status is RoomStatus.SUCCESS
            assert client.poll(2).status is RoomStatus.SUCCESS  # authenticated once
        finally:
            sidecar.close()
    assert Decision.REFUSE not in sidecar.decisions


def test_async_client_retries_the_handshake_on_a_fresh_connection(endpoint):
    async def main():
        async with AsyncClient(endpoint, "worker-0", timeout_s=0.3, secret=SECRET) as client:
            with pytest.raises(ReplyTimeout):
                await client.poll(1)
            sidecar = GatedSidecar(endpoint)
            try:
                return [await client.poll(room) for room in (1, 2)], sidecar
            finally:
                sidecar.close()

    states, sidecar = asyncio.run(main())
    assert [s.status for s in states] == [RoomStatus.SUCCESS] * 2
    assert Decision.REFUSE not in sidecar.decisions
