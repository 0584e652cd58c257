"""A stranger's frame read after ZeroMQ reported its connection's end is still judged and counted.

On a busy host the sidecar's loop may handle a connection's accept and end
before it reads the frame that connection sent: the frame is no less a bad
frame (or a failed proof) for arriving late, and the alerts count on it.
"""

import asyncio
import time

import zmq
import zmq.asyncio
from secure_cluster import SECRET_HEX, security

from pd_transfer.agent.auth import SecureContext
from pd_transfer.agent.channels import IncomingChannels
from pd_transfer.layout.geometry import Role


async def _nothing(channel, message) -> None:
    return None


async def _garbage_read_after_its_end() -> list[str]:
    context = SecureContext(security(SECRET_HEX, "prefill-0"))
    bad_frames: list[str] = []
    router = IncomingChannels(context, "127.0.0.1", 0, Role.PREFILL, on_bad_frame=bad_frames.append)
    plain = zmq.Context()
    stranger = plain.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 30_000)  # close() waits for the frame to leave
    stranger.connect(router.address)
    stranger.send(b"\xc1 this is not msgpack")
    stranger.close()
    serving = None
    try:
        deadline = time.monotonic() + 60
        while router.watch.closed < 1:  # its accept and its end, handled before its frame is read
            if time.monotonic() > deadline:
                raise AssertionError("ZeroMQ never reported the stranger's connection ended")
            router.watch.drain()
            await asyncio.sleep(0.05)
        serving = asyncio.create_task(router.serve(_nothing))
        deadline = time.monotonic() + 60
        while not bad_frames and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return bad_frames
    finally:
        if serving is not None:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        router.close()
        context.destroy(linger=0)
        plain.term()


def test_a_garbage_frame_read_after_its_connection_ended_is_counted():
    assert asyncio.run(_garbage_read_after_its_end()) == ["unauthenticated"]
