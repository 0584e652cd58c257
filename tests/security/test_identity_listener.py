"""Identity both ways: a decode holding the allow-list talks only to the prefill it names.

Every sidecar holds the shared secret, the deployment's CURVE key and an identity
key of its own; the prefill and the decode both hold ``identity_allow_file``. A
prefill's control port then serves with its identity key and announces it in
its rank entry; the decode connects expecting the key listed for that
prefill's agent id. A real pair completes a room. A rogue member (the secret,
the deployment's key, a listed prefill key of its own) then poses as that
prefill: it runs a bootstrap whose table names the real prefill's agent id at
the rogue's own control port, and the decode's worker is pointed at it. The
rogue's control port answers the shared-secret handshake as a real prefill
would, and records every frame that gets past it. In each variant the decode
never opens a session with the rogue, and its room fails:

- the entry names no key (the rogue serves with the deployment's key):
  refused before connecting, ``identity_mismatch``, counted;
- the entry names the rogue's own listed key: refused the same way;
- the entry names the real prefill's key (the rogue does not hold its secret
  half): the CURVE handshake never completes, so no frame reaches the rogue.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq
from secure_cluster import metric, ranks, requests, start
from test_identity import _identity

from pd_transfer.agent.auth import SecureContext, Security
from pd_transfer.agent.bootstrap import BootstrapServer
from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import RankEntry
from pd_transfer.security import Decision, SecuritySettings, load_secret
from pd_transfer.security.curve import read_secret_key, write_keys

P0, D0 = "prefill[pp0,tp0]", "decode[pp0,tp0]"
TAG = "mutual"
PREFILL_ID, DECODE_ID = f"prefill-pp0-tp0-{TAG}", f"decode-pp0-tp0-{TAG}"
FAILURES = "pd_transfer_auth_failures_total"


@pytest.fixture(scope="module")
def keys(workdir):
    write_keys(str(workdir / "deployment"))
    made = {
        name: _identity(workdir, *who)
        for name, who in {
            "prefill": ("prefill", PREFILL_ID),
            "decode": ("decode", DECODE_ID, "dec-A"),
            "rogue": ("prefill", "prefill-rogue"),
        }.items()
    }
    allow = workdir / "allow.txt"
    allow.write_text("\n".join(line for _, line in made.values()) + "\n")
    return {"deployment": workdir / "deployment", "allow": allow, **{k: v[0] for k, v in made.items()}}


@pytest.fixture(scope="module")
def mutual(workdir, keys):
    deployment = keys["deployment"]
    both = {"curve_secret_key_file": str(deployment / "curve.key"), "identity_allow_file": str(keys["allow"])}
    cluster = start(
        workdir,
        ranks(Role.PREFILL, 1),
        ranks(Role.DECODE, 1),
        deployment / "secret",
        {**both, "identity_key_file": str(keys["prefill"])},
        decode_config={**both, "identity_key_file": str(keys["decode"]), "instance_id": "dec-A"},
        tag=TAG,
    )
    yield cluster
    cluster.close()


class Rogue:
    """A member posing as the real prefill: a bootstrap listing ``PREFILL_ID`` at its own
    control port (announcing ``control_key``), and that control port, which answers the
    shared-secret handshake as a prefill does and keeps every frame that passes it."""

    def __init__(self, keys, control_key_of) -> None:
        deployment = keys["deployment"]
        settings = SecuritySettings(
            secret=load_secret(str(deployment / "secret"), {}),
            curve_keypair=read_secret_key(str(deployment / "curve.key")),
            curve_server_key=read_secret_key(str(deployment / "curve.key")).public,
            identity_keypair=read_secret_key(str(keys["rogue"]), "identity_key_file"),
        )
        self.security = Security(settings, "prefill-rogue", handshake_timeout_s=10.0)
        self.control_key_of = control_key_of  # (the rogue's own key) -> the key its entry names
        self.passed: list[bytes] = []  # frames of sessions the decode opened with the rogue
        self.bootstrap = ""
        self._up = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    def __enter__(self) -> Rogue:
        self._thread.start()
        assert self._up.wait(30), "the rogue did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        context = SecureContext(self.security)
        control = context.socket(zmq.ROUTER)
        control.setsockopt(zmq.LINGER, 0)
        self.security.listening(control, as_self=True)  # its own identity key
        port = control.bind_to_random_port("tcp://127.0.0.1")
        bootstrap = BootstrapServer(context, "tcp://127.0.0.1:*")
        bootstrap.add(
            RankEntry(
                agent_id=PREFILL_ID,
                host_id="h",
                control_address=f"tcp://127.0.0.1:{port}",
                pp_size=1,
                geometry=ranks(Role.PREFILL, 1)[0],
                control_key=self.control_key_of(self.security.control_key),
            )
        )
        self.bootstrap = bootstrap.address
        tasks = [asyncio.create_task(bootstrap.serve()), asyncio.create_task(self._answer(control))]
        self._up.set()
        await self._stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        bootstrap.close()
        control.close(linger=0)
        context.term()

    async def _answer(self, control) -> None:
        gate = self.security.gate()
        while True:
            identity, frame = await control.recv_multipart()
            admission = gate.admit(identity, frame)
            if admission.decision is Decision.PASS:
                self.passed.append(frame)
            elif admission.reply is not None:
                await control.send_multipart([identity, admission.reply])


def test_a_real_pair_completes_a_room_with_both_sides_checked(mutual):
    mutual.expect(1, requests(1))
    mutual.send(1, requests(1))
    states = mutual.wait_decode(1, timeout_s=30)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, mutual.logs())
    assert mutual.verify_landed(1, requests(1)) == []


def _real_key(keys) -> str:
    return read_secret_key(str(keys["prefill"]), "identity_key_file").public


@pytest.mark.parametrize(
    ("variant", "room"),
    [("no key", 2), ("its own key", 3), ("the real prefill's key", 4)],
)
def test_a_rogue_posing_as_the_prefill_gets_no_session(mutual, keys, variant, room):
    control_key_of = {
        "no key": lambda own: "",
        "its own key": lambda own: own,
        "the real prefill's key": lambda own: _real_key(keys),
    }[variant]
    before = metric(mutual, D0, FAILURES, reason="identity_mismatch")
    real_bootstrap = mutual.bootstrap
    with Rogue(keys, control_key_of) as rogue:
        mutual.bootstrap = rogue.bootstrap  # the decode's worker is told the rogue's bootstrap
        try:
            mutual.expect(room, requests(2))  # its pages: nothing lands
        finally:
            mutual.bootstrap = real_bootstrap
        state = mutual.wait_decode(room, timeout_s=60)[D0]
        assert state.status is RoomStatus.FAILED, (state, mutual.logs())
        assert rogue.passed == [], f"the decode opened a session with the rogue ({variant})"
    if variant != "the real prefill's key":
        assert state.code is not None and state.code.value == "identity_mismatch", state
        assert metric(mutual, D0, FAILURES, reason="identity_mismatch") >= before + 1
