"""Real sidecars with a shared secret: byte-exact transfers for peers that hold it; no key,
a wrong key and a replayed handshake are each refused with a reason, counted in /metrics,
never reach registration, and the prefill keeps serving the good decode."""

import asyncio
import urllib.request

import pytest
from cluster import Sidecar
from secure_cluster import (
    SECRET_HEX,
    WRONG_HEX,
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
from pd_transfer.agent.channels import OutgoingChannel
from pd_transfer.client import AsyncClient, AuthFailed, Client, Refused, RoomStatus, allocate_pools
from pd_transfer.errors import AuthError, PdTransferError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Close, Hello, decode, encode
from pd_transfer.security import ClientHandshake, new_routing_id, parse_secret
from pd_transfer.security.messages import AuthResult
from pd_transfer.security.messages import decode as decode_auth

AUTH_FAILURES = "pd_transfer_auth_failures_total"
P0 = "prefill[pp0,tp0]"


@pytest.fixture(scope="module")
def secured(workdir):
    secret = write_secret(workdir, "secret", SECRET_HEX)
    cluster = start(workdir, ranks(Role.PREFILL, 2), ranks(Role.DECODE, 1), secret)
    cluster.wrong_secret = write_secret(workdir, "wrong", WRONG_HEX)
    yield cluster
    cluster.close()


def _transfer(cluster, room: int) -> None:
    cluster.expect(room, requests(room))
    cluster.send(room, requests(room))
    states = cluster.wait_decode(room, timeout_s=15)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify_landed(room, requests(room)) == []


def _control(cluster) -> str:
    return cluster.ready[P0]["control_address"]


def test_sidecars_holding_the_secret_move_a_room_byte_exact(secured):
    before = metric(secured, P0, AUTH_FAILURES)  # the refusal tests may have run first
    _transfer(secured, 1)
    assert metric(secured, P0, AUTH_FAILURES) == before


def test_a_peer_without_the_key_is_refused_counted_and_never_registers(secured, no_secret):
    verdicts = metric(secured, P0, "pd_transfer_verdicts_total")
    intruder = RawPeer(_control(secured))
    try:  # a decode without a key opens its session with Hello
        reply = decode(intruder.ask(encode(Hello(agent_id="intruder", role=Role.DECODE))))
    finally:
        intruder.close()
    assert isinstance(reply, Close) and reply.reason is Reason.UNAUTHENTICATED
    assert "requires authentication" in reply.reason_text
    with pytest.raises(PdTransferError) as err:  # the rank table is not handed out either
        run_with(security(), lambda ctx: fetch_table(ctx, secured.bootstrap, "intruder", 3.0))
    assert err.value.code is Reason.UNAUTHENTICATED
    with Client(secured.sidecars[P0].endpoint, "intruder", timeout_s=3) as worker:
        with pytest.raises(Refused) as refused:  # nor the worker API
            worker.poll(1)
    assert refused.value.code is Reason.UNAUTHENTICATED
    assert metric(secured, P0, AUTH_FAILURES, role="prefill", reason="unauthenticated") >= 3
    # control and worker frames are bad frames too (the bootstrap counts its own)
    assert metric(secured, P0, "pd_transfer_bad_frames_total", reason="unauthenticated") >= 2
    assert metric(secured, P0, "pd_transfer_verdicts_total") == verdicts  # never reached registration


def test_decode_sidecars_without_a_key_or_with_the_wrong_key_fail_rooms_with_the_reason(secured, no_secret):
    before = {
        reason: metric(secured, P0, AUTH_FAILURES, reason=reason)
        for reason in ("auth_failed", "unauthenticated")
    }
    geometry = ranks(Role.DECODE, 1)[0]
    base = {"http_port": 0, "bootstrap_timeout_s": 5.0}
    keys = {"no-key": None, "wrong-key": str(secured.wrong_secret)}
    sidecars = {
        name: Sidecar(
            secured.workdir,
            "decode",
            f"decode-{name}",
            {**base, **({"secret_file": path} if path else {"allow_insecure": True})},
        )
        for name, path in keys.items()
    }
    pools, states = [], {}
    try:
        for name, sidecar in sidecars.items():
            ready = sidecar.wait_ready()
            pools.append(allocate_pools(geometry, f"t-{name}"))
            with Client(sidecar.endpoint, name, timeout_s=10, secret_file=keys[name] or "") as client:
                client.register(geometry, pools[-1].handles)
                client.expect(7, secured.bootstrap, [0, 1])
                states[name] = client.wait(7, timeout_s=10)
            with urllib.request.urlopen(ready["http_address"] + "/metrics", timeout=5) as response:
                text = response.read().decode()
            if name == "wrong-key":  # the decode side counts the failed handshake too
                assert 'pd_transfer_auth_failures_total{reason="auth_failed",role="decode"} 1.0' in text
    finally:
        for sidecar in sidecars.values():
            sidecar.stop()
        for pool in pools:
            pool.close()
    assert states["no-key"].status is RoomStatus.FAILED
    assert states["no-key"].code is Reason.UNAUTHENTICATED, states
    assert "requires authentication" in states["no-key"].reason
    assert states["wrong-key"].code is Reason.AUTH_FAILED, states
    assert "did not prove it holds the shared secret" in states["wrong-key"].reason
    for reason, count in before.items():
        assert metric(secured, P0, AUTH_FAILURES, reason=reason) > count


def test_wrong_keys_are_refused_on_control_bootstrap_and_worker_sockets(secured):
    wrong = security(WRONG_HEX)

    async def open_session(context):
        channel = OutgoingChannel(context, _control(secured), Role.DECODE, "prefill 0")
        channel.start(lambda ch, msg: None)
        try:
            await channel.send(Hello(agent_id="intruder", role=Role.DECODE))
        finally:
            channel.close()

    with pytest.raises(AuthError, match="did not prove it holds the shared secret"):
        run_with(wrong, open_session)
    with pytest.raises(AuthError) as err:
        run_with(wrong, lambda ctx: fetch_table(ctx, secured.bootstrap, "intruder", 3.0))
    assert err.value.code is Reason.AUTH_FAILED
    with (
        Client(
            secured.sidecars[P0].endpoint, "intruder", timeout_s=3, secret=bytes.fromhex(WRONG_HEX)
        ) as worker,
        pytest.raises(AuthFailed),
    ):
        worker.poll(1)
    # the right key through the same code paths is accepted
    table = run_with(security(SECRET_HEX), lambda ctx: fetch_table(ctx, secured.bootstrap, "ok", 3.0))
    assert table.complete


def test_a_replayed_handshake_is_refused_and_counted(secured):
    before = metric(secured, P0, AUTH_FAILURES, reason="auth_replayed")
    key = parse_secret(SECRET_HEX.encode(), "test")
    good = RawPeer(_control(secured), new_routing_id())
    try:  # capture a good connection's handshake
        handshake = ClientHandshake(key, "decode-captured")
        hello = handshake.hello()
        proof = handshake.receive(good.ask(hello))
        assert decode_auth(good.ask(proof)).accepted
    finally:
        good.close()
    replayer = RawPeer(_control(secured), new_routing_id())
    try:
        refused = decode_auth(replayer.ask(hello))  # the captured hello, again
        assert isinstance(refused, AuthResult) and refused.reason is Reason.AUTH_REPLAYED
        # a refused connection gets no further answer: it is ended
        assert replayer.ask(encode(Hello(agent_id="replayer", role=Role.DECODE)), timeout_s=1.0) is None
    finally:
        replayer.close()
    replayer = RawPeer(_control(secured), new_routing_id())
    try:
        fresh = ClientHandshake(key, "decode-captured").hello()
        assert replayer.ask(fresh) is not None  # a new challenge ...
        refused = decode_auth(replayer.ask(proof))  # ... answered with the old proof
        assert refused.reason is Reason.AUTH_REPLAYED
    finally:
        replayer.close()
    stranger = RawPeer(_control(secured), new_routing_id())
    try:
        closed = decode(stranger.ask(encode(Hello(agent_id="replayer", role=Role.DECODE))))
        assert isinstance(closed, Close) and closed.reason is Reason.UNAUTHENTICATED
    finally:
        stranger.close()
    assert metric(secured, P0, AUTH_FAILURES, reason="auth_replayed") >= before + 2


@pytest.fixture
def own(workdir):
    """A secured cluster of the test's own, whose room 1 landed."""
    secret = write_secret(workdir, "own-secret", SECRET_HEX)
    cluster = start(workdir, ranks(Role.PREFILL, 2), ranks(Role.DECODE, 1), secret)
    try:
        _transfer(cluster, 1)
        yield cluster
    finally:
        cluster.close()


def test_async_clients_authenticate_once_for_concurrent_calls_or_fail_with_the_reason(own, no_secret):
    async def calls(secret):
        async with AsyncClient(
            own.sidecars[P0].endpoint, "async-worker", timeout_s=5, secret=secret
        ) as client:
            return await asyncio.gather(*(client.poll(1) for _ in range(4)), return_exceptions=True)

    # decode reports room 1 landed before prefill hears the acknowledgement: wait for P0's own word
    assert own.clients[P0].wait(1, timeout_s=30).status is RoomStatus.SUCCESS
    served = asyncio.run(calls(SECRET_HEX))
    assert [s.status for s in served] == [RoomStatus.SUCCESS] * 4
    assert all(
        isinstance(e, AuthFailed) and e.code is Reason.AUTH_FAILED for e in asyncio.run(calls(WRONG_HEX))
    )
    assert all(isinstance(e, Refused) and e.code is Reason.UNAUTHENTICATED for e in asyncio.run(calls(None)))


def test_prefill_keeps_serving_the_good_decode_afterwards(secured):
    _transfer(secured, 2)


def test_the_secret_never_appears_in_logs_or_ready_files(secured):
    # every sidecar of this module: the good ones, and the no-key and wrong-key decodes
    texts = [p.read_text() for p in secured.workdir.glob("*.log")]
    texts += [p.read_text() for p in secured.workdir.glob("*.ready.json")]
    assert len(texts) >= 5 and any("shared-secret authentication on" in t for t in texts)
    for text in texts:
        for secret in (SECRET_HEX, SECRET_HEX.upper(), WRONG_HEX, WRONG_HEX.upper()):
            assert secret not in text
