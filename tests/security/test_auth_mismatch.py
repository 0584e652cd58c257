"""A sidecar with a secret meeting one without: a clear, immediate error, never a hang."""

import asyncio

import pytest
import zmq.asyncio
from secure_cluster import SECRET_HEX, security

from pd_transfer.agent.auth import SecureContext
from pd_transfer.agent.bootstrap import BootstrapServer, fetch_table
from pd_transfer.agent.channels import IncomingChannels, OutgoingChannel
from pd_transfer.errors import AuthError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Hello


async def _against_a_listener_without_auth(make_listener, connect):
    plain = zmq.asyncio.Context()
    keyed = SecureContext(security(SECRET_HEX, "decode-0"))
    listener, task = make_listener(plain)
    started = asyncio.get_running_loop().time()
    try:
        with pytest.raises(AuthError) as err:
            await connect(keyed, listener)
    finally:
        task.cancel()
        listener.close()
        keyed.destroy(linger=0)
        plain.destroy(linger=0)
    assert asyncio.get_running_loop().time() - started < 1.0
    return err.value


def test_a_keyed_decode_against_a_bootstrap_without_auth_fails_at_once():
    def listener(context):
        server = BootstrapServer(context, "tcp://127.0.0.1:*")
        return server, asyncio.create_task(server.serve())

    error = asyncio.run(
        _against_a_listener_without_auth(
            listener, lambda ctx, server: fetch_table(ctx, server.address, "decode-0", 5.0)
        )
    )
    assert error.code is Reason.AUTH_FAILED
    assert "answered the handshake with a close" in error.message
    assert "is authentication on at both ends?" in error.message


def test_a_keyed_decode_against_a_control_socket_without_auth_fails_at_once():
    def listener(context):
        control = IncomingChannels(context, "127.0.0.1", 0, Role.PREFILL)
        return control, asyncio.create_task(control.serve(lambda ch, msg: asyncio.sleep(0)))

    async def connect(context, control):
        channel = OutgoingChannel(context, control.address, Role.DECODE, "prefill 0")
        channel.start(lambda ch, msg: asyncio.sleep(0))
        try:
            await channel.send(Hello(agent_id="decode-0", role=Role.DECODE))
        finally:
            channel.close()

    error = asyncio.run(_against_a_listener_without_auth(listener, connect))
    assert "answered the handshake with a close" in error.message
