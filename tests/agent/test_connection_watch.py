"""An outgoing channel follows its ZeroMQ connection: down when the peer's socket closes,
up again when a peer listens at the address once more (agent/channels.py)."""

import asyncio

import pytest
import zmq
import zmq.asyncio

from pd_transfer.agent.channels import OutgoingChannel
from pd_transfer.layout.geometry import Role
from pd_transfer.ports import spare_port

pytestmark = pytest.mark.asyncio


async def _until(predicate, what: str, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)


async def _nothing(channel, message) -> None:
    return None


async def test_a_channel_is_down_while_its_peer_is_gone_and_up_when_it_is_back():
    context = zmq.asyncio.Context()
    address = f"tcp://127.0.0.1:{spare_port()}"
    peer = context.socket(zmq.ROUTER)
    peer.bind(address)
    channel = OutgoingChannel(context, address, Role.DECODE, "prefill 0")
    try:
        channel.start(_nothing)
        await asyncio.sleep(0.2)
        assert channel.disconnected_s is None
        peer.close(linger=0)  # the peer process is gone: its socket closed
        await _until(lambda: channel.disconnected_s is not None, "the channel saw it drop")
        since = channel.disconnected_s
        await asyncio.sleep(0.3)  # ZeroMQ retries in vain: still down since then
        assert channel.disconnected_s == since
        peer = context.socket(zmq.ROUTER)
        peer.bind(address)  # a peer listens there again: reconnected
        await _until(lambda: channel.disconnected_s is None, "the channel saw it come back")
    finally:
        channel.close()
        peer.close(linger=0)
        await asyncio.sleep(0)  # let the cancelled watcher close its monitor socket
        context.destroy(linger=0)
