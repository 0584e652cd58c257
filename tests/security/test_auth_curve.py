"""CURVE: sidecars with a deployment keypair transfer as before; a client that does not
know the server's public key cannot even reach the handshake."""

import socket

import pytest
from hostile_wire import connection_dropped, wait_for, zmtp_greeting
from secure_cluster import (
    SECRET_HEX,
    RawPeer,
    metric,
    ranks,
    requests,
    run_with,
    security,
    start,
    write_secret,
)

from pd_transfer.agent.bootstrap import fetch_table
from pd_transfer.client import RoomStatus
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.processes.ports import spare_port
from pd_transfer.protocol import Hello, encode
from pd_transfer.security.curve import PUBLIC_KEY_FILE, SECRET_KEY_FILE, write_keys


@pytest.fixture(scope="module")
def curved(workdir):
    keys = workdir / "keys"
    write_keys(str(keys))
    secret = write_secret(workdir, "secret", SECRET_HEX)
    data_port = spare_port()
    cluster = start(
        workdir,
        ranks(Role.PREFILL, 1),
        ranks(Role.DECODE, 1),
        secret,
        config={"curve_secret_key_file": str(keys / SECRET_KEY_FILE)},
        transport="tcp",
        decode_config={"data_port": data_port},
    )
    cluster.data_address = ("127.0.0.1", data_port)
    cluster.public_key = (keys / PUBLIC_KEY_FILE).read_text().strip()
    yield cluster
    cluster.close()


def test_sidecars_with_curve_move_a_room_byte_exact(curved):
    curved.expect(1, requests(1))
    curved.send(1, requests(1))
    states = curved.wait_decode(1, timeout_s=15)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, curved.logs())
    assert curved.verify_landed(1, requests(1)) == []
    assert "CURVE server key" in "".join(s.log.read_text() for s in curved.sidecars.values())


def test_a_client_without_the_server_key_cannot_talk(curved):
    # the right shared secret, but no CURVE: the connection never completes
    with pytest.raises(PdTransferError) as err:
        run_with(security(SECRET_HEX), lambda ctx: fetch_table(ctx, curved.bootstrap, "x", 1.0))
    assert err.value.code is Reason.BOOTSTRAP_FAILED and "no answer" in str(err.value)
    plain = RawPeer(curved.ready["prefill[pp0,tp0]"]["control_address"])
    try:
        assert plain.ask(encode(Hello(agent_id="plain", role=Role.DECODE)), timeout_s=0.5) is None
    finally:
        plain.close()
    # with the server's public key the same request gets the table
    keyed = security(SECRET_HEX, curve_server_key=curved.public_key)
    assert run_with(keyed, lambda ctx: fetch_table(ctx, curved.bootstrap, "x", 3.0)).complete
    assert metric(curved, "prefill[pp0,tp0]", "pd_transfer_auth_failures_total") == 0


def test_the_curve_data_port_counts_the_connections_it_ends(curved):
    """A stranger speaking ZeroMQ without CURVE to decode's data port is dropped at the
    handshake; the drop is counted as a bad frame and the ended connection in
    ``pd_transfer_connections_closed_total{socket="data"}``, as on the control port."""
    rank = "decode[pp0,tp0]"
    closed = metric(curved, rank, "pd_transfer_connections_closed_total", socket="data")
    bad = metric(curved, rank, "pd_transfer_bad_frames_total")
    stranger = socket.create_connection(curved.data_address, timeout=5)
    try:
        stranger.sendall(zmtp_greeting())  # the NULL mechanism, where CURVE is required
        assert connection_dropped(stranger)
    finally:
        stranger.close()
    wait_for(
        lambda: metric(curved, rank, "pd_transfer_connections_closed_total", socket="data") == closed + 1,
        5,
        "the ended data connection counted",
    )
    assert metric(curved, rank, "pd_transfer_bad_frames_total") == bad + 1
    # the prefill's own data connection is unaffected: a room still lands
    curved.expect(2, requests(2))
    curved.send(2, requests(2))
    states = curved.wait_decode(2, timeout_s=15)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, curved.logs())
    assert curved.verify_landed(2, requests(2)) == []
