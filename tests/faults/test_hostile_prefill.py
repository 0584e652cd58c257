"""A prefill peer whose frames break the protocol: decode closes the session and says why.

The prefill instance is the test itself: a bootstrap ROUTER that hands out a
rank table naming its own control ROUTER, which then answers the decode
sidecar's Hello and Register like a prefill rank would, except for the one
frame under test. The decode sidecar refuses that frame with a Close; the
room that asked for the instance must fail at once with the refusal, not at
the bootstrap timeout, and the next room must find a fresh session.
"""

import os
import threading
import time

import pytest
import zmq
from fault_tools import tiny_ranks, wait_for

from pd_transfer.client import RoomStatus
from pd_transfer.config.sidecar import default_host_id
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Hello, RankEntry, RankTable, Register, Verdict, decode, encode


class FakePrefill:
    """Bootstrap and control sockets on 127.0.0.1 answering with ``verdict_frame``."""

    def __init__(self, geometry, verdict_frame: bytes) -> None:
        context = zmq.Context.instance()
        self.bootstrap, self.control = context.socket(zmq.ROUTER), context.socket(zmq.ROUTER)
        for sock in (self.bootstrap, self.control):
            sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.bootstrap.bind_to_random_port('tcp://127.0.0.1')}"
        control = f"tcp://127.0.0.1:{self.control.bind_to_random_port('tcp://127.0.0.1')}"
        self.entry = RankEntry(
            agent_id="fake-prefill-0",
            host_id=default_host_id(),
            control_address=control,
            pp_size=1,
            geometry=geometry,
        )
        self.verdict_frame = verdict_frame
        self.heard: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self.bootstrap, self.control):
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                identity, frame = sock.recv_multipart()[:2]
                if sock is self.bootstrap:
                    sock.send_multipart([identity, encode(RankTable(expected=1, entries=(self.entry,)))])
                    continue
                message = decode(frame)
                self.heard.append(type(message).__name__)
                if isinstance(message, Hello):
                    sock.send_multipart(
                        [identity, encode(Hello(agent_id="fake-prefill-0", role=Role.PREFILL))]
                    )
                elif isinstance(message, Register):
                    sock.send_multipart([identity, self.verdict_frame])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.bootstrap.close()
        self.control.close()


@pytest.mark.parametrize(
    "frame, code",
    [(b"\xc1", "bad_frame"), (encode(Verdict(accepted=True)), "illegal_message")],
    ids=["not-msgpack", "verdict-out-of-turn"],
)
def test_a_room_fails_at_once_when_decode_refuses_its_prefill_peer(deployment, frame, code):
    # the fake prefill speaks no handshake: its frames must reach the decode's parsers
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 1),
        tiny_ranks(Role.DECODE, 1),
        config={"bootstrap_timeout_s": 10.0, "allow_insecure": True},
    )
    decode_rank = cluster.decode[0].rank_id
    client = cluster.clients[decode_rank]
    fake = FakePrefill(cluster.prefill[0], frame)
    try:
        # the second room comes within the retry backoff: it fails at once with the same reason
        for room in (31, 32):
            client.expect(room, fake.address, [1, 2])
            started = time.monotonic()
            state = client.wait(room, 20)
            assert time.monotonic() - started < 2.0, state
            assert state.status is RoomStatus.FAILED and state.code_text == code
            assert "session closed after a bad frame from it" in state.reason
        wait_for(lambda: fake.heard.count("Close") == 1, 2.0, f"a Close on the refused session: {fake.heard}")
    finally:
        fake.close()


def test_refused_sessions_leave_no_socket_open(deployment):
    """Each refused session's socket is closed: a prefill that keeps sending bad frames
    must not run a decode sidecar out of descriptors (or ZeroMQ sockets)."""
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 1), tiny_ranks(Role.DECODE, 1), config={"allow_insecure": True}
    )  # the fake prefill speaks no handshake
    decode_rank = cluster.decode[0].rank_id
    client, pid = cluster.clients[decode_rank], cluster.sidecars[decode_rank].proc.pid
    fake = FakePrefill(cluster.prefill[0], b"\xc1")

    def open_fds() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    try:
        client.expect(40, fake.address, [1])
        assert client.wait(40, 5).status is RoomStatus.FAILED
        time.sleep(0.5)  # the Close's linger
        before = open_fds()
        for room in range(41, 61):
            client.expect(room, fake.address, [1])
            assert client.wait(room, 5).code_text == "bad_frame"
        time.sleep(0.5)
        assert open_fds() - before < 10, f"{open_fds() - before} descriptors more after 20 sessions"
    finally:
        fake.close()
