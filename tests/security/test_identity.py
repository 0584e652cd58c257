"""Identity, not only membership: with per-sidecar keys a member can act only as itself.

Every sidecar of the deployment holds the shared secret and the deployment's
CURVE key; each also holds an identity key of its own (``identity_key_file``,
written by ``pd-transfer identity``), and the prefill lists who each public key
is (``identity_allow_file``). A real decode still completes a room. A member
holding the secret and a listed key of its own (``decode-evil``, instance
``dec-B``) then tries the two attacks of a secret holder:

- it claims the real decode's agent id in its handshake, to replay that
  decode's Register (same agent id, host id): refused at the hello with
  ``identity_mismatch``, and counted;
- it authenticates as itself and registers for the real decode's instance
  ``dec-A``, to take its rooms: refused with a Close ``identity_mismatch``,
  counted, and its connection ends;
- it announces a prefill rank to the bootstrap with its decode key: refused
  with ``identity_mismatch``, and the table is unchanged; so is a prefill's
  announcement naming another key than its own for its control port;
- a secret holder presenting no listed key does not get through the CURVE
  handshake at all (counted by the ZAP handler).

With identities off (the shared secret only), the first attack's handshake is
accepted and its Register answered, as it always was: that is what the
option exists to close.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from secure_cluster import metric, ranks, requests, run_with, start

from pd_transfer.agent.auth import Security, authenticate
from pd_transfer.agent.bootstrap import fetch_table
from pd_transfer.agent.channels import OutgoingChannel
from pd_transfer.client import RoomStatus
from pd_transfer.errors import AuthError, PdTransferError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Close, Hello, RankEntry, Register
from pd_transfer.security import SecuritySettings, load_secret
from pd_transfer.security.curve import read_secret_key, write_keys

P0 = "prefill[pp0,tp0]"
TAG = "identity"
PREFILL_ID, DECODE_ID = f"prefill-pp0-tp0-{TAG}", f"decode-pp0-tp0-{TAG}"
FAILURES = "pd_transfer_auth_failures_total"


def _identity(workdir: Path, role: str, agent_id: str, instance: str = "") -> tuple[Path, str]:
    """``pd-transfer identity``: the key file and the printed allow-list line."""
    out = workdir / agent_id
    command = [sys.executable, "-m", "pd_transfer.cli", "identity", "--role", role, "--agent-id", agent_id]
    command += ["--out", str(out)] + (["--instance-id", instance] if instance else [])
    line = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()
    return out / "identity.key", line


@pytest.fixture(scope="module")
def keys(workdir):
    write_keys(str(workdir / "deployment"))
    made = {
        name: _identity(workdir, *who)
        for name, who in {
            "prefill": ("prefill", PREFILL_ID),
            "decode": ("decode", DECODE_ID, "dec-A"),
            "evil": ("decode", "decode-evil", "dec-B"),
        }.items()
    }
    allow = workdir / "allow.txt"
    allow.write_text("# who may connect\n" + "\n".join(line for _, line in made.values()) + "\n")
    return {"deployment": workdir / "deployment", "allow": allow, **{k: v[0] for k, v in made.items()}}


def _cluster(workdir, keys, identities: bool):
    deployment = keys["deployment"]
    config = {"curve_secret_key_file": str(deployment / "curve.key")}
    prefill, decode = dict(config), {**config, "instance_id": "dec-A"}
    if identities:
        prefill |= {"identity_key_file": str(keys["prefill"]), "identity_allow_file": str(keys["allow"])}
        decode |= {"identity_key_file": str(keys["decode"])}
    return start(
        workdir,
        ranks(Role.PREFILL, 1),
        ranks(Role.DECODE, 1),
        deployment / "secret",
        prefill,
        decode_config=decode,
        tag=TAG if identities else "",
    )


@pytest.fixture(scope="module")
def checked(workdir, keys):
    cluster = _cluster(workdir, keys, identities=True)
    yield cluster
    cluster.close()


def _member(keys, agent_id: str, identity_key: Path | None) -> Security:
    deployment = keys["deployment"]
    settings = SecuritySettings(
        secret=load_secret(str(deployment / "secret"), {}),
        curve_server_key=read_secret_key(str(deployment / "curve.key")).public,
        identity_keypair=read_secret_key(str(identity_key), "identity_key_file") if identity_key else None,
    )
    return Security(settings, agent_id, handshake_timeout_s=3.0)


def _control_key(keys) -> str:
    """The key the identified prefill's control port serves with (its identity key's
    public half: public, as the rank table shows it to every member)."""
    return read_secret_key(str(keys["prefill"]), "identity_key_file").public


def _register_as(cluster, security_: Security, agent_id: str, instance: str, server_key: str = ""):
    """Open a control session as ``security_``'s agent and register as ``agent_id`` of
    ``instance``: the first reply to the Register (a Register back, or a Close)."""
    address = cluster.ready[P0]["control_address"]
    geometry = ranks(Role.DECODE, 1)[0]

    async def attempt(context):
        got = asyncio.Queue()
        channel = OutgoingChannel(context, address, Role.DECODE, "prefill 0", server_key)
        channel.start(lambda ch, message: got.put_nowait(message))
        try:
            await channel.send(Hello(agent_id=security_.agent_id, role=Role.DECODE))
            assert isinstance(await asyncio.wait_for(got.get(), 10), Hello)
            await channel.send(Register(agent_id=agent_id, host_id="h", geometry=geometry, instance=instance))
            while True:
                message = await asyncio.wait_for(got.get(), 10)
                if isinstance(message, (Register, Close)):
                    return message
        finally:
            channel.close()

    return run_with(security_, attempt)


def test_a_real_pair_completes_a_room_with_identities_checked(checked):
    checked.expect(1, requests(1))
    checked.send(1, requests(1))
    states = checked.wait_decode(1, timeout_s=30)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, checked.logs())
    assert checked.verify_landed(1, requests(1)) == []


def test_a_member_claiming_another_decodes_agent_id_is_refused_and_counted(checked, keys):
    before = metric(checked, P0, FAILURES, reason="identity_mismatch")
    impostor = _member(keys, DECODE_ID, keys["evil"])  # evil's key, the real decode's name
    with pytest.raises(AuthError) as refused:
        _register_as(checked, impostor, DECODE_ID, "dec-A", _control_key(keys))
    assert refused.value.code is Reason.IDENTITY_MISMATCH
    assert f"claims agent id '{DECODE_ID}', but its identity key is 'decode-evil''s" in refused.value.message
    assert metric(checked, P0, FAILURES, reason="identity_mismatch") >= before + 1


def test_a_member_registering_for_another_decodes_instance_is_refused_and_counted(checked, keys):
    before = metric(checked, P0, FAILURES, reason="identity_mismatch")
    evil = _member(keys, "decode-evil", keys["evil"])
    closed = _register_as(checked, evil, "decode-evil", "dec-A", _control_key(keys))  # dec-A: the real one's
    assert isinstance(closed, Close) and closed.reason is Reason.IDENTITY_MISMATCH, closed
    assert "registered for decode instance 'dec-A'" in closed.reason_text
    assert "of instance 'dec-B'" in closed.reason_text
    assert metric(checked, P0, FAILURES, reason="identity_mismatch") >= before + 1
    # as itself, of its own instance, the same member is served
    accepted = _register_as(checked, evil, "decode-evil", "dec-B", _control_key(keys))
    assert isinstance(accepted, Register), accepted


def test_a_decode_key_cannot_announce_a_prefill_rank(checked, keys):
    before = metric(checked, P0, FAILURES, reason="identity_mismatch")
    evil = _member(keys, "decode-evil", keys["evil"])
    entry = RankEntry(
        agent_id=PREFILL_ID,
        host_id="h",
        control_address="tcp://127.0.0.1:9",
        pp_size=1,
        geometry=ranks(Role.PREFILL, 1)[0],
    )
    with pytest.raises(PdTransferError) as refused:
        run_with(evil, lambda context: fetch_table(context, checked.bootstrap, "decode-evil", 5.0, entry))
    assert refused.value.code is Reason.IDENTITY_MISMATCH, refused.value
    assert "a decode identity announced prefill rank" in refused.value.message
    assert metric(checked, P0, FAILURES, reason="identity_mismatch") >= before + 1
    table = run_with(evil, lambda context: fetch_table(context, checked.bootstrap, "decode-evil", 5.0))
    assert [e.control_address for e in table.entries] == [checked.ready[P0]["control_address"]]


def test_a_prefill_cannot_announce_another_key_for_its_control_port(checked, keys):
    before = metric(checked, P0, FAILURES, reason="identity_mismatch")
    prefill = _member(keys, PREFILL_ID, keys["prefill"])  # the prefill's own key and name
    entry = RankEntry(
        agent_id=PREFILL_ID,
        host_id="h",
        control_address="tcp://127.0.0.1:9",
        pp_size=1,
        geometry=ranks(Role.PREFILL, 1)[0],
        control_key=read_secret_key(str(keys["evil"]), "identity_key_file").public,
    )
    with pytest.raises(PdTransferError) as refused:
        run_with(prefill, lambda context: fetch_table(context, checked.bootstrap, PREFILL_ID, 5.0, entry))
    assert refused.value.code is Reason.IDENTITY_MISMATCH, refused.value
    assert "naming another control key than its own" in refused.value.message
    assert metric(checked, P0, FAILURES, reason="identity_mismatch") >= before + 1
    table = run_with(prefill, lambda context: fetch_table(context, checked.bootstrap, PREFILL_ID, 5.0))
    assert [e.control_address for e in table.entries] == [checked.ready[P0]["control_address"]]
    assert [e.control_key for e in table.entries] == [_control_key(keys)]


def test_a_secret_holder_without_a_listed_key_does_not_get_in(checked, keys):
    before = metric(checked, P0, FAILURES, reason="identity_mismatch")
    stranger = _member(keys, "decode-unlisted", None)  # the secret, a throwaway CURVE key

    async def attempt(context):
        import zmq

        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        stranger.connecting(socket, _control_key(keys))
        socket.connect(checked.ready[P0]["control_address"])
        try:
            await authenticate(socket, stranger, "prefill 0", timeout_s=2.0)
        finally:
            socket.close(linger=0)

    with pytest.raises(PdTransferError) as refused:
        run_with(stranger, attempt)
    assert refused.value.code is Reason.TIMEOUT  # the CURVE handshake never completed
    assert metric(checked, P0, FAILURES, reason="identity_mismatch") >= before + 1


def test_without_identities_a_member_may_still_claim_another_agent_id(workdir, keys):
    cluster = _cluster(workdir, keys, identities=False)
    try:
        decode_id = cluster.sidecars["decode[pp0,tp0]"].name
        impostor = _member(keys, decode_id, None)
        answered = _register_as(cluster, impostor, decode_id, "dec-A")
        assert isinstance(answered, Register), answered  # membership only, as documented
    finally:
        cluster.close()
