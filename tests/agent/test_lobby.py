"""The lobby's rules on real loopback connections: caps that evict idle strangers but
never a half-done handshake from the same address, the deadline, the byte budget and
the descriptor reserve; every connection ended is counted with its reason."""

import asyncio
import contextlib
import os
import resource
import socket
import time

import pytest
import zmq
import zmq.asyncio

from pd_transfer.agent.lobby import Lobby
from pd_transfer.agent.zmq_bounds import ConnectionWatch


class Pairs:
    """Loopback TCP connections: the client ends, and the accepted descriptors."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.clients: list[socket.socket] = []
        self.accepted: list[socket.socket] = []
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"

    def connect(self) -> int:
        client = socket.create_connection(self.listener.getsockname())
        server, _ = self.listener.accept()
        self.clients.append(client)
        self.accepted.append(server)
        return server.fileno()

    def cut(self, index: int) -> bool:
        """Whether the client end of connection ``index`` sees the connection end."""
        self.clients[index].settimeout(1.0)
        try:
            return self.clients[index].recv(1) == b""
        except TimeoutError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        for sock in self.clients + self.accepted + [self.listener]:
            sock.close()


@pytest.fixture
def pairs():
    made = Pairs()
    yield made
    made.close()


def _run(coroutine):
    return asyncio.run(coroutine)


def test_a_full_port_evicts_its_oldest_idle_stranger(pairs):
    async def main():
        lobby = Lobby(max_pending=2, max_total=8)
        door = lobby.door("control")
        door.bound(pairs.endpoint)
        for _ in range(3):
            door.accepted(pairs.connect())
        return lobby

    lobby = _run(main())
    assert [pairs.cut(i) for i in range(3)] == [True, False, False]
    assert lobby.refused == {("control", "pending_limit"): 1}


def test_a_half_done_handshake_is_not_evicted_by_a_newcomer_from_its_address(pairs):
    async def main():
        lobby = Lobby(max_pending=2, max_total=8)
        door = lobby.door("control")
        door.bound(pairs.endpoint)
        for _ in range(2):
            door.hello(door.accepted(pairs.connect()).fd)  # both sent their AuthHello
        assert door.accepted(pairs.connect()) is None
        return lobby

    lobby = _run(main())
    assert [pairs.cut(i) for i in range(3)] == [False, False, True]
    assert lobby.refused == {("control", "pending_limit"): 1}


def test_the_total_cap_spans_ports_and_a_member_is_no_stranger(pairs):
    async def main():
        lobby = Lobby(max_pending=8, max_total=2)
        control, bootstrap = lobby.door("control"), lobby.door("bootstrap")
        control.bound(pairs.endpoint), bootstrap.bound(pairs.endpoint)
        member = pairs.connect()
        control.accepted(member)
        control.admitted(member)  # authenticated: no longer counted
        control.accepted(pairs.connect())
        bootstrap.accepted(pairs.connect())
        bootstrap.accepted(pairs.connect())  # over the total: control's idle stranger goes
        return lobby

    lobby = _run(main())
    assert [pairs.cut(i) for i in range(4)] == [False, True, False, False]
    assert lobby.refused == {("control", "pending_limit"): 1}


def test_deadline_bytes_and_descriptor_reserve(pairs):
    async def main():
        lobby = Lobby(timeout_s=0.3, max_nbytes=64 * 1024)
        door = lobby.door("bootstrap")
        door.bound(pairs.endpoint)
        door.accepted(pairs.connect())  # silent: the deadline
        door.accepted(pairs.connect())
        pairs.clients[1].sendall(b"\0" * (256 * 1024))  # over the byte budget
        await asyncio.sleep(1.0)
        tight = Lobby(fd_limit=1)  # every descriptor is within the reserve
        door = tight.door("control")
        door.bound(pairs.endpoint)
        door.accepted(pairs.connect())
        return lobby, tight

    lobby, tight = _run(main())
    assert [pairs.cut(i) for i in range(3)] == [True, True, True]
    assert lobby.refused == {("bootstrap", "handshake_timeout"): 1, ("bootstrap", "nbytes"): 1}
    assert tight.refused == {("control", "fd_reserve"): 1}


def test_a_descriptor_of_another_socket_is_never_taken_for_a_stranger(pairs):
    async def main():
        door = Lobby(timeout_s=0.2).door("control")
        door.bound("tcp://127.0.0.1:9")  # another port than the connections'
        assert door.accepted(pairs.connect()) is None
        await asyncio.sleep(0.5)

    _run(main())
    assert not pairs.cut(0)


def test_a_descriptor_that_now_joins_other_ends_is_left_alone(pairs):
    async def main():
        lobby = Lobby(timeout_s=0.2)
        door = lobby.door("control")
        door.bound(pairs.endpoint)
        stranger = door.accepted(pairs.connect())
        stranger.ends = (("127.0.0.1", 1), ("127.0.0.1", 2))  # as if the number were reused
        await asyncio.sleep(0.5)
        return lobby

    lobby = _run(main())
    assert not pairs.cut(0) and lobby.refused == {}


def _server_ends(port: int) -> int:
    """Descriptors of this process that are accepted connections on ``port``."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except OSError:
            continue
        try:
            count += sock.getsockname()[1] == port and bool(sock.getpeername())
        except (OSError, TypeError, IndexError):
            pass
        finally:
            sock.detach()
    return count


def test_zeromq_accepts_no_further_ahead_of_an_unread_watch_than_its_monitor_queue():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"needs 8,192 descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (8192, hard))
    clients: list[socket.socket] = []

    async def main():
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        # the kernel completes the whole burst into the accept queue: on a starved host, a
        # backlog of ZeroMQ's default 100 drops SYNs that come back seconds later, one by one
        router.setsockopt(zmq.BACKLOG, 4096)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        accepted: list[int] = []
        watch = ConnectionWatch(router, "control", "test", on_accepted=accepted.append)
        for _ in range(2500):  # a burst while the sidecar's loop is busy: nobody reads the watch
            client = socket.socket()
            client.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                client.connect(("127.0.0.1", port))
            clients.append(client)
        # the loop is blocked: ZeroMQ's thread accepts what it may meanwhile (on a busy host
        # it may take long to get there: wait until the count holds still, a while past 900)
        ahead, settle = _server_ends(port), time.monotonic() + 120
        while time.monotonic() < settle:
            time.sleep(1.5)
            now = _server_ends(port)
            if now == ahead and now >= 900:
                break
            ahead = now
        reading = asyncio.create_task(watch.run())
        deadline = time.monotonic() + 60
        while len(accepted) < ahead + 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)  # it closes the monitor
        router.disable_monitor()
        router.close(linger=0)
        context.destroy(linger=0)  # every socket, the watch's monitor too, closed
        return ahead, len(accepted)

    try:
        ahead, heard = asyncio.run(main())
    finally:
        for client in clients:
            client.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # ZeroMQ waited on the monitor's queue (1,000 events and one), and accepted more once
    # the watch read it: held back, not lost (the kernel drops what its backlog cannot hold)
    assert 900 <= ahead <= 1001 + 16, ahead
    assert heard > ahead + 100, (ahead, heard)
